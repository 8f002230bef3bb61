"""Progress lines on stdout and one JSON object per step in a metrics file (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def beside_metrics(metrics_file: str | None, name: str) -> Path:
    """The folder `name` beside the metrics file (the run folder under the launcher), else in this folder: where
    a run's TensorBoard files and profiler traces go by default."""
    return (Path(metrics_file).parent if metrics_file else Path()) / name


class MetricsLog:
    def __init__(
        self,
        path: str | None,
        enabled: bool,
        log_every: int = 1,
        total_steps: int | None = None,
        tags: dict | None = None,
        board=None,
    ):
        """`tags` (the launcher's phase, torchrun's restart count) are added to every record; `board`: a second
        writer of the same records (train/tensorboard.TensorBoardLog), given the record before the file is."""
        self.enabled = enabled
        self.tags = dict(tags or {})
        self.log_every = log_every
        self.total_steps = total_steps
        self.path = path if enabled else None
        self._file = None
        self._board = board if enabled else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._board is not None:  # first: its first step reads the record the previous start wrote last
            self._board.write({**record, **self.tags})
        if self._file is None and self.path:  # opened at the first step: a run that never steps leaves no file
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        if self._file is not None:
            self._file.write(json.dumps({**record, **self.tags}) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        step = record["step"]
        # a step with a validation loss is always printed: evaluations are rarer than log lines
        if step % self.log_every == 0 or step == self.total_steps or "val_loss" in record:
            of = f"/{self.total_steps}" if self.total_steps else ""
            val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
            memory = f" | peak {record['max_memory_gib']:.1f} GiB" if "max_memory_gib" in record else ""
            print(
                f"step {step}{of} | loss {record['loss']:.4f}{val} | lr {record['lr']:.2e} | "
                f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"{record['step_time_s']:.3f} s/step{memory}",
                file=sys.stdout,
                flush=True,
            )

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
        if self._file is not None:
            self._file.close()
            self._file = None
