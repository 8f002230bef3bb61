"""Fixtures of the one-process unit tests, and the rule of this tier: a unit test forks nothing and starts no
process. Every way a test could (os.fork and the spawn family, subprocess, multiprocessing) fails here with a
line that says where such a test belongs, so the tier stays quick and a new test cannot slip out of it."""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess

import pytest

TIER_RULE = (
    "tests/unit forks nothing and starts no process: a test with forked ranks belongs in tests/distributed, "
    "one that runs a program in tests/e2e"
)


def _refusal(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{TIER_RULE} (called {what})")

    return refuse


@pytest.fixture(autouse=True, scope="module")
def _no_processes():
    """Module-scoped, so that a module's own fixtures are held to the rule too (the session's, such as the
    tokenized corpus shared by every tier, are made before it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _refuse_processes(monkeypatch)
        yield


def _refuse_processes(monkeypatch):
    # (os.system is left alone: the pickle tests' payloads name it, and a patched one would not pickle as
    # posix.system; it is no way to start ranks)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refusal(f"os.{name}"))
    # multiprocessing's spawn and forkserver start methods
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refusal("_posixsubprocess.fork_exec"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refusal("subprocess"))  # run, check_output, Popen
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refusal("multiprocessing"))
