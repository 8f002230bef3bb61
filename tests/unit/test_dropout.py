"""Keyed dropout (model/dropout.py): the hash against a plain-Python reference, the masks' statistics, and
the properties that make it layout-independent (a sample's mask does not depend on its batch neighbours, a
head's mask does not depend on which heads a rank holds); the materialized attention against SDPA."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

from elastic_trainer.config import load_model_config
from elastic_trainer.model import dropout as keyed
from elastic_trainer.model.gpt import GPT, Attention
from elastic_trainer.model.init import init_weights

TINY = load_model_config("gpt-tiny")


def fmix32_by_hand(h: int) -> int:
    """MurmurHash3's fmix32 with Python's unbounded integers."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def keep_by_hand(key: int, i: int, p: float) -> bool:
    return fmix32_by_hand((key + i * 0x9E3779B9) % 2**32) >= int(p * 2**32)


def test_the_hash_equals_plain_integer_arithmetic():
    rng = random.Random(0)
    values = [0, 1, 2**16 - 1, 2**16, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    x = torch.tensor(values, dtype=torch.int64)
    assert keyed._mul32(x, 0xC2B2AE35).tolist() == [(v * 0xC2B2AE35) % 2**32 for v in values]
    assert keyed.mix32(x).tolist() == [fmix32_by_hand(v) for v in values]


def test_masks_equal_the_hand_computed_bits():
    keys = torch.tensor([0, 12345, 2**32 - 1], dtype=torch.int64)
    mask = keyed.keep_mask(keys, (3, 5), 0.3, offset=7)
    for b, key in enumerate(keys.tolist()):
        assert mask[b].flatten().tolist() == [keep_by_hand(key, 7 + i, 0.3) for i in range(15)]


def test_sample_keys_are_32_bit_and_depend_on_seed_and_position():
    positions = torch.arange(0, 4096, dtype=torch.int64)
    keys = keyed.sample_keys(3, positions)
    assert keys.min() >= 0 and keys.max() < 2**32 and len(set(keys.tolist())) == 4096
    assert not torch.equal(keys, keyed.sample_keys(4, positions))
    assert not torch.equal(keys[:5], keyed.sample_keys(3, positions[:5] + 2**32))  # high bits count too
    with pytest.raises(ValueError, match="seed"):
        keyed.sample_keys(-1, positions)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_one_minus_p_and_sites_are_independent(p):
    keys = keyed.sample_keys(0, torch.arange(64))
    n = 64 * 4096
    masks = {site: keyed.keep_mask(keyed.site_keys(keys, 2, site), (4096,), p) for site in keyed.SITES}
    for mask in masks.values():
        assert abs(mask.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    a, b = masks["attn_out"], masks["mlp_out"]
    both = (a & b).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * math.sqrt(p * (1 - p) / n)  # independent streams
    other_layer = keyed.keep_mask(keyed.site_keys(keys, 3, "mlp_out"), (4096,), p)
    assert not torch.equal(other_layer, b)


def test_a_samples_mask_does_not_depend_on_its_batch_or_on_sharding():
    keys = keyed.sample_keys(5, torch.arange(8))
    whole = keyed.keep_mask(keys, (4, 16, 16), 0.2)
    assert torch.equal(whole[3:6], keyed.keep_mask(keys[3:6], (4, 16, 16), 0.2))  # another micro-batch split
    # heads 2 and 3 held by one tensor-parallel rank: counted from head 2
    assert torch.equal(whole[:, 2:], keyed.keep_mask(keys, (2, 16, 16), 0.2, offset=2 * 16 * 16))


def test_dropout_scales_kept_values_and_zeroes_the_rest():
    keys = keyed.sample_keys(1, torch.arange(4))
    x = torch.randn(4, 10, 6, requires_grad=True)
    y = keyed.dropout(x, keys, 0.25)
    keep = keyed.keep_mask(keys, (10, 6), 0.25)
    assert torch.equal(y == 0, ~keep)
    assert torch.allclose(y, torch.where(keep, x / 0.75, torch.zeros(())), rtol=1e-6, atol=0)
    y.sum().backward()
    assert torch.allclose(x.grad, keep.float() / 0.75, rtol=1e-6, atol=0)


def test_materialized_attention_equals_sdpa_without_dropout():
    torch.manual_seed(0)
    attn = Attention(dataclasses.replace(TINY, dropout=0.0))
    q, k, v = torch.randn(3, 2, 4, 9, 16).unbind(0)
    ours = attn._attention_with_keyed_dropout(q, k, v, keyed.sample_keys(0, torch.arange(2)))
    assert torch.allclose(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_attention_dropout_masks_the_probabilities_by_global_head():
    """Hand computation: softmax(q k^T / sqrt(d) + causal), each (head, i, j) dropped by its keyed bit."""
    torch.manual_seed(1)
    p, T = 0.3, 7
    attn = Attention(dataclasses.replace(TINY, dropout=p))
    attn.head_offset = 1  # a tensor-parallel rank holding heads 1 and 2
    q, k, v = torch.randn(3, 2, 2, T, 16).unbind(0)
    keys = keyed.sample_keys(9, torch.arange(2))
    ours = attn._attention_with_keyed_dropout(q, k, v, keyed.layer_keys(keys, 2))  # layer 2's keys
    site = keyed.site_keys(keys, 2, "attn")
    expected = torch.zeros_like(ours)
    for b in range(2):
        for h in range(2):
            probs = ((q[b, h] @ k[b, h].T) / 4.0).masked_fill(torch.ones(T, T).tril() == 0, -math.inf).softmax(-1)
            for i in range(T):
                for j in range(T):
                    if not keep_by_hand(int(site[b]), ((1 + h) * T + i) * T + j, p):
                        probs[i, j] = 0.0
            expected[b, h] = probs / (1 - p) @ v[b, h]
    assert torch.allclose(ours, expected, atol=1e-6)


def tiny_model(dropout: float) -> GPT:
    model = GPT(dataclasses.replace(TINY, dropout=dropout, vocab_size=97))
    init_weights(model, 0)
    return model


def test_model_outputs_are_per_sample_functions_of_their_keys():
    model = tiny_model(0.1).train()
    x = torch.randint(0, 97, (4, 12))
    keys = keyed.sample_keys(0, torch.arange(100, 104))
    whole = model(x, dropout_keys=keys)
    halves = torch.cat([model(x[:2], dropout_keys=keys[:2]), model(x[2:], dropout_keys=keys[2:])])
    assert torch.allclose(whole, halves, atol=1e-5)
    assert torch.equal(whole, model(x, dropout_keys=keys))  # no hidden RNG state
    other = model(x, dropout_keys=keyed.sample_keys(0, torch.arange(200, 204)))
    assert (whole - other).abs().max() > 1e-2  # dropout acts, and another position draws other masks
    no_dropout = tiny_model(0.0).train()(x)
    assert (whole - no_dropout).abs().max() > 1e-2
    assert torch.allclose(model.eval()(x, dropout_keys=keys), no_dropout, atol=1e-6)  # eval: no dropout


def test_recompute_draws_the_same_masks():
    model = tiny_model(0.2).train()
    x = torch.randint(0, 97, (2, 10))
    keys = keyed.sample_keys(0, torch.arange(2))
    model(x, dropout_keys=keys).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for block in model.layers.values():
        block.recompute = True
    model(x, dropout_keys=keys).square().sum().backward()
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-4)
