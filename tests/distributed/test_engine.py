"""The engine on 2-4 forked gloo ranks: each dp, tp and pp split takes the plain global-batch step, and the
validation loss is the plain eval-mode mean."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from elastic_trainer.config import ModelConfig
from elastic_trainer.model.gpt import GPT
from elastic_trainer.parallel.engine import Engine
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from tests.unit.test_engine_unit import (
    CPU,
    DROPPING,
    MODEL,
    SEED,
    T,
    assert_grads_match,
    batch,
    full,
    initial_by_hand,
    keys_for,
    reference,
)


def local_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple((t.to_local() if isinstance(t, DTensor) else t).shape)


COUNTED = ("all_reduce", "reduce_scatter_single")


def _rank_step(rank, world, layout: Layout, cfg: ModelConfig, tokens, keys=None, dtype=torch.float32) -> dict:
    """Build this rank's Engine, run one forward/backward on its dp share of `tokens`, and report."""
    engine = Engine(
        cfg,
        layout,
        build_mesh(layout, "cpu"),
        CPU,
        seed=SEED,
        global_batch=layout.global_batch,
        seq_len=T,
        param_dtype=dtype,
    )
    model = engine.model
    sharded = []  # after each forward of this stage: are the blocks' / the root's parameters sharded again?

    def probe(module, args, output):
        root = model.tok_emb if model.tok_emb is not None else model.ln_f  # a middle stage has neither
        sharded.append(
            (
                [isinstance(b.ln_1.weight, DTensor) for b in model.layers.values()],
                None if root is None else isinstance(root.weight, DTensor),
            )
        )

    model.register_forward_hook(probe)
    counts = dict.fromkeys(COUNTED, 0)
    originals = {k: getattr(dist, k) for k in COUNTED}

    def counting(k):
        def call(*args, **kwargs):
            counts[k] += 1
            return originals[k](*args, **kwargs)

        return call

    share = layout.local_batch
    rows = slice(engine.coords.dp * share, (engine.coords.dp + 1) * share)
    for k in COUNTED:
        setattr(dist, k, counting(k))
    try:
        local = engine.forward_backward(tokens[rows], None if keys is None else keys[rows])
    finally:
        for k in COUNTED:
            setattr(dist, k, originals[k])
    kept_outputs = None
    if engine.schedule is not None and engine.last:
        kept_outputs = len(engine.schedule._stage.output_chunks)
    engine.reduce_tied_grads()
    loss = engine.global_loss(local)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {names[id(p)]: r for r, ps in engine._norm_groups().items() for p in ps}
    params = {n: p for n, p in model.named_parameters()}
    return {
        "coords": (engine.coords.pp, engine.coords.dp, engine.coords.tp),
        "local": float(local),
        "loss": loss,
        "grads": {n: full(p.grad) for n, p in params.items()},
        "dtypes": {n: p.grad.dtype for n, p in params.items()},
        "shapes": {n: local_shape(p) for n, p in params.items()},
        "groups": groups,
        "tied_copy": engine.tied_copy is not None,
        "tied_ranks": None if engine.tied_group is None else dist.get_process_group_ranks(engine.tied_group),
        "schedule": type(engine.schedule).__name__,
        "kept_outputs": kept_outputs,
        "sharded": sharded,
        "counts": counts,
        "norm": float(engine.clip_grad_norm_(0.0)),
    }


def ranks(world: int, *args) -> list[dict]:
    gc.collect()  # see the group fixture: nothing of an in-process group may survive into the fork
    return run_ranks(_rank_step, world, *args, timeout=120)


def check_step(results, cfg, tokens, keys=None, rel=1e-5):
    """Every rank's loss and norm are the reference's; every stage's gradients (the tied copy's included,
    after reduce_tied_grads) are the reference's and together cover every parameter."""
    want_loss, want_grads, want_norm = reference(cfg, tokens, keys)
    covered = set()
    for r in results:
        assert r["loss"] == pytest.approx(want_loss, rel=rel)
        assert r["norm"] == pytest.approx(want_norm, rel=rel)
        assert_grads_match(r["grads"], want_grads, rel=rel)
        covered |= set(r["grads"])
    assert covered == set(want_grads)
    return want_loss


