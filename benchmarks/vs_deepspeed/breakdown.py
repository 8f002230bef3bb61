"""Where one of our training steps spends its time, per phase, on 4 forked ranks (the step-time cases of
run.py): forward + backward of all micro-batches, zero1's gradient reduce-scatter (part of the backward
phase, also shown alone), clipping, AdamW, zero1's all-gather of the updated weights.

    .venv/bin/python benchmarks/vs_deepspeed/breakdown.py --mode zero1
    .venv/bin/python benchmarks/vs_deepspeed/breakdown.py --mode fsdp --layout 2,1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # the ranks timed as the trainer's run, with glibc keeping freed memory
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import run as bench  # noqa: E402  (this folder's run.py)

from elastic_trainer.config import DP_MODES, load_model_config  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402


def _timed(times: dict, name: str, fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    return call


def job(rank, world, model, layout, seq_len, steps, warmup, tokens) -> dict:
    bench.quiet()
    trainer = bench.our_trainer(model, layout, seq_len, tokens)
    engine, times = trainer.engine, {}
    engine.forward_backward = _timed(times, "forward+backward", engine.forward_backward)
    engine.clip_grad_norm_ = _timed(times, "clip", engine.clip_grad_norm_)
    trainer.optimizer.step = _timed(times, "adamw", trainer.optimizer.step)
    if engine.zero is not None:
        engine.zero.reduce = _timed(times, "  of which reduce-scatter", engine.zero.reduce)
        engine.zero.gather = _timed(times, "all-gather", engine.zero.gather)
    for _ in range(warmup + steps):
        _timed(times, "step", trainer.train_step)()
    return {k: v[warmup:] for k, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small")
    p.add_argument("--layout", default="4,1,1", help="dp,tp,pp over 4 ranks")
    p.add_argument("--mode", choices=DP_MODES, default="zero1")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    dp, tp, pp = (int(x) for x in args.layout.split(","))
    layout = Layout(dp, tp, pp, args.micro_batch, args.global_batch // (dp * args.micro_batch), dp_mode=args.mode)
    tokens = bench.tokens_for(load_model_config(args.model), args.seq_len)
    results = run_ranks(
        job, layout.world_size, args.model, layout, args.seq_len, args.steps, args.warmup, tokens, timeout=bench.TIMEOUT
    )
    print(
        f"{args.model}, {layout.describe()}, batch {args.global_batch} x {args.seq_len}: seconds per step, "
        f"median over {args.steps} steps of each rank, then the range over ranks"
    )
    order = ["step", "forward+backward", "  of which reduce-scatter", "clip", "adamw", "all-gather"]
    for phase in [p for p in order if p in results[0]]:
        medians = [statistics.median(r[phase]) for r in results]
        print(f"  {phase:<26} {min(medians):6.2f} - {max(medians):6.2f}")


if __name__ == "__main__":
    main()
