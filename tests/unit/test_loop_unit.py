"""train/loop.py's Trainer on a process group of one (in this process, a micro model): what a step records, the RNG
seed it sets, the sample order and dropout keys it uses, its refusal of a diverged step, where its tokens come from,
and the validation loss (against Hugging Face's GPT-2 with the same weights). The expectations are written out from
the documented behaviour or computed with plain torch."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.data import tokenizer
from elastic_trainer.data.records import DataError
from elastic_trainer.model import init as model_init
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.model.hf import config_to_hf, state_dict_to_hf
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import PHASES, Diverged, Trainer

MODEL = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=16, name="micro")
B, T = 4, 8
CFG = TrainConfig(global_batch=B, seq_len=T, steps=5, seed=11, lr=1e-3, warmup_steps=4)
LAYOUT = Layout(1, 1, 1, B, 1)
TOKENS = np.random.default_rng(0).integers(0, MODEL.vocab_size, 41 * T + 1).astype(np.uint16)  # 41 samples


def make(model=MODEL, cfg=CFG, tokens=TOKENS, **kwargs) -> Trainer:
    return Trainer(model, cfg, LAYOUT, build_mesh(LAYOUT, "cpu"), torch.device("cpu"), tokens=tokens, **kwargs)


def spec_order(seed: int, n: int) -> np.ndarray:
    """Epoch 0 of the sample order as data/order.py documents it."""
    key = int.from_bytes(hashlib.sha256(f"sample-order:{seed}:0".encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(key)).permutation(n)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.model.named_parameters()}


def test_seq_len_up_to_the_context_length_is_accepted(group):
    assert make(cfg=TrainConfig(global_batch=B, seq_len=16, steps=1)).cfg.seq_len == 16
    with pytest.raises(ValueError) as err:
        make(cfg=TrainConfig(global_batch=B, seq_len=17, steps=1))
    assert str(err.value) == "seq_len=17 exceeds the model's context_length=16"


def test_initial_weights_are_a_function_of_the_seed_and_skipped_for_a_load(group, monkeypatch):
    one, again = params(make()), params(make())
    other = params(make(cfg=TrainConfig(global_batch=B, seq_len=T, steps=5, seed=12)))
    assert one.keys() == again.keys() == other.keys()
    assert all(torch.equal(one[k], again[k]) for k in one)
    assert not any(torch.equal(one[k], other[k]) for k in one if k.endswith("weight") and "ln" not in k)
    calls = []
    original = model_init.initial_value
    monkeypatch.setattr(model_init, "initial_value", lambda *a, **k: calls.append(a) or original(*a, **k))
    make(initialize=False)
    assert calls == []
    make()
    assert len(calls) == len(one)  # every parameter's full value, once


def test_a_step_records_what_plain_torch_computes(group):
    trainer = make()
    assert trainer.step == 0 and trainer.last_sample_ids is None
    order = spec_order(CFG.seed, 41)
    for step in range(2):
        ids = order[step * B : (step + 1) * B]
        rows = torch.tensor(np.stack([TOKENS[i * T : i * T + T + 1].astype(np.int64) for i in ids]))
        reference = copy.deepcopy(trainer.engine.model)
        logits = reference(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, MODEL.vocab_size), rows[:, 1:].reshape(-1))
        loss.backward()
        norm = math.sqrt(sum(float((p.grad**2).sum()) for p in reference.parameters() if p.grad is not None))
        t0, w0 = time.perf_counter(), time.time()
        record = trainer.train_step()
        wall, w1 = time.perf_counter() - t0, time.time()
        assert trainer.last_sample_ids.tolist() == ids.tolist()
        assert set(record) == {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "step_time_s",
            "phases_s",
            "tokens_per_s",
            "samples",
            "world_size",
            "layout",
            "time",
            "kept_memory_gib",
        }
        with open("/proc/self/status") as f:  # one rank: its own anonymous memory, read again just after
            anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
        assert record["kept_memory_gib"] == pytest.approx(anon / 2**30, abs=8 / 1024)
        phases = record["phases_s"]  # consecutive spans of the step: they add up to it
        assert list(phases) == list(PHASES) and min(phases.values()) >= 0
        assert sum(phases.values()) == pytest.approx(record["step_time_s"], abs=1e-5)
        assert record["step"] == trainer.step == step + 1
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert record["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert record["lr"] == pytest.approx(CFG.lr * (step + 1) / CFG.warmup_steps, rel=1e-12)  # warm-up
        assert 0 < record["step_time_s"] <= wall
        assert record["tokens_per_s"] == pytest.approx(B * T / record["step_time_s"], rel=1e-9)
        assert record["samples"] == [step * B, (step + 1) * B]
        assert record["world_size"] == 1 and record["layout"] == LAYOUT.to_dict()
        assert w0 <= record["time"] <= w1


def _seed_of(seed: int, step: int) -> tuple[int, int]:
    """(sha256's first 8 bytes little-endian, that value with the top bit cleared) of "seed:step:pp:dp"."""
    raw = int.from_bytes(hashlib.sha256(f"{seed}:{step}:0:0".encode()).digest()[:8], "little")
    return raw, raw & ((1 << 63) - 1)


def test_each_step_seeds_torch_from_the_seed_and_the_step(group):
    # steps whose hash has the top bit set (cleared by the mask) and the lowest bit set
    steps = [s for s in range(64) if _seed_of(CFG.seed, s)[0] >> 63 and _seed_of(CFG.seed, s)[0] & 1][:2]
    steps += [s for s in range(64) if not _seed_of(CFG.seed, s)[0] >> 63][:1]
    assert len(steps) == 3
    trainer = make()
    for s in steps:
        trainer.restore(s, CFG)
        trainer.train_step()
        assert torch.initial_seed() == _seed_of(CFG.seed, s)[1]


def test_dropout_keys_follow_the_global_sample_positions(group, monkeypatch):
    seen = []

    def capture(trainer):
        forward_backward = trainer.engine.forward_backward
        monkeypatch.setattr(
            trainer.engine,
            "forward_backward",
            lambda tokens, keys=None: seen.append(keys) or forward_backward(tokens, keys),
        )

    plain = make()
    capture(plain)
    plain.train_step()
    assert seen == [None]  # no dropout: no keys
    seen.clear()
    dropping = make(model=ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=16, dropout=0.1))
    capture(dropping)
    dropping.restore(2, CFG)
    dropping.train_step()
    [keys] = seen
    assert keys.dtype == torch.int64
    assert torch.equal(keys, sample_keys(CFG.seed, torch.tensor(range(2 * B, 3 * B), dtype=torch.int64)))


