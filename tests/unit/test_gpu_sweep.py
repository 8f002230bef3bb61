"""The one-GPU sweep kit (benchmarks/gpu/sweep.py, predict.py) and the step-time model against the steps an H200
measured (benchmarks/gpu/results/NVIDIA-H200/sweep.json: GPT-3 XL, medium and small, 3 dp modes,
micro-batch 1-8 at sequence 2048, the head padded as the model runs it on CUDA): an independent reference the
model must keep agreeing with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import predict  # noqa: E402


@pytest.fixture(scope="module")
def sweep() -> dict:
    return json.loads(predict.SWEEP.read_text())


def test_the_measured_h200_profile_picks_the_fastest_case_and_orders_the_dp_modes(sweep):
    from elastic_trainer.plan import load_hardware

    got = predict.summary(predict.predictions(sweep, load_hardware("h200")))
    assert set(got) == {"gpt3-xl", "gpt3-medium", "gpt3-small"}
    for model, s in got.items():
        assert s["chosen_over_best"] == 1.0, model
        assert sum(m == p for _, m, p in s["orders"]) >= 2, (model, s["orders"])
        # modes measured more than 3 % apart are ordered so (one miss allowed: small's ddp at micro-batch 8)
        assert len(s["apart"]) >= 8 and sum(not p["predicted"] for p in s["apart"]) <= 1, (model, s["apart"])
    assert got["gpt3-xl"]["median_error"] <= 0.10  # the model calibrate measured at
    assert all(s["median_error"] <= 0.15 for s in got.values())  # issue 35's goal, across sizes


def test_the_head_figure_must_be_the_padded_head_s(sweep):
    """The unpadded head's figure (what h200.toml carried before the head was padded on CUDA) over-predicts the
    padded steps: GPT-3 XL by more than 20 % (its head is 3 GEMMs of 2048 x 50257 per token)."""
    import dataclasses

    from elastic_trainer.plan import load_hardware

    hw = load_hardware("h200")
    got = predict.summary(predict.predictions(sweep, dataclasses.replace(hw, head_tflops=124.0)))
    assert got["gpt3-xl"]["median_error"] > 0.2


def test_the_data_sheet_profile_inverts_the_dp_modes_on_the_same_steps(sweep):
    """What the measured figures fixed (the data-sheet h100-80g's lumped rate knows no host or copies)."""
    from elastic_trainer.plan import load_hardware

    got = predict.summary(predict.predictions(sweep, load_hardware("h100-80g")))
    assert all(sum(m == p for _, m, p in s["orders"]) == 0 for s in got.values())
    assert all(sum(p["predicted"] for p in s["apart"]) <= 1 for s in got.values())
    assert all(s["chosen_over_best"] < 0.98 for s in got.values())
