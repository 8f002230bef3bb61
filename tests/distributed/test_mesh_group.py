"""The mesh's process groups really form on forked gloo ranks."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.parallel import mesh


def _join_for_real(env: dict, queue) -> None:
    import os

    os.environ.update(env)
    try:
        distributed = TorchrunEnv.read().distributed
        mesh.init_process_group(torch.device("cpu"), distributed)
        mesh.init_process_group(torch.device("cpu"), distributed)  # a second call joins nothing new
        t = torch.ones(2)
        dist.all_reduce(t)
        queue.put((dist.get_backend(), dist.get_rank(), dist.get_world_size(), t.tolist()))
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the parent
        queue.put(repr(e))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("torchrun", [False, True])
def test_the_group_really_forms(torchrun):
    """On a forked process (the test process keeps no group): both ways give a working gloo group of one."""
    env = (
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if torchrun
        else {}
    )
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_join_for_real, args=(env, queue))
    p.start()
    got = queue.get(timeout=60)
    p.join(timeout=30)
    assert got == ("gloo", 0, 1, [1.0, 1.0])
