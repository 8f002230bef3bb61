"""`init(global_batch_size, max_gpu_batch_size)`: Run:AI's elasticity arithmetic, returned as a frozen object.

Run:AI's `runai.elastic.init` stores its results in module globals (`runai.elastic.steps`, `.batch_size`,
`.master`). This project keeps no module-level mutable state, so `init` returns an `ElasticConfig` instead;
read `cfg.steps` where Run:AI code reads `runai.elastic.steps`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from elastic_trainer.config import ConfigError, divisors, positive_int
from elastic_trainer.elastic.torchrun_env import int_variable


@dataclass(frozen=True)
class ElasticConfig:
    """How one GPU meets the global batch: `steps` accumulated batches of `batch_size` samples each."""

    global_batch_size: int
    """Samples per optimizer step, summed over all GPUs and accumulation steps."""
    world_size: int
    """Data-parallel GPUs (processes) sharing the global batch."""
    batch_size: int
    """Samples one GPU processes per forward/backward (per accumulation step)."""
    steps: int
    """Gradient-accumulation steps per optimizer step; pass it to `GradientAccumulation`."""
    master: bool
    """True on global rank 0: the process that should log, print progress and save checkpoints."""


def init(global_batch_size: int, max_gpu_batch_size: int, world_size: int | None = None) -> ElasticConfig:
    """Split `global_batch_size` over the GPUs, accumulating gradients where one GPU cannot hold its share.

    Each GPU must process global_batch_size / world_size samples per optimizer step; `steps` is the smallest
    number of equal batches, none larger than `max_gpu_batch_size`, that share splits into. Run:AI's
    example, global 256 with at most 64 per GPU: 4 steps of 64 on 1 GPU, 2 on 2 GPUs, 1 on 4, 1 of 32 on 8.

    `world_size` defaults to the torch.distributed world size when a process group exists, else the
    WORLD_SIZE environment variable, else 1; `master` comes from the rank the same way (RANK, else 0).
    Unlike Run:AI's `init`, this sets no module globals: it returns the result.
    Raises ConfigError (a ValueError) with a one-line message when the global batch cannot be met.
    """
    world = _detected_world() if world_size is None else positive_int("world_size", world_size)
    _check_global_batch(global_batch_size, world)
    limit = positive_int("max_gpu_batch_size", max_gpu_batch_size)
    share = global_batch_size // world
    steps = next(s for s in divisors(share) if share // s <= limit)  # s == share always fits
    return ElasticConfig(global_batch_size, world, share // steps, steps, master=_rank() == 0)


def _detected_world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int_variable("WORLD_SIZE", 1, minimum=1)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int_variable("RANK", 0, minimum=0)


def _check_global_batch(value: object, world: int) -> None:
    valid_type = isinstance(value, int) and not isinstance(value, bool)
    if valid_type and value > 0 and value % world == 0:
        return
    hint = f"(nearest feasible: {' or '.join(str(v) for v in nearest_feasible(value, world))})"
    if valid_type and value > 0:
        raise ConfigError(f"global batch {value} is not divisible by {world} GPUs {hint}")
    raise ConfigError(
        f"global_batch_size={value!r} must be a positive integer divisible by the world size {world} {hint}"
    )


def nearest_feasible(value: object, world: int) -> list[int]:
    """The positive multiples of `world` just below and above `value` (just `world` when nothing is near)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return [world]
    below, above = int(value // world) * world, int(-(-value // world)) * world  # exact for ints
    return sorted({v for v in (below, above) if v > 0} or {world})
