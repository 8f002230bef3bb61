"""The committed measurements re-predicted with FSDP2's copies counted on CPU ranks (plan/step_time.py
`wrapper_bytes(..., cpu_ranks=True)`) against the model before them, each run with its own profile.

Before, a CPU profile charged fsdp's and ddp's own work only as `calibrate`'s per-mode excess
(`{mode}_hooks_ns_per_param`, a residual over the cheapest mode at the probe's shapes). Now the copies around the
collectives are counted in bytes at the measured bandwidth and the excess is what is left beyond them. A
committed profile's excess was fitted without the copies; "now" takes them off it as `calibrate` would have
from the same measurement (`refitted`), so both columns rest on the same calibration. Nothing is run again.

- the dp modes stepped in turn (`mode_order.py` results, and the two runs of each group pooled):
  ordered pairs predicted in order, under each profile;
- the planner runs (`run.py` results): chosen / best screened, the median error, dp-mode groups and pairs, as
  gradient_sums.py prints them.

    python benchmarks/planner/copies.py     # about 10 s
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradient_sums  # noqa: E402  (this folder's gradient_sums.py)
import mode_order  # noqa: E402

import elastic_trainer.plan.step_time as step_time  # noqa: E402
from elastic_trainer.config import DP_MODES, load_model_config  # noqa: E402
from elastic_trainer.parallel import calibrate_modes  # noqa: E402
from elastic_trainer.plan import Request, load_hardware  # noqa: E402
from elastic_trainer.plan.explain import by_phase  # noqa: E402
from elastic_trainer.plan.hardware import Hardware  # noqa: E402

HERE = Path(__file__).resolve().parent
MODE_RUNS = ["modes-gpt3-small-4", "modes-gpt3-small-8", "modes-gpt3-small-4-copies", "modes-gpt3-small-8-again"]
POOLED = {
    "modes-gpt3-small-4 and -4-copies": ["modes-gpt3-small-4", "modes-gpt3-small-4-copies"],
    "modes-gpt3-small-8 and -8-again": ["modes-gpt3-small-8", "modes-gpt3-small-8-again"],
}
"""The same groups measured twice, judged as one measurement (mode_order.py --pool)."""
MODE_PROFILES = [
    "results-modes-gpt3-small-4-profile.toml",
    "results-gpt3-small-4-accumulation-profile.toml",
    "results-modes-gpt3-small-8-profile.toml",
    "cpu",
    "results-modes-gpt3-small-4-copies-profile.toml",
    "results-gpt3-small-8-copies-profile.toml",
    "results-modes-gpt3-small-8-again-profile.toml",
]
FITTED_BEYOND_COPIES = {
    "results-modes-gpt3-small-4-copies-profile.toml",
    "results-gpt3-small-8-copies-profile.toml",
    "results-modes-gpt3-small-8-again-profile.toml",
}
"""Profiles calibrated with the copies counted: used as they are, with no `before` (its comment says how)."""
RUNS = gradient_sums.RUNS + [
    "gpt3-small-4-accumulation",
    "gpt3-small-4-calibrated",
    "gpt3-small-8-calibrated",
    "gpt3-medium-4-calibrated",
    "gpt3-medium-8-calibrated",
]
COUNTED = step_time.wrapper_bytes


@contextlib.contextmanager
def copies_uncounted():
    """The model before: CPU ranks' copies not counted (a GPU's as they are)."""
    step_time.wrapper_bytes = lambda layout, dtype, cpu_ranks=False, root_share=0.0: (
        (0.0, 0.0) if cpu_ranks else COUNTED(layout, dtype)
    )
    try:
        yield
    finally:
        step_time.wrapper_bytes = COUNTED


def probe_shapes(hw: Hardware):
    """The model and sequence length `calibrate --model` measured `hw`'s modes at (the first named)."""
    name, seq = hw.optimizer_shapes.split(", seq_len ")
    name = name.split()[0]
    model = load_model_config(str(HERE / "bench-model.toml") if name.startswith("bench") else name)
    return model, int(seq.split()[0])


