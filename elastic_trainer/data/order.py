"""The global sample order and each rank's share of it.

A corpus of n tokens holds (n - 1) // seq_len fixed-length samples; sample i is tokens
[i * seq_len, (i + 1) * seq_len + 1) (inputs and the targets shifted by one). Training reads samples in
one fixed order: epoch e is a permutation of all samples drawn from (seed, e). Global position p of that
order is sample `order.ids(p, p + 1)`; step s consumes positions [s * B, (s + 1) * B).

A data-parallel rank r of dp takes the contiguous share [s * B + r * B / dp, s * B + (r + 1) * B / dp),
and its micro-batch j is the j-th block of micro_batch samples of that share. The order itself never
depends on dp, so a resumed run in any layout continues at the exact next position.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"sample-order:{seed}:{epoch}".encode()).digest()[:8], "little")


class SampleOrder:
    """Global position -> sample id, one seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("the corpus is too short for even one sample at this sequence length")
        self.num_samples = num_samples
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.clear()
            rng = np.random.Generator(np.random.PCG64(_epoch_seed(self.seed, epoch)))
            self._cache[epoch] = rng.permutation(self.num_samples)
        return self._cache[epoch]

    def ids(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at global positions [start, stop), crossing epochs as needed."""
        out = np.empty(stop - start, dtype=np.int64)
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(stop - pos, self.num_samples - offset)
            out[pos - start : pos - start + take] = self.permutation(epoch)[offset : offset + take]
            pos += take
        return out


def samples_for(step: int, global_batch: int, dp_rank: int, dp: int) -> range:
    """Global positions consumed by data-parallel rank `dp_rank` of `dp` at step `step` (0-based)."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    share = global_batch // dp
    start = step * global_batch + dp_rank * share
    return range(start, start + share)


def microbatch_slices(share: int, micro_batch: int) -> list[slice]:
    """Micro-batch j of a rank's share is rows [j * micro_batch, (j + 1) * micro_batch)."""
    return [slice(j, j + micro_batch) for j in range(0, share, micro_batch)]


class TokenSamples:
    """Fixed-length samples of a token stream, addressed through a SampleOrder."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.order = SampleOrder((len(tokens) - 1) // seq_len, seed)

    def __len__(self) -> int:
        return self.order.num_samples

    def batch(self, positions: range) -> tuple[np.ndarray, torch.Tensor]:
        """(sample ids, int64 tensor of shape (len(positions), seq_len + 1))."""
        ids = self.order.ids(positions.start, positions.stop)
        return ids, sample_rows(self.tokens, self.seq_len, ids)


def sample_rows(tokens, seq_len: int, ids) -> torch.Tensor:
    """Samples `ids` of a token stream (sample i is tokens [i * T, i * T + T + 1)) as int64 rows."""
    T = seq_len
    return torch.from_numpy(np.stack([np.asarray(tokens[i * T : i * T + T + 1], dtype=np.int64) for i in ids]))
