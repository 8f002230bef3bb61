"""gloo's reduce-scatter and all-gather against ours (parallel/gloo_comms.py), on forked CPU ranks: each
collective alone, and whole training steps of zero1 and fsdp with either.

1. Collectives: groups of `--group` ranks out of `--ranks` forked ranks (all groups at once, as a job's dp
   groups run), the slowest rank's median of `--repeat` calls per size, with an all-reduce of the same bytes
   beside them and the minor page faults of a call.
2. Steps (`--steps-model`): the model trained under `--layout` in zero1 and fsdp, each with gloo's own
   collectives and with ours, interleaved over `--rounds` rounds; the slowest rank's step time, the median over
   the measured steps.

Prints each pair's ratio (gloo's time / ours) and writes `--out`.

    .venv/bin/python benchmarks/collectives/run.py                                # about 8 minutes
    .venv/bin/python benchmarks/collectives/run.py --steps-model none --sizes 32  # collectives only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # the ranks run as the trainer's, with glibc keeping freed memory
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic_trainer.parallel import data_parallel, gloo_comms  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent


def _collectives(rank: int, world: int, group_size: int, sizes_mb: list[float], repeat: int) -> dict:
    groups = [dist.new_group(list(range(g, g + group_size))) for g in range(0, world, group_size)]
    group = groups[rank // group_size]
    out = {}
    for mb in sizes_mb:
        whole = torch.ones(int(mb * 2**20) // 4 // group_size * group_size)
        part = torch.ones(whole.numel() // group_size)
        calls = {
            "all-reduce": lambda: dist.all_reduce(whole, group=group),
            "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
            "our reduce-scatter": lambda: gloo_comms.reduce_scatter(part, whole, group),
            "gloo all-gather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
            "our all-gather": lambda: gloo_comms.all_gather(whole, part, group),
        }
        for name, call in calls.items():
            call()  # untimed first
            times, faults = [], []
            for _ in range(repeat):
                dist.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            out[f"{mb:g} {name}"] = (statistics.median(times), statistics.median(faults))
    return out


def _steps(rank: int, world: int, model, layout, steps: int) -> list[float]:
    from elastic_trainer.parallel.calibrate_modes import probe_trainer

    trainer = probe_trainer(model, layout, 128, torch.device("cpu"), "fp32", steps)
    return [trainer.train_step()["step_time_s"] for _ in range(steps)]


def gloo_own() -> dict:
    """Switch this process (and the ranks it forks) to gloo's own collectives; returns what to restore."""
    saved = {"is_gloo": gloo_comms.is_gloo, "use_in_fsdp": data_parallel.use_in_fsdp}
    gloo_comms.is_gloo = lambda group: False
    data_parallel.use_in_fsdp = lambda model, group: False
    return saved


def restore(saved: dict) -> None:
    gloo_comms.is_gloo, data_parallel.use_in_fsdp = saved["is_gloo"], saved["use_in_fsdp"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2:2,8:4,8:2", help="RANKS:GROUP pairs of the collectives part")
    p.add_argument("--sizes", default="32,128,310", help="buffer sizes in MB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps-model", default="gpt3-small", help="model of the steps part ('none': skip it)")
    p.add_argument("--layout", default="4,1,2,1", help="DP,TP,PP,MICRO_BATCH of the steps part (global batch 8)")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first two are not measured")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    result = {"torch": torch.__version__, "collectives": [], "steps": []}
    for pair in args.ranks.split(","):
        world, group = (int(v) for v in pair.split(":"))
        per_rank = run_ranks(_collectives, world, group, sizes, args.repeat, timeout=900)
        for mb in sizes:
            row = {"ranks": world, "group": group, "mb": mb}
            for name in (
                "all-reduce",
                "gloo reduce-scatter",
                "our reduce-scatter",
                "gloo all-gather",
                "our all-gather",
            ):
                key = f"{mb:g} {name}"
                row[name] = round(max(r[key][0] for r in per_rank), 4)
                row[name + " faults"] = max(r[key][1] for r in per_rank)
            result["collectives"].append(row)
            print(
                f"[collectives] {world} ranks, groups of {group}, {mb:g} MB: all-reduce {row['all-reduce']:.3f} s; "
                f"reduce-scatter gloo {row['gloo reduce-scatter']:.3f} / ours {row['our reduce-scatter']:.3f} s "
                f"({row['gloo reduce-scatter'] / row['our reduce-scatter']:.2f}x), all-gather gloo "
                f"{row['gloo all-gather']:.3f} / ours {row['our all-gather']:.3f} s "
                f"({row['gloo all-gather'] / row['our all-gather']:.2f}x); faults per call gloo "
                f"{row['gloo reduce-scatter faults']:.0f} + {row['gloo all-gather faults']:.0f}, ours "
                f"{row['our reduce-scatter faults']:.0f} + {row['our all-gather faults']:.0f}",
                flush=True,
            )
    if args.steps_model != "none":
        from elastic_trainer.config import load_model_config
        from elastic_trainer.plan.layout import Layout

        model = load_model_config(args.steps_model)
        dp, tp, pp, micro = (int(v) for v in args.layout.split(","))
        times: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for mode in ("zero1", "fsdp"):
                for which in ("gloo", "ours") if round_ % 2 == 0 else ("ours", "gloo"):
                    layout = Layout(dp, tp, pp, micro, 8 // (dp * micro), dp_mode=mode)
                    saved = gloo_own() if which == "gloo" else None
                    try:
                        per_rank = run_ranks(_steps, layout.world_size, model, layout, args.steps, timeout=900)
                    finally:
                        if saved:
                            restore(saved)
                    steps = [max(r[i] for r in per_rank) for i in range(args.steps)][2:]
                    times.setdefault((mode, which), []).extend(steps)
                    print(
                        f"[steps] round {round_ + 1}, {layout.describe()}, {which} collectives: "
                        f"{', '.join(f'{s:.3f}' for s in steps)} s",
                        flush=True,
                    )
        for mode in ("zero1", "fsdp"):
            gloo, ours = (float(np.median(times[(mode, w)])) for w in ("gloo", "ours"))
            result["steps"].append(
                {
                    "model": model.name,
                    "layout": args.layout,
                    "dp_mode": mode,
                    "gloo_s": round(gloo, 4),
                    "ours_s": round(ours, 4),
                    "gloo_steps": times[(mode, "gloo")],
                    "our_steps": times[(mode, "ours")],
                }
            )
            print(
                f"[steps] {model.name} dp{dp} tp{tp} pp{pp} micro {micro}, {mode}: gloo's collectives {gloo:.3f} s, "
                f"ours {ours:.3f} s per step ({gloo / ours:.2f}x)",
                flush=True,
            )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"[collectives] wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
