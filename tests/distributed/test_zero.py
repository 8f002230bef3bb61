"""ZeRO-1 on forked gloo ranks: each rank's rows of the global gradient, bf16 accumulation in fp32, the checkpoint
state FSDP2 would write, empty shards."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.parallel.engine import Engine
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.parallel.zero import Zero1
from elastic_trainer.plan.layout import Layout
from tests.unit.test_engine_unit import CPU, MODEL, SEED, T, batch, initial_by_hand, reference

COUNTED = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast")


def _zero_step(rank, world, layout: Layout, tokens, dtype=torch.float32) -> dict:
    warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates the old names of the flat collectives
    engine = Engine(
        MODEL,
        layout,
        build_mesh(layout, "cpu"),
        CPU,
        seed=SEED,
        global_batch=layout.global_batch,
        seq_len=T,
        param_dtype=dtype,
    )
    counts = dict.fromkeys(COUNTED, 0)
    originals = {k: getattr(dist, k) for k in COUNTED}
    for k in COUNTED:
        setattr(dist, k, lambda *a, k=k, **kw: (counts.__setitem__(k, counts[k] + 1), originals[k](*a, **kw))[1])
    share = layout.local_batch
    rows = slice(engine.coords.dp * share, (engine.coords.dp + 1) * share)
    grads_alive = []
    for block in engine.model.layers.values():  # after each block's backward: does any .grad stay set?
        block.register_full_backward_hook(
            lambda *_: grads_alive.append(any(p.grad is not None for p in engine.model.parameters()))
        )
    try:
        local = engine.forward_backward(tokens[rows])
    finally:
        for k in COUNTED:
            setattr(dist, k, originals[k])
    zero = engine.zero
    names = [s.name for s in zero.slots]
    return {
        "dp": engine.coords.dp,
        "loss": engine.global_loss(local),
        "counts": counts,
        "grads": {n: m.grad.clone() for n, m in zip(names, zero.masters)},
        "masters": {n: m.clone() for n, m in zip(names, zero.masters)},
        "param_dtypes": {p.dtype for p in engine.model.parameters()},
        "grads_alive": grads_alive,
        "norm": float(engine.clip_grad_norm_(0.0)),
    }


def _shard(t: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    pieces = torch.chunk(t, dp, dim=0)
    return pieces[rank] if rank < len(pieces) else t[:0]


@pytest.mark.parametrize("dp, micro_batch, n_micro", [(2, 2, 1), (2, 1, 4), (3, 1, 2)])
def test_each_rank_holds_its_rows_of_the_global_gradient(dp, micro_batch, n_micro):
    """dp=3 splits every width of the micro GPT (16, 48, 64) unevenly: the last rank's rows are fewer."""
    layout = Layout(dp, 1, 1, micro_batch, n_micro, dp_mode="zero1")
    tokens = batch(layout.global_batch)
    gc.collect()
    results = run_ranks(_zero_step, dp, layout, tokens, timeout=120)
    want_loss, want_grads, want_norm = reference(MODEL, tokens)
    init = initial_by_hand(MODEL, SEED)
    for r in results:
        assert r["loss"] == pytest.approx(want_loss, rel=1e-5)
        assert r["norm"] == pytest.approx(want_norm, rel=1e-5)
        # one gradient reduction per step whatever the number of micro-batches (on gloo an all-reduce,
        # parallel/gloo_comms.py); no gather before the update
        assert r["counts"] == {"all_reduce": 1, "reduce_scatter_single": 0, "all_gather_single": 0, "broadcast": 0}
        assert not any(r["grads_alive"]), "a whole .grad stayed alive after its hook"
        for name, want in want_grads.items():
            mine = _shard(want, dp, r["dp"])
            assert r["grads"][name].shape == mine.shape, name
            torch.testing.assert_close(r["grads"][name], mine, rtol=1e-5, atol=1e-7, msg=name)
            assert torch.equal(r["masters"][name], _shard(init[name], dp, r["dp"])), name


def test_bf16_gradients_accumulate_in_fp32():
    """bf16 compute copy, fp32 master and accumulation: the sum of 4 micro-batches' bf16 gradients, taken in
    fp32, is mostly not a bf16 number (it would be if .grad accumulated in bf16)."""
    layout = Layout(2, 1, 1, 1, 4, dp_mode="zero1")
    tokens = batch(layout.global_batch)
    gc.collect()
    results = run_ranks(_zero_step, 2, layout, tokens, torch.bfloat16, timeout=120)
    want_loss, want_grads, _ = reference(MODEL, tokens)
    for r in results:
        assert r["param_dtypes"] == {torch.bfloat16}
        assert r["loss"] == pytest.approx(want_loss, rel=2e-2)
        g = torch.cat([v.flatten() for v in r["grads"].values()])
        assert g.dtype == torch.float32
        g = g[g != 0]
        assert (g.bfloat16().float() == g).float().mean() < 0.5
        ref = torch.cat([_shard(want_grads[n], 2, r["dp"]).flatten() for n in r["grads"]])
        assert float((torch.cat([v.flatten() for v in r["grads"].values()]) - ref).norm()) <= 0.1 * float(ref.norm())


