"""The step-time model against a one-GPU sweep (`sweep.py`'s JSON): each case's prediction beside its measured
step, and per model the median and largest error, the planner's choice among the cases against the fastest,
and whether the three dp modes are predicted in their measured order at each micro-batch size.

    python benchmarks/gpu/predict.py                                   # the H200 sweep with configs/hardware/h200
    python benchmarks/gpu/predict.py --hardware h100-80g               # the same steps with another profile
    python benchmarks/gpu/predict.py --own-host                        # each model's host times from its probes

`--own-host` replaces the profile's host times per block (measured by `calibrate --model` at one model) by
those of the sweep's host probe of each case's model: what `calibrate --model M` on the same machine gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))

from run import MODE_APART, apart_pairs  # noqa: E402  (the planner benchmark's rule for a measured order)

from elastic_trainer.config import DP_MODES, load_model_config  # noqa: E402
from elastic_trainer.parallel.calibrate_modes import host_block_ms  # noqa: E402
from elastic_trainer.plan import load_hardware  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.plan.step_time import step_time  # noqa: E402

SWEEP = ROOT / "benchmarks/gpu/results/NVIDIA-H200/sweep.json"
"""The H200 sweep of 2026-11-28 (the head padded to 64 rows; results/NVIDIA-H200/README.md)."""


def predictions(sweep: dict, hw, own_host: bool = False) -> list[dict]:
    """The sweep's measured cases (not its probes), each with `predicted_s`."""
    probes = {(c["model"], c["mode"]): c for c in sweep["cases"] if c["probe"] and "step_s" in c}
    out = []
    for c in sweep["cases"]:
        if c["probe"] or "step_s" not in c:
            continue
        model = load_model_config(c["model"])
        profile = hw
        if own_host:
            profile = dataclasses.replace(
                hw,
                **{f"{m}_host_block_ms": host_block_ms(probes[(c["model"], m)]["phases_s"], model) for m in DP_MODES},
            )
        layout = Layout(1, 1, 1, c["micro_batch"], c["num_microbatches"], dp_mode=c["mode"])
        out.append({**c, "predicted_s": step_time(model, layout, c["seq_len"], c["dtype"], profile, 1).total})
    return out


def summary(cases: list[dict]) -> dict:
    """{model: {median_error, max_error, chosen, best, chosen_over_best, orders: [(micro_batch, measured,
    predicted)], apart: [the pairs of modes measured more than MODE_APART apart, each with `predicted`]}}."""
    out = {}
    for model in dict.fromkeys(c["model"] for c in cases):
        mine = [c for c in cases if c["model"] == model]
        errors = [abs(c["predicted_s"] / c["step_s"] - 1) for c in mine]
        chosen = min(mine, key=lambda c: c["predicted_s"])
        best = min(mine, key=lambda c: c["step_s"])
        orders, apart = [], []
        for mb in sorted({c["micro_batch"] for c in mine}):
            group = [c for c in mine if c["micro_batch"] == mb]
            predicted = [c["mode"] for c in sorted(group, key=lambda c: c["predicted_s"])]
            orders.append((mb, [c["mode"] for c in sorted(group, key=lambda c: c["step_s"])], predicted))
            apart += [
                dict(pair, micro_batch=mb) for pair in apart_pairs(predicted, {c["mode"]: c["step_s"] for c in group})
            ]
        out[model] = {
            "median_error": statistics.median(errors),
            "max_error": max(errors),
            "chosen": (chosen["mode"], chosen["micro_batch"], chosen["step_s"]),
            "best": (best["mode"], best["micro_batch"], best["step_s"]),
            "chosen_over_best": best["step_s"] / chosen["step_s"],
            "orders": orders,
            "apart": apart,
        }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default=str(SWEEP))
    p.add_argument("--hardware", default="h200", help="profile name or TOML file")
    p.add_argument("--own-host", action="store_true", help="host times per block from each model's own probes")
    args = p.parse_args(argv)
    sweep = json.loads(Path(args.sweep).read_text())
    cases = predictions(sweep, load_hardware(args.hardware), args.own_host)
    print(
        f"{sweep['device']}, torch {sweep['torch']}, profile {args.hardware}"
        f"{' with each model own host probes' if args.own_host else ''}"
    )
    print(f"{'model':12s} {'mode':5s} {'micro':>5s} {'measured s':>10s} {'predicted s':>11s} {'ratio':>6s}")
    for c in cases:
        print(
            f"{c['model']:12s} {c['mode']:5s} {c['micro_batch']:5d} {c['step_s']:10.3f} {c['predicted_s']:11.3f} "
            f"{c['step_s'] / c['predicted_s']:6.2f}"
        )
    result = summary(cases)
    for model, s in result.items():
        matched = sum(m == p for _, m, p in s["orders"])
        print(
            f"{model}: error median {s['median_error']:.1%} (largest {s['max_error']:.1%}); chosen "
            f"{s['chosen'][0]} x {s['chosen'][1]} ({s['chosen'][2]:.3f} s), fastest {s['best'][0]} x {s['best'][1]} "
            f"({s['best'][2]:.3f} s): {s['chosen_over_best']:.3f}; dp modes in the measured order at {matched} of "
            f"{len(s['orders'])} micro-batch sizes, {sum(p['predicted'] for p in s['apart'])} of the "
            f"{len(s['apart'])} pairs measured more than {MODE_APART:.0%} apart"
        )
    return result


if __name__ == "__main__":
    main()
