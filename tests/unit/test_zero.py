"""parallel/zero.py (dp_mode "zero1") on a micro GPT, against a plain single-process step.

The expectations are independent of the code under test: the reference gradients come from a plain GPT
with F.cross_entropy (tests/unit/test_engine_unit.py's `reference`), and each dp rank's shard is cut from
them by hand with torch.chunk along dim 0, the split FSDP2 and DTensor's Shard(0) use.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.parallel.zero import Zero1
from elastic_trainer.plan.layout import Layout


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        x = self.a(x)
        return self.b(x) if use_b else x


def test_a_parameter_without_gradient_this_step_contributes_zeros_not_last_steps(group):
    torch.manual_seed(0)
    model = _TwoLinears()
    zero = Zero1(model, build_mesh(Layout(1, 1, 1, 1, 1), "cpu"), torch.float32)
    x = torch.randn(3, 4)
    model(x, True).sum().backward()
    zero.reduce()
    b_weight = [s.name for s in zero.slots].index("b.weight")
    assert zero.grads[b_weight].abs().sum() > 0
    model(x, False).square().sum().backward()  # b unused
    zero.reduce()
    assert torch.count_nonzero(zero.grads[b_weight]) == 0
    want = torch.func.grad(lambda w: torch.nn.functional.linear(x, w, model.a.bias).square().sum())(model.a.weight)
    torch.testing.assert_close(zero.grads[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_writes_the_updated_master_into_the_parameters(group, dtype):
    """Under bf16 the shards travel in bf16 through the buffer's front: the parameters are the master rounded."""
    model = _TwoLinears()
    zero = Zero1(model, build_mesh(Layout(1, 1, 1, 1, 1), "cpu"), dtype)
    with torch.no_grad():
        for m in zero.masters:
            m.add_(1.0 / 3.0)
    zero.gather()
    for p, m in zip(model.parameters(), zero.masters):
        assert p.dtype == dtype and torch.equal(p.detach(), m.to(dtype))


def test_buffers_are_fp32_on_the_parameters_device_whatever_torch_s_defaults(group):
    """On a GPU the parameters' device is not torch's default one: the buffers must follow the parameters."""
    model = _TwoLinears()
    mesh = build_mesh(Layout(1, 1, 1, 1, 1), "cpu")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            zero = Zero1(model, mesh, torch.float32)
    finally:
        torch.set_default_dtype(default)
    for t in (zero.buffer, zero.master, zero.grad_shard):
        assert (t.device.type, t.dtype) == ("cpu", torch.float32)


def test_a_dropped_stage_is_freed_with_its_buffers(group):
    """A zero1 stage built and dropped in one process (a trainer rebuilt, a calibration, a sweep) leaves nothing
    alive: its hooks must not hold it through autograd, which Python's collector cannot see into (seen on a GPU:
    every dropped GPT-3 XL stage kept 16-18 GB)."""
    import weakref

    model = _TwoLinears()
    zero = Zero1(model, build_mesh(Layout(1, 1, 1, 1, 1), "cpu"), torch.float32)
    model(torch.randn(3, 4), True).sum().backward()  # the hooks have run
    zero.reduce()
    alive = [weakref.ref(t) for t in (zero.buffer, zero.master, model.a.weight)] + [weakref.ref(zero)]
    del model, zero
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)
