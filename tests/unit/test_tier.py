"""The unit tier's rule holds: starting a process in any of the usual ways fails the test (tests/unit/conftest.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from elastic_trainer.parallel.local_ranks import run_ranks


def _noop(rank: int) -> int:
    return rank


@pytest.mark.parametrize(
    "start",
    [
        lambda: os.fork(),
        lambda: subprocess.run([sys.executable, "-c", "pass"]),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
        lambda: run_ranks(_noop, 2),
    ],
    ids=["fork", "subprocess", "mp-spawn", "mp-fork", "run_ranks"],
)
def test_a_unit_test_cannot_start_a_process(start):
    with pytest.raises(AssertionError, match="tests/unit forks nothing"):
        start()