def _state_job(rank, world, layouts, tokens) -> dict:
    """One step of each layout in this process; their checkpoint states, gathered to full tensors."""
    from torch.distributed.tensor import DTensor

    from elastic_trainer.checkpoint.state import tensor_state
    from elastic_trainer.config import TrainConfig
    from elastic_trainer.train import Trainer

    warnings.simplefilter("error", FutureWarning)
    out = []
    for layout in layouts:
        cfg = TrainConfig(global_batch=layout.global_batch, seq_len=T, steps=1, seed=SEED, lr=1e-2, warmup_steps=1)
        trainer = Trainer(MODEL, cfg, layout, build_mesh(layout, "cpu"), CPU, tokens=tokens)
        trainer.train_step()
        state = tensor_state(trainer)
        out.append(
            {
                part: {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state[part].items()}
                for part in state
            }
        )
        out[-1]["local_shapes"] = {
            k: tuple(v.to_local().shape) for k, v in state["optim"].items() if isinstance(v, DTensor)
        }
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_state_has_fsdp2s_keys_shapes_and_values(tp):
    """zero1's state for DCP against get_state_dict's of the same model trained by FSDP2 on the same ranks:
    the same keys, global shapes and, with tp = 1, the same local shards (both split dim 0 like torch.chunk);
    with tp = 2 the column-wise weights' strided dp shards must still assemble into the right full tensors."""
    layouts = [Layout(2, tp, 1, 2, 1, dp_mode=mode) for mode in ("zero1", "fsdp")]
    tokens = batch(512).flatten().numpy()
    gc.collect()
    for zero, fsdp in run_ranks(_state_job, 2 * tp, layouts, tokens, timeout=120):
        for part in ("model", "optim"):
            assert set(zero[part]) == set(fsdp[part]), part
            for key, want in fsdp[part].items():
                got = zero[part][key]
                if isinstance(want, torch.Tensor):
                    assert got.shape == want.shape, key
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
                else:
                    assert got == want, key
        assert any(v.abs().sum() > 0 for k, v in zero["optim"].items() if k.endswith("exp_avg"))
        if tp == 1:
            assert zero["local_shapes"] == fsdp["local_shapes"]


class _Narrow(nn.Module):
    """Parameters with fewer rows than dp ranks (the last rank holds none of them), and one without rows."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).view(2, 3))
        self.b = nn.Parameter(torch.tensor([0.5]))
        self.none = nn.Parameter(torch.empty(0, 3))

    def forward(self, x):
        return (x @ self.w.t()).sum() * self.b


def _narrow_job(rank, world) -> dict:
    from elastic_trainer.parallel.mesh import build_mesh as mesh_of

    warnings.simplefilter("error", FutureWarning)

    model = _Narrow()
    zero = Zero1(model, mesh_of(Layout(world, 1, 1, 1, 1), "cpu"), torch.float32)
    model(torch.full((1, 3), float(rank + 1))).backward()
    zero.reduce()
    with torch.no_grad():
        for m in zero.masters:
            m.mul_(-1.0)
    zero.gather()
    return {
        "masters": [tuple(m.shape) for m in zero.masters],
        "grads": [g.clone() for g in zero.grads],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_a_rank_without_rows_of_a_parameter_holds_an_empty_shard():
    """dp = 3 over a 2-row weight and a 1-element bias: rows go 1, 1, 0 and 1, 0, 0 (torch.chunk)."""
    gc.collect()
    results = run_ranks(_narrow_job, 3, timeout=60)
    assert [r["masters"] for r in results] == [[(1, 3), (1,), (0, 3)], [(1, 3), (0,), (0, 3)], [(0, 3), (0,), (0, 3)]]
    # the dp-summed gradient: inputs 1, 2, 3 -> x sums to 6 per column; d/dw = 6 * b, d/db = 6 * sum(w)
    want_w, want_b = torch.full((2, 3), 6 * 0.5), torch.tensor([6 * 15.0])
    for r, result in enumerate(results):
        torch.testing.assert_close(result["grads"][0], torch.chunk(want_w, 3)[r] if r < 2 else want_w[:0])
        torch.testing.assert_close(result["grads"][1], want_b if r == 0 else want_b[:0])
        # every rank's shard, negated on its owner, is gathered into every rank's whole parameters
        torch.testing.assert_close(result["params"][0], -torch.arange(6.0).view(2, 3))
        torch.testing.assert_close(result["params"][1], torch.tensor([-0.5]))
