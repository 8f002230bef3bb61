"""Counting hook for tests: with ELASTIC_TRAINER_TEST_COUNTS=FILE set, `count(what)` appends "what pid" to FILE
(one write(2) per line, O_APPEND, so the ranks and the launcher of one job can share it). Counted: the train
flags parsed (`parse_train_flags`), the job spec read by a rank (`read_spec`), a plan made for a start
(`plan`), a durable checkpoint read by a rank (`read_checkpoint`). Unset: nothing happens."""

from __future__ import annotations

import os

COUNTS_ENV = "ELASTIC_TRAINER_TEST_COUNTS"


def count(what: str) -> None:
    path = os.environ.get(COUNTS_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{what} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
