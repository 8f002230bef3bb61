"""`plan --explain` (plan/explain.py): the predicted step time term by term. The terms must add up to the
step time the planner ranks layouts by, for every valid layout, and the largest term is checked against a
hand computation of the model's formula."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_trainer import cli
from elastic_trainer.config import load_model_config
from elastic_trainer.plan import Request, load_hardware, plan
from elastic_trainer.plan.explain import terms
from elastic_trainer.plan.layout import Layout


@pytest.mark.parametrize("model, gpus, batch, seq, hardware, compiled", [
    ("gpt3-small", 4, 8, 128, "cpu", False), ("gpt3-xl", 16, 64, 2048, "h100-80g", False),
    ("gpt3-xl", 16, 64, 2048, "h100-80g", True), ("gpt-tiny", 6, 12, 64, "v100-16g", False)])
def test_the_terms_add_up_to_the_planned_step_time_of_every_layout(model, gpus, batch, seq, hardware, compiled):
    hw = dataclasses.replace(load_hardware(hardware), compiled_speedup=1.25)
    req = Request(load_model_config(model), gpus, batch, seq, hw, 8 if hardware != "cpu" else gpus,
                  compiled=compiled)
    result = plan(req)
    assert len(result.candidates) > 10
    for c in result.candidates:
        rows = terms(req, Layout(c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.dp_mode, c.recompute))
        assert all(s >= 0 for _, s in rows)
        assert sum(s for _, s in rows) == pytest.approx(c.step_time_s, rel=1e-12), c


def test_the_blocks_term_by_hand():
    """One GPU, one micro-batch of 2 x 2048 tokens, GPT-3 XL on the data-sheet H100: 24 blocks of
    3 x (24 t d^2 + 2 t s d) FLOPs at the size-derated rate, plus the fixed time per block."""
    hw, model = load_hardware("h100-80g"), load_model_config("gpt3-xl")
    req = Request(model, 1, 2, 2048, hw, 1)
    rows = dict(terms(req, Layout(1, 1, 1, 2, 1, "fsdp")))
    t, d, s = 2 * 2048, 2048, 2048
    rate = 500e12 * t / (t + 256)  # tflops and half_rate_tokens of configs/hardware/h100-80g.toml
    blocks = 24 * (3 * (24 * t * d * d + 2 * t * s * d) / rate + 0.05e-3)
    assert rows["transformer blocks (forward + backward)"] == pytest.approx(blocks, rel=1e-12)
    assert rows["pipeline fill and drain"] == rows["tensor-parallel all-reduces"] == 0.0
    assert rows["data-parallel communication not hidden (fsdp)"] == 0.0  # one rank


def test_plan_explain_prints_the_chosen_and_the_compared_layout(capsys):
    code = cli.main(["plan", "--model", "gpt3-small", "--gpus", "4", "--global-batch", "8", "--seq-len", "128",
                     "--hardware", "cpu", "--explain", "--compare", "2,1,2"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("\nexplain dp") == 2
    block = out[out.index("explain dp"):].splitlines()
    block = block[:next(i for i, line in enumerate(block) if line.startswith("  (predictions"))]
    total = float(block[0].split(": ")[1].split(" s per step")[0])
    assert block[0].startswith("explain dp1 tp1 pp4, micro-batch 1 x 8, fsdp: ")
    assert block[1].lstrip().startswith("transformer blocks (forward + backward)")
    assert sum(float(line.split()[-4]) for line in block[1:]) == pytest.approx(total, rel=1e-3)  # 4 digits each
