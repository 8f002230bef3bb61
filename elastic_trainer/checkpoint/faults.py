"""Tests only: a commit killed at a chosen point, to test that a crash there leaves a resumable folder.

`ELASTIC_TRAINER_TEST_FAULT=POINT:STEP:MARKER[,...]` SIGKILLs the committing process at POINT of the commit of
STEP, once: the MARKER file is created first, and while it exists nothing happens (a restarted job runs on).
POINT is `written` (every file and the manifest written, before the rename that commits), `renamed`
(committed, before `latest` is replaced) or `in_memory` (a rank's part of a hand-over's state written into
its host's memory, before the state is recorded: any rank may be the one that dies). Unset, `fault` does
nothing.
"""

from __future__ import annotations

import os
import signal

from elastic_trainer.config import ConfigError

FAULT_ENV = "ELASTIC_TRAINER_TEST_FAULT"
FAULT_POINTS = ("written", "renamed", "in_memory")


def fault(point: str, step: int) -> None:
    """Kill this process here if FAULT_ENV asks for `point` of the commit of `step` (and has not yet)."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        where, _, rest = spec.partition(":")
        at, _, marker = rest.partition(":")
        if where not in FAULT_POINTS or not at.isdigit() or not marker:
            raise ConfigError(
                f"{FAULT_ENV}: {spec!r} is not POINT:STEP:MARKER with POINT one of {', '.join(FAULT_POINTS)}"
            )
        if where != point or int(at) != step:
            continue
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        print(f"[checkpoint] {FAULT_ENV}: killing this process at {point!r} in the commit of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
