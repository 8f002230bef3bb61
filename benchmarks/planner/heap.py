"""The memory a CPU rank keeps, against the planner's peak for its stage.

Since CPU ranks keep the memory they free (elastic_trainer/launch/allocator.py), a rank's heap grows to its
largest footprint and stays there: the memory the host must hold is that heap, not the live bytes the
planner's model counts (plan/memory.py). This trains each layout a few steps on forked gloo ranks, as
benchmarks/planner/run.py does, and reads every rank's anonymous resident memory (`RssAnon`; the heap with
freed memory kept) before it builds its trainer and after each step. It prints, per rank, the planner's
peak for the rank's stage beside the growth of its heap, and writes them to a JSON file:

    python benchmarks/planner/heap.py --model gpt3-small --ranks 4 --layouts 2,1,2,4,1,zero1 1,1,4,1,8,fsdp
    python benchmarks/planner/heap.py --model gpt3-medium --ranks 4 --top 6 --out /tmp/heap-medium.json

A layout is dp,tp,pp,micro_batch,num_microbatches,dp_mode; `--top N` takes the planner's first N instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # measured with the allocator the trainer's CPU ranks get
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.launch.allocator import kept_bytes  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan import Request, load_hardware, plan  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.plan.memory import stage_memories  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402

GIB = 2**30
NOTE = (
    "benchmarks/planner/heap.py: each rank's RssAnon in GiB before building (start), after building (built) and "
    "after each step; kept_gib = the largest growth over start; planned_gib = plan/memory.py's live peak"
)


def heap_steps(rank: int, world: int, model, cfg: TrainConfig, layout: Layout, tokens: np.ndarray) -> dict:
    """One rank's anonymous memory (GiB) before and after building its trainer and after each step."""
    start = kept_bytes() / GIB
    trainer = Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    built = kept_bytes() / GIB
    after, times = [], []
    for _ in range(cfg.steps):
        times.append(round(trainer.train_step()["step_time_s"], 3))
        after.append(round(kept_bytes() / GIB, 4))
    return {
        "rank": rank,
        "stage": trainer.engine.coords.pp,
        "start": round(start, 4),
        "built": round(built, 4),
        "after_step": after,
        "step_s": times,
    }


def parse_layout(text: str) -> Layout:
    dp, tp, pp, mb, nmb, mode = text.split(",")
    return Layout(dp=int(dp), tp=int(tp), pp=int(pp), micro_batch=int(mb), num_microbatches=int(nmb), dp_mode=mode)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layouts", nargs="*", default=[], help="dp,tp,pp,micro_batch,num_microbatches,dp_mode")
    p.add_argument("--top", type=int, default=0, help="the planner's first N layouts")
    p.add_argument("--out", help="JSON file of the results (appended to when it exists)")
    args = p.parse_args(argv)
    model, hw = load_model_config(args.model), load_hardware(args.hardware)
    layouts = [parse_layout(t) for t in args.layouts]
    if args.top:
        req = Request(
            model, args.ranks, args.global_batch, args.seq_len, hw, args.ranks, dtype="fp32", recompute=(False,)
        )
        layouts += [c.layout for c in plan(req).candidates[: args.top]]
    cfg = TrainConfig(
        global_batch=args.global_batch, seq_len=args.seq_len, steps=args.steps, seed=0, dtype="fp32", warmup_steps=1
    )
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 200_000, dtype=np.int64)
    result = (
        json.loads(Path(args.out).read_text())
        if args.out and Path(args.out).exists()
        else {"note": NOTE, "layouts": []}
    )
    out = result["layouts"]
    for layout in layouts:
        planned = [m.total for m in stage_memories(model, layout, args.seq_len, "fp32")]
        t0 = time.perf_counter()
        try:
            ranks = run_ranks(heap_steps, layout.world_size, model, cfg, layout, tokens, timeout=1800)
        except RuntimeError as e:
            print(f"{layout.describe()}: FAILED {str(e).splitlines()[0]}", flush=True)
            out.append(
                {
                    "model": args.model,
                    "layout": layout.to_dict(),
                    "steps": args.steps,
                    "planned_gib": [round(p / GIB, 4) for p in planned],
                    "failed": str(e).splitlines()[0],
                }
            )
            continue
        rows = []
        for r in ranks:
            grown = [a - r["start"] for a in r["after_step"]]
            rows.append(
                {
                    **r,
                    "planned_gib": round(planned[r["stage"]] / GIB, 4),
                    "kept_gib": round(max(grown), 4),
                    "base_gib": r["start"],
                }
            )
        worst = max(rows, key=lambda r: r["kept_gib"] / r["planned_gib"])
        print(
            f"{layout.describe()} ({time.perf_counter() - t0:.0f} s): per rank planned / kept GiB "
            + ", ".join(f"s{r['stage']} {r['planned_gib']:.2f}/{r['kept_gib']:.2f}" for r in rows)
            + f"; largest ratio {worst['kept_gib'] / worst['planned_gib']:.2f}; base {rows[0]['base_gib']:.2f}; "
            f"steps {', '.join(f'{s:.1f}' for s in rows[0]['step_s'])} s",
            flush=True,
        )
        out.append({"model": args.model, "layout": layout.to_dict(), "steps": args.steps, "ranks": rows})
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
