"""How often FSDP2 copies a unit's parameters into place and reduces its gradient in one training step of the
engine, counted in torch itself (the calls of FSDPParamGroup.wait_for_unshard that find an all-gather to copy
out, and of foreach_reduce), against what the step-time model counts per micro-batch and step for CPU ranks
(plan/traffic.py wrapper_bytes): fsdp without a pipeline unshards the blocks in forward and again in backward
but the root once, and reduces every micro-batch; ddp (replicate) unshards every unit once per micro-batch and
reduces once per step; under a pipeline every unit unshards and reduces once per step."""

from __future__ import annotations

import pytest

from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.traffic import wrapper_bytes


def test_the_model_s_bytes_follow_those_counts():
    """fp32 at dp 2, 3 micro-batches, the root a quarter of the stage: fsdp unshards (8 / 2 + 8 bytes) 1.75 times a
    micro-batch and reduces (8, and from the second reduction the add: 12 / 2) every micro-batch; ddp copies
    into place (8) every micro-batch and reduces once per step (8 + 16); under a pipeline once per step each."""
    assert wrapper_bytes(Layout(2, 1, 1, 1, 3, dp_mode="fsdp"), "fp32", True, 0.25) == pytest.approx(
        (1.75 * 12 + 8 + 6 * 2 / 3, 0.0)
    )
    assert wrapper_bytes(Layout(2, 1, 1, 1, 3, dp_mode="ddp"), "fp32", True, 0.25) == (8, 24)
    assert wrapper_bytes(Layout(2, 1, 2, 1, 3, dp_mode="fsdp"), "fp32", True) == (0.0, 12 + 8)
    assert wrapper_bytes(Layout(2, 1, 2, 1, 3, dp_mode="ddp"), "fp32", True) == (0.0, 8 + 24)