@pytest.mark.parametrize("bad", ["grad_norm", "loss"])
def test_a_non_finite_step_is_not_applied(group, monkeypatch, bad):
    trainer = make()
    trainer.train_step()
    trainer.train_step()
    before = params(trainer)
    seen = {}
    engine = trainer.engine
    clip, global_loss = engine.clip_grad_norm_, engine.global_loss

    def fake_clip(max_norm):
        seen["grad_norm"] = float(clip(max_norm))
        return torch.tensor(math.inf) if bad == "grad_norm" else torch.tensor(seen["grad_norm"])

    def fake_loss(local):
        seen["loss"] = global_loss(local)
        return math.nan if bad == "loss" else seen["loss"]

    monkeypatch.setattr(engine, "clip_grad_norm_", fake_clip)
    monkeypatch.setattr(engine, "global_loss", fake_loss)
    with pytest.raises(Diverged) as err:
        trainer.train_step()
    e = err.value
    assert e.step == 3 and trainer.step == 2
    if bad == "grad_norm":
        assert e.loss == seen["loss"] and math.isfinite(e.loss) and e.grad_norm == math.inf
        assert str(e).startswith(f"training diverged at step 3: loss {seen['loss']}, gradient norm inf; ")
    else:
        assert math.isnan(e.loss) and e.grad_norm == seen["grad_norm"] and math.isfinite(e.grad_norm)
    after = params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bf16_computes_in_bf16_on_the_cpu_too(group):
    fp32 = make().train_step()["loss"]
    bf16 = make(
        cfg=TrainConfig(global_batch=B, seq_len=T, steps=5, seed=11, lr=1e-3, warmup_steps=4, dtype="bf16")
    ).train_step()["loss"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=2e-2)


def _corpus_cfg(tmp_path, seq_len, source, skip_bad=False):
    return TrainConfig(
        global_batch=1,
        seq_len=seq_len,
        steps=1,
        data=(str(source),),
        data_cache=str(tmp_path / "cache"),
        skip_bad_records=skip_bad,
    )


def test_without_tokens_the_configured_corpus_is_read_into_the_cache(group, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "default-cache"))  # where no cache may go
    text = "The quick brown fox jumps over the lazy dog."
    (tmp_path / "a.txt").write_text(text)
    stream = tokenizer.encode(text) + [tokenizer.EOT_ID]
    n = len(stream)
    one = Layout(1, 1, 1, 1, 1)
    model = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=n)

    def build(cfg):
        return Trainer(model, cfg, one, build_mesh(one, "cpu"), torch.device("cpu"))

    trainer = build(_corpus_cfg(tmp_path, n - 1, tmp_path / "a.txt"))  # exactly one sample: n tokens
    assert np.asarray(trainer.samples.tokens).tolist() == stream
    assert [p.name.startswith("a.txt-") for p in (tmp_path / "cache" / "prepared").iterdir()] == [True]
    assert not (tmp_path / "default-cache").exists()
    with pytest.raises(
        DataError, match=rf"^the data has {n} tokens \(.*\); one sample of --seq-len {n} needs {n + 1} "
    ):
        build(_corpus_cfg(tmp_path, n, tmp_path / "a.txt"))
    good = "A record that is fine."
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": good}) + "\n{not json}\n")
    trainer = build(_corpus_cfg(tmp_path, 2, tmp_path / "b.jsonl", skip_bad=True))
    assert np.asarray(trainer.samples.tokens).tolist() == tokenizer.encode(good) + [tokenizer.EOT_ID]