def refitted(hw: Hardware) -> Hardware:
    """`hw` with its per-mode excess fitted beyond the counted copies: each mode's residual at the probe less the
    copies the model now charges there, less the cheapest mode's (calibrate_modes.fitted, from the same
    measurement)."""
    model, seq = probe_shapes(hw)
    probe = calibrate_modes.probe_model(model)
    bare = dataclasses.replace(hw, **{f"{m}_hooks_ns_per_param": 0.0 for m in DP_MODES})
    req = Request(probe, 2, 2, seq, bare, 2, dtype="fp32")
    residual = {}
    for mode in DP_MODES:
        layout = calibrate_modes.probe_layout(2, mode)
        one = dataclasses.replace(bare, **{f"{mode}_hooks_ns_per_param": 1.0})
        per_ns = (
            step_time.step_time(probe, layout, seq, "fp32", one, 2).hooks
            - step_time.step_time(probe, layout, seq, "fp32", bare, 2).hooks
        )
        with copies_uncounted():
            before = by_phase(req, layout)
        now = by_phase(req, layout)
        counted = now["forward_backward"] + now["sync"] - before["forward_backward"] - before["sync"]
        residual[mode] = (hw.hooks_ns(mode) * per_ns - counted, per_ns)
    floor = min(r for r, _ in residual.values())
    return dataclasses.replace(
        hw, **{f"{m}_hooks_ns_per_param": (r - floor) / per_ns for m, (r, per_ns) in residual.items()}
    )


def modes_in_order(result: dict, hw: Hardware) -> tuple[int, int]:
    """(ordered pairs the profile predicts in order, ordered pairs) of a mode_order.py result."""
    predicted = mode_order.predicted_times(result, hw)
    pairs = [(g, p) for g in result["groups"] for p in g["pairs"] if p["ordered"]]
    right = sum(
        predicted[(*g["degrees"], g["micro_batch"], p["faster"])]
        < predicted[(*g["degrees"], g["micro_batch"], p["slower"])]
        for g, p in pairs
    )
    return right, len(pairs)


SHIPPED_BEFORE = {"fsdp_hooks_ns_per_param": 0.505, "ddp_hooks_ns_per_param": 0.875}
"""The shipped `cpu` profile's excess before the copies were counted (now: refitted() of these, as shipped)."""


def before_and_now(name: str) -> tuple[Hardware, Hardware]:
    """A committed profile as it was fitted, and refitted beyond the copies; the shipped `cpu` before and as it is."""
    if name == "cpu":
        return dataclasses.replace(load_hardware("cpu"), **SHIPPED_BEFORE), load_hardware("cpu")
    hw = load_hardware(str(HERE / name))
    return (None, hw) if name in FITTED_BEYOND_COPIES else (hw, refitted(hw))


def main() -> None:
    print(
        "dp modes stepped in turn, ordered pairs in the predicted order, under the profiles " + ", ".join(MODE_PROFILES)
    )
    runs = {name: json.loads((HERE / f"results-{name}.json").read_text()) for name in MODE_RUNS}
    for name, parts in POOLED.items():
        runs[f"{name} pooled"] = mode_order.pooled([runs[p] for p in parts], load_hardware("cpu"))
    for name, result in runs.items():
        profiles = [before_and_now(p) for p in MODE_PROFILES]
        with copies_uncounted():
            before = ["{}/{}".format(*modes_in_order(result, hw)) if hw else "-" for hw, _ in profiles]
        now = ["{}/{}".format(*modes_in_order(result, hw)) for _, hw in profiles]
        print(f"{name}: before {' '.join(before)} | now {' '.join(now)}")
    for p in MODE_PROFILES:
        hw, new = before_and_now(p)
        print(
            f"{p}: excess "
            + ", ".join(f"{m} {hw.hooks_ns(m) if hw else '-':.5} -> {new.hooks_ns(m):.3f}" for m in DP_MODES)
            + " ns per parameter and collective"
        )
    print("planner runs: chosen/best screened, median error, groups, pairs (before | now)")
    for name, result, world, own in gradient_sums.committed(RUNS):
        with copies_uncounted():
            before = gradient_sums.cell(result, world, own)
        print(f"{name} {world}: {before} | {gradient_sums.cell(result, world, refitted(own))}", flush=True)


if __name__ == "__main__":
    main()
