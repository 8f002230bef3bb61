"""Shared fixtures: the default corpus tokenized once per session into a private cache."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch
import torch.distributed as dist

# DTensor warns about multi-step all-gathers when tests gather full parameters; that is expected.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    path = os.environ.get("ET_TEST_DATA_CACHE") or str(tmp_path_factory.mktemp("data-cache"))
    return path


@pytest.fixture(scope="session")
def sotu_tokens(data_cache):
    from elastic_trainer.data import load_tokens

    return load_tokens(["sotu"], data_cache)


@pytest.fixture
def group():
    """A gloo process group of one in this process, gone after the test with its threads (torn down after
    the test's monkeypatch, whose undo may hold the last reference to a group's user)."""
    set_env = "GLOO_SOCKET_IFNAME" not in os.environ
    if set_env:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng)
        dist.destroy_process_group()
        # groups a test left in reference cycles: their gloo threads must not outlive it (a later fork would
        # inherit them)
        gc.collect()
        if set_env:
            del os.environ["GLOO_SOCKET_IFNAME"]
