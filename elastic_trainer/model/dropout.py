"""Dropout whose masks do not depend on the layout.

`nn.Dropout` draws from the device's RNG stream, so a mask depends on which rank computes a sample, in which
micro-batch and after how many other draws: the loss then changes with the (dp, tp, pp, micro-batch) split.
Here every mask element is a hash of a counter instead (counter-based random numbers, as in Philox or
SplitMix): the keep/drop bit of element i of site s in layer l for one sample is

    keep = mix(site_key(sample_key, l, s) + i * GOLDEN) >= p * 2**32

where `sample_key` is a function of (seed, global sample position) that the trainer passes with each
micro-batch, and i is the element's index within that sample's full (unsharded) tensor. A tensor-parallel
rank that holds heads [h0, h0 + H) of the attention probabilities indexes them from h0, and replicated
sites (embeddings, the residual branches) compute the identical full mask on every tp rank. So any split
draws the same masks, on CPU and GPU alike (integer arithmetic, no device RNG).

All arithmetic is on 32-bit values held in int64 tensors, with products split so that nothing overflows
int64: results are exact and the same on every device.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: the counter increment of SplitMix-style generators
SITES = {"embed": 1, "attn": 2, "attn_out": 3, "mlp_out": 4}
"""Dropout sites, each with its own stream: after the embeddings, on the attention probabilities, after the
attention's output projection, after the MLP."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x, c < 2**32, without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def sample_keys(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sample from (seed, global sample position); positions is an int64 tensor."""
    if seed < 0 or seed >= 1 << 64:
        raise ValueError(f"seed {seed} is outside [0, 2**64)")
    h = torch.full_like(positions, seed & M32)
    h = mix32(mix32(h) ^ (seed >> 32))
    h = mix32(h ^ (positions & M32))
    return mix32(h ^ (positions >> 32))


def layer_keys(keys: torch.Tensor, layer: int) -> torch.Tensor:
    """The per-sample keys of one layer (layer -1: outside the blocks). The model computes them outside its
    blocks, so that identical blocks run identical code: a block compiled once serves every layer (with the
    layer index inside, torch.compile would specialize and compile each block again)."""
    return keys ^ ((layer + 1) & M32)


def site_of(keys_of_layer: torch.Tensor, site: str) -> torch.Tensor:
    """The per-sample key of one dropout site, from its layer's keys."""
    return mix32(mix32(keys_of_layer) ^ SITES[site])


def site_keys(keys: torch.Tensor, layer: int, site: str) -> torch.Tensor:
    """The per-sample key of one dropout site of one layer (layer -1: outside the blocks)."""
    return site_of(layer_keys(keys, layer), site)


def keep_mask(keys: torch.Tensor, shape: tuple[int, ...], p: float, offset: int = 0) -> torch.Tensor:
    """Boolean keep mask of shape (len(keys), *shape): element i of sample b (row-major within the sample,
    counted from `offset`) is kept with probability 1 - p, decided by hash(keys[b], offset + i)."""
    n = 1
    for s in shape:
        n *= s
    if offset + n > 1 << 32:
        raise ValueError(f"a dropout site of {offset + n} elements per sample exceeds the 2**32 counter")
    counter = _mul32(torch.arange(offset, offset + n, device=keys.device, dtype=torch.int64), GOLDEN)
    threshold = int(p * (1 << 32))
    keep = torch.empty(len(keys), n, dtype=torch.bool, device=keys.device)
    for b in range(len(keys)):  # one sample at a time: the int64 temporaries stay at a few times n
        torch.ge(mix32((counter + keys[b]) & M32), threshold, out=keep[b])
    return keep.view(len(keys), *shape)


def dropout(x: torch.Tensor, keys: torch.Tensor, p: float, offset: int = 0) -> torch.Tensor:
    """Inverted dropout of x (batch first) with the masks of `keys`; the backward saves only the bool mask."""
    keep = keep_mask(keys.to(x.device), tuple(x.shape[1:]), p, offset)
    return torch.where(keep, x, 0.0) * (1.0 / (1.0 - p))
