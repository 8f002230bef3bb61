"""Progress lines on stdout and one JSON object per step in a metrics file (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class MetricsLog:
    def __init__(self, path: str | None, enabled: bool, log_every: int = 1, total_steps: int | None = None,
                 tags: dict | None = None, tensorboard: str | None = None):
        """`tags` (the launcher's phase, torchrun's restart count) are added to every record; `tensorboard`: a
        folder for TensorBoard event files of the same records (train/tensorboard.py)."""
        self.enabled = enabled
        self.tags = dict(tags or {})
        self.log_every = log_every
        self.total_steps = total_steps
        self.path = path if enabled else None
        self._file = None
        self._board = None
        if enabled and tensorboard:
            from elastic_trainer.train.tensorboard import TensorBoardLog

            self._board = TensorBoardLog(tensorboard, self.path)

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
            print(f"step {step}{of} | loss {record['loss']:.4f}{val} | lr {record['lr']:.2e} | "
                  f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                  f"{record['step_time_s']:.3f} s/step", file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
        if self._file is not None:
            self._file.close()
            self._file = None
