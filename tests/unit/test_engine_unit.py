"""parallel/engine.py's Engine (and the pipeline, tensor- and data-parallel wrappers it applies) on a micro
GPT: in this process on a gloo group of one, and on a few ranks forked from it (parallel/local_ranks.py).

Every expectation is independent of the engine: the initial weights are written out from model/init.py's
documented recipe (a generator per parameter seeded by sha256("seed:name")), the loss and gradients come
from a plain single-process GPT with F.cross_entropy (mean over every token of the global batch), the
gradient norm is the plain square root of the sum of squares, and the layout facts (which ranks pair up,
which schedule, how many replicas of a piece) are counted by hand from the ("pp", "dp", "tp") mesh order.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor  # forked ranks would each import it lazily

from elastic_trainer.config import ModelConfig
from elastic_trainer.model import init as model_init
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.model.gpt import GPT
from elastic_trainer.parallel.data_parallel import apply_data_parallel
from elastic_trainer.parallel.engine import Engine, resolve_dtype
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout, LayoutError

MODEL = ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=64, context_length=16, name="micro")
T = 8
SEED = 7
CPU = torch.device("cpu")


# -- independent expectations ---------------------------------------------------------------------------


def _std(cfg: ModelConfig, name: str) -> float:
    if name == "pos_emb.weight":
        return 0.01
    if name.endswith("o_proj.weight") or name.endswith("mlp.proj.weight"):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


def initial_by_hand(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """model/init.py's recipe written out: LayerNorms 1/0, biases 0, weights N(0, std) from a generator
    seeded with the first 8 bytes (little-endian, top bit cleared) of sha256("seed:global name")."""
    d, v = cfg.d_model, cfg.vocab_size
    shapes = {
        "tok_emb.weight": (v, d),
        "pos_emb.weight": (cfg.context_length, d),
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "attn.qkv_proj.weight": (3 * d, d),
                p + "attn.qkv_proj.bias": (3 * d,),
                p + "attn.o_proj.weight": (d, d),
                p + "attn.o_proj.bias": (d,),
                p + "mlp.fc.weight": (4 * d, d),
                p + "mlp.fc.bias": (4 * d,),
                p + "mlp.proj.weight": (d, 4 * d),
                p + "mlp.proj.bias": (d,),
            }
        )
    out = {}
    for name, shape in shapes.items():
        if ".ln_" in name or name.startswith("ln_"):
            out[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif name.endswith("bias"):
            out[name] = torch.zeros(shape)
        else:
            key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
            out[name] = torch.empty(shape).normal_(0.0, _std(cfg, name), generator=torch.Generator().manual_seed(key))
    return out


def reference(cfg: ModelConfig, tokens: torch.Tensor, keys: torch.Tensor | None = None):
    """(mean token cross-entropy, {name: grad}, grad norm) of one plain single-process step."""
    model = GPT(cfg)
    model.load_state_dict(initial_by_hand(cfg, SEED))
    model.train()
    logits = model(tokens[:, :-1], dropout_keys=keys)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    return loss.item(), grads, norm


def batch(n: int, cfg: ModelConfig = MODEL, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n, T + 1), generator=torch.Generator().manual_seed(seed))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-5):
    for name, g in got.items():
        ref = want[name]
        assert g.shape == ref.shape, name
        err = float((g - ref).norm())
        assert err <= rel * float(ref.norm()) + 1e-9, (name, err, float(ref.norm()))


# -- on forked ranks ------------------------------------------------------------------------------------


DROPPING = ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=64, context_length=16, dropout=0.1)


def keys_for(n: int) -> torch.Tensor:
    return sample_keys(SEED, torch.arange(n, dtype=torch.int64))


# -- in this process ------------------------------------------------------------------------------------


def engine1(layout: Layout, cfg: ModelConfig = MODEL, device: torch.device = CPU, **kwargs) -> Engine:
    kwargs.setdefault("seed", SEED)
    kwargs.setdefault("global_batch", layout.global_batch)
    kwargs.setdefault("seq_len", T)
    return Engine(cfg, layout, build_mesh(layout, "cpu"), device, **kwargs)


def test_resolve_dtype():
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # a device object needs no GPU
    assert resolve_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    assert resolve_dtype("fp32", CPU) is torch.float32
    assert resolve_dtype("fp32", torch.device("cuda")) is torch.float32
    assert resolve_dtype("bf16", CPU) is torch.bfloat16
    with pytest.raises(KeyError) as err:
        resolve_dtype("fp16", CPU)
    assert err.value.args == ("fp16",)


def test_weights_start_from_the_seed_by_default_and_are_left_for_a_load_otherwise(group, monkeypatch):
    engine = engine1(Layout(1, 1, 1, 2, 1))
    want = initial_by_hand(MODEL, SEED)
    got = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    calls = []
    monkeypatch.setattr(model_init, "init_weights", lambda model, seed: calls.append(seed))
    engine1(Layout(1, 1, 1, 2, 1), initialize=False)
    assert calls == []
    engine1(Layout(1, 1, 1, 2, 1), initialize=True)
    assert calls == [SEED]


def test_the_layout_must_split_the_global_batch(group):
    with pytest.raises(LayoutError) as err:
        engine1(Layout(1, 1, 1, 2, 2), global_batch=6)
    assert str(err.value) == "dp*micro_batch*num_microbatches = 1*2*2 = 4 does not equal global batch 6"


@pytest.mark.parametrize("micro_batch, n_micro", [(4, 1), (2, 2), (1, 4)])
def test_one_rank_step_is_the_plain_mean_cross_entropy_step(group, micro_batch, n_micro):
    tokens = batch(4)
    engine = engine1(Layout(1, 1, 1, micro_batch, n_micro))
    assert engine.schedule is None and engine.tied_group is None and engine.tied_copy is None
    loss = engine.forward_backward(tokens)
    want_loss, want_grads, want_norm = reference(MODEL, tokens)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert engine.global_loss(loss) == pytest.approx(want_loss, rel=1e-5)
    assert_grads_match({n: p.grad for n, p in engine.model.named_parameters()}, want_grads)
    assert float(engine.clip_grad_norm_(0.0)) == pytest.approx(want_norm, rel=1e-5)
    # every parameter lives on this one rank only
    assert list(engine._norm_groups()) == [1]
    assert len(engine._norm_groups()[1]) == len(want_grads)


def test_a_micro_batch_loss_is_its_share_of_the_global_token_mean(group):
    engine = engine1(Layout(1, 1, 1, 2, 2))  # 4 samples of 8 tokens: 32 tokens
    logits = torch.randn(2, T, MODEL.vocab_size, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, MODEL.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    total = F.cross_entropy(logits.reshape(-1, MODEL.vocab_size), targets.reshape(-1), reduction="sum")
    assert float(engine.loss_fn(logits, targets)) == pytest.approx(float(total) / 32, rel=1e-6)


def test_recompute_runs_each_block_forward_again_in_backward(group):
    tokens = batch(2)
    for recompute, runs in [(False, 1), (True, 2)]:
        engine = engine1(Layout(1, 1, 1, 2, 1, recompute=recompute))
        calls = []
        for block in engine.model.layers.values():
            block.attn.register_forward_pre_hook(lambda *a: calls.append(1))
        engine.forward_backward(tokens)
        assert len(calls) == runs * MODEL.n_layers
        _, want, _ = reference(MODEL, tokens)
        assert_grads_match({n: p.grad for n, p in engine.model.named_parameters()}, want)


def test_bf16_parameters_compute_in_bf16(group):
    tokens = batch(2)
    for mode in ("fsdp", "ddp"):
        engine = engine1(Layout(1, 1, 1, 2, 1, dp_mode=mode), param_dtype=torch.bfloat16)
        seen = []
        original = engine.loss_fn
        engine.loss_fn = lambda logits, targets: seen.append(logits.dtype) or original(logits, targets)
        loss = engine.forward_backward(tokens)
        assert seen == [torch.bfloat16], mode
        want_loss, _, _ = reference(MODEL, tokens)
        assert float(loss) == pytest.approx(want_loss, rel=2e-2)
        grads = {n: full(p.grad) for n, p in engine.model.named_parameters()}
        _, want, _ = reference(MODEL, tokens)
        assert_grads_match(grads, want, rel=0.1)  # bf16 compute, but not scaled: summed, not averaged


def test_the_step_runs_on_the_engine_s_device(group):
    """Tokens and dropout keys are moved to the engine's device and the loss comes back there (the meta
    device stands in for an accelerator: this machine has only the CPU)."""
    meta = torch.device("meta")
    engine = engine1(Layout(1, 1, 1, 1, 2), DROPPING, device=meta)
    seen = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0].device, kwargs["dropout_keys"].device)), with_kwargs=True
    )
    loss = engine.forward_backward(batch(2), keys_for(2))
    assert loss.device == meta
    assert seen == [(meta, meta)] * 2
    assert engine.model.tok_emb.weight.grad.device == meta


def test_an_unknown_data_parallel_mode_is_refused(group):
    mesh = build_mesh(Layout(1, 1, 1, 1, 1), "cpu")
    message = None
    try:
        apply_data_parallel(GPT(MODEL), mesh["dp"], "zero", torch.float32, True)
    except ValueError as e:
        message = str(e)
    assert message == "unknown data-parallel mode 'zero' (valid: fsdp, ddp)"