# -- the validation loss --------------------------------------------------------------------------------

VAL = np.random.default_rng(1).integers(0, MODEL.vocab_size, 11 * T + 1).astype(np.uint16)  # 11 samples


def hf_mean_loss(trainer: Trainer, rows: torch.Tensor) -> float:
    """The token-mean cross-entropy of Hugging Face's GPT2LMHeadModel (the independent implementation) with the
    trainer's weights exported (model/hf.py), in eval mode."""
    transformers = pytest.importorskip("transformers")
    cfg = trainer.model_cfg
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    ).eval()
    hf.load_state_dict(state_dict_to_hf(trainer.engine.model.state_dict(), cfg), strict=False)
    hf.tie_weights()
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), rows[:, 1:].reshape(-1)).item()


def val_rows(ids) -> torch.Tensor:
    return torch.tensor(np.stack([VAL[i * T : i * T + T + 1].astype(np.int64) for i in ids]))


def test_the_validation_loss_is_gpt2_s_cross_entropy_of_two_samples_in_order(group):
    cfg = TrainConfig(global_batch=2, seq_len=T, steps=5, seed=11, eval_batches=1)
    one = Layout(1, 1, 1, 1, 2)  # two micro-batches of one sample
    dropping = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=16, dropout=0.5)
    for model in (MODEL, dropping):  # dropout is off in evaluation, and the model is left in training mode
        trainer = Trainer(
            model, cfg, one, build_mesh(one, "cpu"), torch.device("cpu"), tokens=TOKENS, val_tokens=VAL[: 2 * T + 1]
        )
        assert (trainer.val_batches, trainer.val_samples) == (1, 2)
        want = hf_mean_loss(trainer, val_rows([0, 1]))
        assert trainer.evaluate() == pytest.approx(want, rel=1e-6)
        assert trainer.engine.model.training
        trainer.train_step()
        want = hf_mean_loss(trainer, val_rows([0, 1]))
        assert trainer.evaluate() == pytest.approx(want, rel=1e-6)


def test_the_validation_loss_is_the_mean_of_whole_batches_in_order(group):
    """11 samples, batches of 4: eval_batches=4 takes the 2 whole batches there are, eval_batches=1 the first."""
    for eval_batches, n in [(4, 8), (1, 4)]:
        trainer = make(
            cfg=TrainConfig(global_batch=B, seq_len=T, steps=5, seed=11, eval_batches=eval_batches), val_tokens=VAL
        )
        assert trainer.val_samples == n
        assert trainer.evaluate() == pytest.approx(hf_mean_loss(trainer, val_rows(range(n))), rel=1e-6)


def test_evaluation_leaves_the_next_step_as_it_was(group):
    """Gradients, the optimizer state, the RNG and so the next steps' losses, norms and weights are those of a
    run without evaluation; an evaluation before any step too."""
    plain, evaluated = make(), make(val_tokens=VAL)
    evaluated.evaluate()
    for _ in range(3):
        a, b = plain.train_step(), evaluated.train_step()
        rng = torch.random.get_rng_state()
        grads = [p.grad.clone() for p in evaluated.engine.model.parameters()]
        evaluated.evaluate()
        assert torch.equal(torch.random.get_rng_state(), rng)
        assert all(torch.equal(p.grad, g) for p, g in zip(evaluated.engine.model.parameters(), grads))
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    one, other = params(plain), params(evaluated)
    assert all(torch.equal(one[k], other[k]) for k in one)
    assert str(plain.optimizer.state_dict()) == str(evaluated.optimizer.state_dict())


def test_a_validation_stream_without_one_batch_is_refused_in_one_line(group):
    with pytest.raises(ConfigError) as err:
        make(val_tokens=VAL[: 3 * T + 1])  # 3 samples; a batch is 4
    assert str(err.value) == (
        f"the validation data has 3 samples of {T} + 1 tokens ({3 * T + 1} tokens); one validation batch needs "
        f"global_batch={B} (valid: more validation data, a larger --val-fraction or a smaller --global-batch)"
    )
    assert make(val_tokens=VAL[: 4 * T + 1]).val_samples == 4  # exactly one batch
    with pytest.raises(ValueError, match=r"needs validation data"):
        make().evaluate()