@pytest.mark.parametrize("mode, micro_batch, n_micro", [("fsdp", 2, 1), ("fsdp", 1, 4), ("ddp", 2, 1), ("ddp", 1, 4)])
def test_two_data_parallel_ranks_take_the_plain_global_batch_step(mode, micro_batch, n_micro):
    layout = Layout(2, 1, 1, micro_batch, n_micro, dp_mode=mode)
    tokens = batch(layout.global_batch)
    results = ranks(2, layout, MODEL, tokens)
    want_loss = check_step(results, MODEL, tokens)
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 1, 0)]
    # each rank's own contribution is its half's share of the global token mean
    halves = [reference(MODEL, tokens[i * layout.local_batch : (i + 1) * layout.local_batch])[0] / 2 for i in (0, 1)]
    assert [r["local"] for r in results] == pytest.approx(halves, rel=1e-5)
    assert sum(halves) == pytest.approx(want_loss, rel=1e-5)
    units = MODEL.n_layers + 1  # each block, and the root (embeddings, final LayerNorm)
    for r in results:
        assert r["tied_ranks"] is None and not r["tied_copy"]
        if mode == "fsdp":
            # sharded over dp: each piece lives on one rank; reduce-scattered after every micro-batch (over
            # gloo an all-reduce in place, parallel/gloo_comms.py)
            assert set(r["groups"].values()) == {1}
            assert r["counts"] == {"all_reduce": units * n_micro, "reduce_scatter_single": 0}
            # without a pipeline the blocks are freed (resharded) after their forward, the root is kept
            assert r["sharded"] == [([True] * MODEL.n_layers, False)] * n_micro
        else:
            # replicated over dp: every piece on both ranks; one all-reduce per unit after the last micro-batch
            assert set(r["groups"].values()) == {2}
            assert r["counts"] == {"all_reduce": units, "reduce_scatter_single": 0}


def test_bf16_data_parallel_gradients_are_reduced_in_fp32():
    layout = Layout(2, 1, 1, 2, 1, dp_mode="fsdp")
    tokens = batch(layout.global_batch)
    results = ranks(2, layout, MODEL, tokens, None, torch.bfloat16)
    want_loss, want_grads, _ = reference(MODEL, tokens)
    for r in results:
        assert r["loss"] == pytest.approx(want_loss, rel=2e-2)
        assert_grads_match(r["grads"], want_grads, rel=0.1)
        assert set(r["dtypes"].values()) == {torch.float32}
        # the sum of the two ranks' bf16 gradients, taken in fp32, is mostly not a bf16 number
        g = torch.cat([v.flatten() for v in r["grads"].values()])
        g = g[g != 0]
        exact_bf16 = (g.bfloat16().float() == g).float().mean()
        assert exact_bf16 < 0.5


# split by tensor parallelism (Megatron: qkv and fc column-wise with their biases, o_proj and proj row-wise)
TP_SPLIT = (
    "attn.qkv_proj.weight",
    "attn.qkv_proj.bias",
    "attn.o_proj.weight",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
)


