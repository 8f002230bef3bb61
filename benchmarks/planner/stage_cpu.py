"""Where a CPU layout's step time goes, rank by rank: the CPU seconds each rank uses per step (all its threads,
`getrusage`) beside the step-time model's core-seconds for its stage (plan/step_time.py: the stage's compute for
every micro-batch, and its share of the optimizer), and the step's wall time beside the prediction.

On a host whose ranks share its cores, a layout's step is its ranks' work packed onto the cores: when a
prediction is off, this says whether the work itself (a stage's compute) or the packing (the schedule on
shared cores, plan/shared_cores.py) is. Layouts as in heap.py (dp,tp,pp,micro_batch,num_microbatches,dp_mode):

    python benchmarks/planner/stage_cpu.py --model gpt3-small --layouts 1,1,4,4,2,fsdp 2,1,2,4,1,ddp
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":  # measured with the allocator the trainer's CPU ranks get
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from heap import parse_layout  # noqa: E402  (this folder's heap.py)

from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan import load_hardware  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.plan.memory import stage_numel  # noqa: E402
from elastic_trainer.plan.step_time import step_time  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def cpu_steps(rank: int, world: int, model, cfg: TrainConfig, layout: Layout, tokens: np.ndarray) -> dict:
    """One rank's stage, and its wall and CPU seconds per step."""
    trainer = Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    wall, cpu = [], []
    for _ in range(cfg.steps):
        before = _cpu_s()
        wall.append(trainer.train_step()["step_time_s"])
        cpu.append(_cpu_s() - before)
    return {"rank": rank, "stage": trainer.engine.coords.pp, "wall_s": wall, "cpu_s": cpu}


def modelled(model, layout: Layout, seq_len: int, hw) -> tuple[float, list[float]]:
    """(predicted step seconds, the model's core-seconds per step of a rank of each stage)."""
    t = step_time(model, layout, seq_len, "fp32", hw, layout.world_size)
    shard = layout.dp if layout.dp_mode in ("fsdp", "zero1") else 1
    optimizer = [
        stage_numel(model, layout, s) / shard * hw.optimizer_ns(layout.dp_mode) * 1e-9 for s in range(layout.pp)
    ]
    return t.total, [s.compute * layout.num_microbatches + o for s, o in zip(t.stages, optimizer)]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--steps", type=int, default=4, help="steps per layout; the first is left out")
    p.add_argument("--layouts", nargs="+", required=True, help="dp,tp,pp,micro_batch,num_microbatches,dp_mode")
    p.add_argument("--out", help="JSON file of the results")
    args = p.parse_args(argv)
    model, hw = load_model_config(args.model), load_hardware(args.hardware)
    cfg = TrainConfig(
        global_batch=args.global_batch, seq_len=args.seq_len, steps=args.steps, seed=0, dtype="fp32", warmup_steps=1
    )
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 200_000, dtype=np.int64)
    out = []
    for layout in map(parse_layout, args.layouts):
        predicted, per_stage = modelled(model, layout, args.seq_len, hw)
        ranks = run_ranks(cpu_steps, layout.world_size, model, cfg, layout, tokens, timeout=1800)
        wall = statistics.median(max(r["wall_s"][i] for r in ranks) for i in range(1, cfg.steps))
        rows = [
            {
                "rank": r["rank"],
                "stage": r["stage"],
                "cpu_s": round(statistics.median(r["cpu_s"][1:]), 3),
                "model_core_s": round(per_stage[r["stage"]], 3),
            }
            for r in ranks
        ]
        print(
            f"{args.model} {layout.describe()}: wall {wall:.2f} s (predicted {predicted:.2f}); CPU s per step of "
            f"each rank (stage: measured / modelled): "
            + ", ".join(f"s{r['stage']} {r['cpu_s']:.2f}/{r['model_core_s']:.2f}" for r in rows),
            flush=True,
        )
        out.append(
            {
                "model": args.model,
                "layout": layout.to_dict(),
                "wall_s": round(wall, 3),
                "predicted_s": round(predicted, 3),
                "ranks": rows,
            }
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw.name, "steps": args.steps, "layouts": out}, indent=1))
    return out


if __name__ == "__main__":
    main()
