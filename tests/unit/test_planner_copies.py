"""benchmarks/planner/copies.py: a profile's per-mode excess refitted beyond FSDP2's counted copies rests on the
same measurement: at the probe calibrate measured, the model with the copies and the refitted excess predicts
every mode's forward + backward the same as the model without them did with the excess as fitted, up to one
shift common to every mode (the cheapest mode's residual, which the fit takes off)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.parallel import calibrate_modes
from elastic_trainer.plan import Request, load_hardware
from elastic_trainer.plan.explain import by_phase

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))  # copies imports this folder's gradient_sums.py
_spec = importlib.util.spec_from_file_location("planner_copies", ROOT / "benchmarks" / "planner" / "copies.py")
copies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(copies)


def probe_rest(hw, model, mode: str) -> float:
    req = Request(calibrate_modes.probe_model(model), 2, 2, 128, hw, 2, dtype="fp32")
    p = by_phase(req, calibrate_modes.probe_layout(2, mode))
    return p["forward_backward"] + p["sync"]


@pytest.mark.parametrize(
    "excess",
    [
        {"fsdp_hooks_ns_per_param": 0.505, "ddp_hooks_ns_per_param": 0.875},
        {"fsdp_hooks_ns_per_param": 0.0, "ddp_hooks_ns_per_param": 0.1},
    ],
)
def test_the_refitted_excess_predicts_the_probe_as_the_fitted_one_did(excess):
    model = load_model_config("gpt3-small")
    fitted = dataclasses.replace(
        load_hardware("cpu"), optimizer_shapes="gpt3-small, seq_len 128", zero1_hooks_ns_per_param=0.0, **excess
    )
    with copies.copies_uncounted():
        before = {m: probe_rest(fitted, model, m) for m in ("fsdp", "ddp", "zero1")}
    refitted = copies.refitted(fitted)
    now = {m: probe_rest(refitted, model, m) for m in ("fsdp", "ddp", "zero1")}
    shift = {m: now[m] - before[m] for m in now}
    assert max(shift.values()) - min(shift.values()) == pytest.approx(0.0, abs=1e-9)
    assert min(refitted.hooks_ns(m) for m in ("fsdp", "ddp", "zero1")) == pytest.approx(0.0, abs=1e-12)
    with copies.copies_uncounted():  # and the copies were counted at all: without them the refit predicts less
        assert probe_rest(refitted, model, "ddp") < now["ddp"]


def test_the_shipped_cpu_profile_is_its_former_excess_refitted():
    before, now = copies.before_and_now("cpu")
    again = copies.refitted(before)
    for mode in ("fsdp", "ddp", "zero1"):
        # the TOML keeps the mean of gpt3-small's refit (this one) and gpt3-medium's, 0.004 apart at most
        assert now.hooks_ns(mode) == pytest.approx(again.hooks_ns(mode), abs=0.003)