def tp_local_shapes(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    d = cfg.d_model
    return {
        "attn.qkv_proj.weight": (3 * d // tp, d),
        "attn.qkv_proj.bias": (3 * d // tp,),
        "attn.o_proj.weight": (d, d // tp),
        "attn.o_proj.bias": (d,),
        "mlp.fc.weight": (4 * d // tp, d),
        "mlp.fc.bias": (4 * d // tp,),
        "mlp.proj.weight": (d, 4 * d // tp),
        "mlp.proj.bias": (d,),
        "ln_1.weight": (d,),
        "tok_emb.weight": (cfg.vocab_size, d),
        "pos_emb.weight": (cfg.context_length, d),
    }


def check_tp_shapes(r: dict, cfg: ModelConfig, tp: int) -> None:
    want = tp_local_shapes(cfg, tp)
    for name, shape in r["shapes"].items():
        suffix = next((k for k in want if name.endswith(k)), None)
        if suffix is not None:
            assert shape == want[suffix], name


def test_two_tensor_parallel_ranks_split_heads_and_columns_and_take_the_plain_step():
    layout = Layout(1, 2, 1, 2, 2)
    tokens, keys = batch(layout.global_batch), keys_for(layout.global_batch)
    results = ranks(2, layout, DROPPING, tokens, keys)
    want_loss = check_step(results, DROPPING, tokens, keys)
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1)]
    for r in results:
        assert r["local"] == pytest.approx(want_loss, rel=1e-5)  # both ranks compute the whole loss ...
        check_tp_shapes(r, DROPPING, 2)
        # ... and hold the embeddings, LayerNorms and row-wise biases whole: 2 copies; the split pieces 1
        assert r["groups"] == {n: 1 if n.endswith(TP_SPLIT) else 2 for n in r["grads"]}
        assert r["tied_ranks"] is None


@pytest.mark.parametrize("n_micro, schedule", [(1, "ScheduleGPipe"), (2, "Schedule1F1B")])
def test_two_pipeline_stages_tie_the_embedding_and_take_the_plain_step(n_micro, schedule):
    layout = Layout(1, 1, 2, 4 // n_micro, n_micro)
    tokens, keys = batch(4), keys_for(4)
    results = ranks(2, layout, DROPPING, tokens, keys)
    want_loss = check_step(results, DROPPING, tokens, keys)
    first, last = results
    assert (first["coords"], last["coords"]) == ((0, 0, 0), (1, 0, 0))
    assert first["schedule"] == last["schedule"] == schedule  # 1F1B once there are pp micro-batches
    assert first["tied_ranks"] == last["tied_ranks"] == [0, 1]
    assert (first["tied_copy"], last["tied_copy"]) == (False, True)
    assert set(first["grads"]) == {"tok_emb.weight", "pos_emb.weight"} | {
        n for n in first["grads"] if n.startswith("layers.0.")
    }
    assert {n for n in last["grads"] if not n.startswith("layers.1.")} == {"tok_emb.weight", "ln_f.weight", "ln_f.bias"}
    assert (first["local"], last["local"]) == (0.0, pytest.approx(want_loss, rel=1e-5))
    assert last["kept_outputs"] == 0  # the last stage does not keep the step's logits
    # the tied copy is counted once, on the first stage
    assert set(first["groups"]) == set(first["grads"]) and set(first["groups"].values()) == {1}
    assert set(last["groups"]) == set(last["grads"]) - {"tok_emb.weight"} and set(last["groups"].values()) == {1}


def test_three_pipeline_stages_pair_the_first_and_last_for_the_tied_embedding():
    cfg = ModelConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=64, context_length=16, dropout=0.1)
    layout = Layout(1, 1, 3, 1, 2)
    tokens, keys = batch(2), keys_for(2)
    results = ranks(3, layout, cfg, tokens, keys)
    want_loss = check_step(results, cfg, tokens, keys)  # the middle stage's dropout masks follow the keys too
    assert [r["tied_ranks"] for r in results] == [[0, 2], None, [0, 2]]
    assert [r["tied_copy"] for r in results] == [False, False, True]
    assert [r["schedule"] for r in results] == ["ScheduleGPipe"] * 3  # 2 micro-batches < 3 stages
    assert [r["local"] for r in results] == [0.0, 0.0, pytest.approx(want_loss, rel=1e-5)]
    assert set(results[1]["grads"]) == {n for n in results[1]["grads"] if n.startswith("layers.1.")}


def test_pipeline_and_fsdp_on_four_ranks_pair_each_replica_s_stages():
    layout = Layout(2, 1, 2, 1, 2, dp_mode="fsdp")
    tokens = batch(4)
    results = ranks(4, layout, MODEL, tokens)
    check_step(results, MODEL, tokens)
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [r["tied_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r in results:
        assert r["schedule"] == "Schedule1F1B"
        assert set(r["groups"].values()) == {1}
        # with a pipeline each micro-batch's backward comes later: the stage stays gathered after forward
        assert len(r["sharded"]) >= 2 and set(map(repr, r["sharded"])) == {repr(([False], False))}


def test_data_and_tensor_parallel_on_four_ranks_count_each_piece_s_replicas():
    layout = Layout(2, 2, 1, 1, 2, dp_mode="ddp")
    tokens = batch(4)
    results = ranks(4, layout, MODEL, tokens)
    want_loss = check_step(results, MODEL, tokens)
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for r in results:
        check_tp_shapes(r, MODEL, 2)
        # replicated over the 2 dp ranks, and over the 2 tp ranks unless split by them
        assert r["groups"] == {n: 2 if n.endswith(TP_SPLIT) else 4 for n in r["grads"]}
    halves = [reference(MODEL, tokens[:2])[0] / 2, reference(MODEL, tokens[2:])[0] / 2]
    assert [r["local"] for r in results] == pytest.approx([halves[0]] * 2 + [halves[1]] * 2, rel=1e-5)
    assert sum(halves) == pytest.approx(want_loss, rel=1e-5)


def _rank_eval(rank, world, layout: Layout, cfg: ModelConfig, val, tokens) -> dict:
    """eval_loss on this rank's dp share of `val` (before any step), then one training step on `tokens`."""
    engine = Engine(cfg, layout, build_mesh(layout, "cpu"), CPU, seed=SEED, global_batch=layout.global_batch, seq_len=T)
    model, share = engine.model, layout.local_batch
    rows = slice(engine.coords.dp * share, (engine.coords.dp + 1) * share)
    model.train()
    rng = torch.random.get_rng_state()
    val_loss = engine.global_loss(engine.eval_loss(val[rows]))
    after = {
        "training": model.training,
        "rng": torch.equal(torch.random.get_rng_state(), rng),
        "grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "zero_seen": any(engine.zero._seen) if engine.zero is not None else False,
        # FSDP keeps the root gathered after a forward; eval_loss frees it as a backward would
        "gathered": [
            n
            for n, p in model.named_parameters()
            if layout.dp > 1 and layout.dp_mode == "fsdp" and not isinstance(p, DTensor)
        ],
    }
    local = engine.forward_backward(tokens[rows], keys_for(layout.global_batch)[rows])
    engine.reduce_tied_grads()
    return {
        "val_loss": val_loss,
        "after": after,
        "loss": engine.global_loss(local),
        "grads": {n: full(p.grad) for n, p in model.named_parameters()} if engine.zero is None else {},
        "norm": float(engine.clip_grad_norm_(0.0)),
    }


@pytest.mark.parametrize(
    "layout",
    [
        Layout(2, 1, 2, 1, 2, dp_mode="fsdp"),
        Layout(2, 1, 1, 1, 2, dp_mode="fsdp"),
        Layout(2, 1, 1, 1, 2, dp_mode="zero1"),
    ],
    ids=["dp2-pp2-1f1b-fsdp", "dp2-fsdp", "dp2-zero1"],
)
def test_the_validation_loss_is_the_plain_eval_mode_mean_and_leaves_the_step_alone(layout):
    """With dropout on and the model in training mode: the eval-mode token mean of the plain GPT on every rank;
    no gradient, ZeRO-1 buffer, RNG draw or gathered FSDP parameter left behind, the training mode kept; the
    next step is the plain step."""
    val, tokens = batch(4, DROPPING, seed=5), batch(4, DROPPING)
    gc.collect()
    results = run_ranks(_rank_eval, layout.world_size, layout, DROPPING, val, tokens, timeout=120)
    plain = GPT(DROPPING)
    plain.load_state_dict(initial_by_hand(DROPPING, SEED))
    plain.eval()
    with torch.no_grad():
        want = F.cross_entropy(plain(val[:, :-1]).reshape(-1, DROPPING.vocab_size), val[:, 1:].reshape(-1)).item()
    want_loss, want_grads, want_norm = reference(DROPPING, tokens, keys_for(4))
    for r in results:
        assert r["val_loss"] == pytest.approx(want, rel=1e-5)
        assert r["after"] == {"training": True, "rng": True, "grads": [], "zero_seen": False, "gathered": []}
        assert r["loss"] == pytest.approx(want_loss, rel=1e-5) and r["norm"] == pytest.approx(want_norm, rel=1e-5)
        assert_grads_match(r["grads"], want_grads)
