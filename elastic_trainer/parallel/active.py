"""Train on the first `used` ranks of a world when the layout uses fewer GPUs than the start holds; the others
stay up, idle, until the job's ranks end.

The ranks leave the world's process group and the first `used` join a new one on the same store (under a key
prefix of their own start, so a later start never meets an old one). The idle ranks keep their process alive
(TorchElastic counts a worker that exited early as done, and an agent whose workers are all done leaves the
job) and wait for the exit code that rank 0 of the trainers leaves in the store, then exit with it: the agent
sees one outcome for the whole worker group, as if every rank had trained. A stop request (the agent's
SIGTERM) ends the wait at once; a crash of a trainer makes the agent restart every rank, idle ones included.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from elastic_trainer.parallel.mesh import backend_for

POLL_S = 1.0


def _key(start: str) -> str:
    return f"elastic_trainer/active/{start}/"


def narrow(used: int, start: str, device: torch.device):
    """Leave the world's group; ranks below `used` join a group of `used` ranks. The store (for `release`,
    `wait_idle`)."""
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank < used:
        dist.init_process_group(
            backend_for(device),
            store=dist.PrefixStore(_key(start), store),
            rank=rank,
            world_size=used,
            device_id=device if device.type == "cuda" else None,
        )
    return store


def release(store, start: str, code: int, idle: int, timeout_s: float = 30.0) -> None:
    """Rank 0 of the trainers: the `idle` ranks may exit, with `code`. Waits (at most `timeout_s`) until each has
    read it: without an agent, this process may host the store they read it from."""
    store.set(_key(start) + "exit", str(code))
    deadline = time.monotonic() + timeout_s
    while idle and store.add(_key(start) + "read", 0) < idle and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_idle(store, start: str, stopping, unreachable_s: float = 60.0) -> int | None:
    """Wait for the trainers' exit code; None when `stopping()` turned true first, 1 when the store has been
    unreachable for `unreachable_s` (the trainers are gone without a word). Asked with `check` every POLL_S
    (elastic/store_wait.py says why not `wait`)."""
    key, failing_since = _key(start) + "exit", None
    while not stopping():
        try:
            if store.check([key]):
                code = int(store.get(key))
                store.add(_key(start) + "read", 1)
                return code
            failing_since = None
        except (RuntimeError, dist.DistStoreError):  # the store is unreachable
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= unreachable_s:
                return 1
        time.sleep(POLL_S)
    return None
