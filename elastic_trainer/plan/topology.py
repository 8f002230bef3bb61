"""How a job's ranks sit on hosts: the number of ranks on each host, equal or not.

torchrun gives every host's ranks consecutive global ranks (hosts in rendezvous order), and the mesh puts tp
innermost, so a tp group is `size` consecutive ranks aligned at a multiple of `size`. Such groups stay on one
host, whatever order the hosts join in, exactly when `size` divides every host's rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_trainer.config import ConfigError, positive_int


@dataclass(frozen=True)
class Topology:
    """Ranks per host, in no particular order; their sum is the world size."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ConfigError("a topology needs at least one host")
        for size in self.sizes:
            positive_int("ranks per host", size)

    @classmethod
    def uniform(cls, world_size: int, per_host: int) -> Topology:
        """`world_size` ranks filling hosts of `per_host` ranks (the last one possibly partly)."""
        full, rest = divmod(world_size, per_host)
        return cls((per_host,) * full + ((rest,) if rest else ()))

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    @property
    def single(self) -> bool:
        return len(self.sizes) == 1

    @property
    def largest(self) -> int:
        """Ranks on the busiest host (what bounds a shared host's memory and cores)."""
        return max(self.sizes)

    @property
    def common(self) -> int:
        """The largest group size that stays within a host on every host: the gcd of the host sizes."""
        return self.sizes[0] if self.single else math.gcd(*self.sizes)

    def within(self, size: int) -> bool:
        """Whether every aligned group of `size` consecutive ranks stays on one host."""
        return self.common % size == 0

    def first(self, ranks: int) -> Topology:
        """The hosts of the first `ranks` ranks (hosts in rank order, the last one possibly in part)."""
        sizes, left = [], ranks
        for n in self.sizes:
            if left:
                sizes.append(min(n, left))
                left -= sizes[-1]
        return Topology(tuple(sizes))

    def same_hosts(self, sizes: tuple[int, ...] | None) -> bool:
        """Whether `sizes` are these hosts' rank counts, in any order."""
        return sizes is not None and sorted(sizes) == sorted(self.sizes)

    def describe(self) -> str:
        """'8 per host', or '3+1 per host' when the hosts differ."""
        if len(set(self.sizes)) == 1:
            return f"{self.sizes[0]} per host"
        return "+".join(str(s) for s in self.sizes) + " per host"
