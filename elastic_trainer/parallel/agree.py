"""One decision per job: facts every rank needs identically, settled once the process group exists and
before the mesh does.

Each rank knows only its own host's rank count (torchrun's LOCAL_WORLD_SIZE); with hosts of different sizes
ranks planning on their own would choose different layouts and hang in the first collective. So the ranks
first learn the real topology (which host each rank is on), then rank 0 decides and broadcasts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from elastic_trainer.config import ConfigError
from elastic_trainer.plan.topology import Topology

T = TypeVar("T")


@dataclass(frozen=True)
class _Refused:
    """What rank 0 broadcasts when deciding raised a ConfigError."""

    message: str


def gather_topology(group_rank: int | None) -> Topology:
    """Ranks per host, in host order (`group_rank`: torchrun's GROUP_RANK of this rank; one host when None)."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, group_rank or 0)
    counts = Counter(hosts)
    return Topology(tuple(counts[h] for h in sorted(counts)))


def agree(decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, its result on every rank. A ConfigError on rank 0 is raised on every rank (the
    others would otherwise wait for a broadcast that never comes)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except ConfigError as e:
            box[0] = _Refused(str(e))
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], _Refused):
        raise ConfigError(box[0].message)
    return box[0]
