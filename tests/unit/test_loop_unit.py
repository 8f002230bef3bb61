"""train/loop.py's Trainer on a process group of one (in this process, a micro model): what a step records,
the RNG seed it sets, the sample order and dropout keys it uses, its refusal of a diverged step, and where its
tokens come from. The expectations are written out from the documented behaviour or computed with plain torch."""

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

from elastic_trainer.config import ModelConfig, TrainConfig
from elastic_trainer.data import tokenizer
from elastic_trainer.data.records import DataError
from elastic_trainer.model import init as model_init
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import Diverged, Trainer

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
        ids = order[step * B:(step + 1) * B]
        rows = torch.tensor(np.stack([TOKENS[i * T:i * T + T + 1].astype(np.int64) for i in ids]))
        reference = copy.deepcopy(trainer.engine.model)
        logits = reference(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, MODEL.vocab_size), rows[:, 1:].reshape(-1))
        loss.backward()
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in reference.parameters() if p.grad is not None))
        t0, w0 = time.perf_counter(), time.time()
        record = trainer.train_step()
        wall, w1 = time.perf_counter() - t0, time.time()
        assert trainer.last_sample_ids.tolist() == ids.tolist()
        assert set(record) == {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "samples",
                               "world_size", "layout", "time"}
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
        monkeypatch.setattr(trainer.engine, "forward_backward",
                            lambda tokens, keys=None: seen.append(keys) or forward_backward(tokens, keys))

    plain = make()
    capture(plain)
    plain.train_step()
    assert seen == [None]  # no dropout: no keys
    seen.clear()
    dropping = make(model=ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64, context_length=16,
                                      dropout=0.1))
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
    bf16 = make(cfg=TrainConfig(global_batch=B, seq_len=T, steps=5, seed=11, lr=1e-3, warmup_steps=4,
                                dtype="bf16")).train_step()["loss"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=2e-2)


def _corpus_cfg(tmp_path, seq_len, source, skip_bad=False):
    return TrainConfig(global_batch=1, seq_len=seq_len, steps=1, data=(str(source),),
                       data_cache=str(tmp_path / "cache"), skip_bad_records=skip_bad)


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
    assert [p.name.startswith("tokens-") for p in (tmp_path / "cache").glob("*.npy")] == [True]
    assert not (tmp_path / "default-cache").exists()
    with pytest.raises(DataError, match=rf"^the data has {n} tokens \(.*\); one sample of --seq-len {n} needs {n + 1} "):
        build(_corpus_cfg(tmp_path, n, tmp_path / "a.txt"))
    good = "A record that is fine."
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": good}) + "\n{not json}\n")
    trainer = build(_corpus_cfg(tmp_path, 2, tmp_path / "b.jsonl", skip_bad=True))
    assert np.asarray(trainer.samples.tokens).tolist() == tokenizer.encode(good) + [tokenizer.EOT_ID]
