"""TensorBoard event files of a run (`--tensorboard [DIR]`), written by rank 0 beside the metrics file.

One run is one set of curves, however often its world changed: every start (a reconfiguration, a torchrun
restart, `--resume`) appends its own event file to the same folder and opens it with `purge_step` at its first
step, so that TensorBoard drops whatever an earlier start wrote from that step on (the steps a restart trains
again appear once, with the values of the trajectory that went on). Scalars per step: train/loss,
train/learning_rate, train/grad_norm, train/tokens_per_s, train/step_time_s, val/loss (when evaluated),
elastic/world_size; at each start's first step elastic/downtime_s (from the end of the last step recorded
before it) and the layout as text (elastic/layout).

Needs the `tensorboard` package (`pip install 'elastic-trainer[tensorboard]'`); `missing()` says so in one line
before anything starts.
"""

from __future__ import annotations

import json
import os

from elastic_trainer.train.metrics import beside_metrics

SCALARS = (
    ("train/loss", "loss"),
    ("train/learning_rate", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("train/tokens_per_s", "tokens_per_s"),
    ("train/step_time_s", "step_time_s"),
    ("val/loss", "val_loss"),
    ("elastic/world_size", "world_size"),
)
FLUSH_S = 10
"""Seconds between flushes of the event file (and at the end of every start)."""


def missing() -> str | None:
    """The one-line error when the `tensorboard` package cannot be imported, else None."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return (
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'elastic-trainer[tensorboard]' (or pip install tensorboard)"
        )
    return None


def default_dir(metrics_file: str | None) -> str:
    """`--tensorboard` without a folder: `tensorboard/` beside the metrics file (the run folder under the
    launcher), else under the current folder."""
    return str(beside_metrics(metrics_file, "tensorboard"))


def last_record(metrics_file: str | None) -> dict | None:
    """The last complete record of the metrics file (what the previous start wrote last), or None."""
    if not metrics_file or not os.path.exists(metrics_file):
        return None
    with open(metrics_file, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # a torn last line, or the tail of one cut by the seek
            continue
    return None


class TensorBoardLog:
    """Rank 0's writer: opened at this start's first step (`purge_step`: that step), closed at its end."""

    def __init__(self, log_dir: str, metrics_file: str | None):
        self.log_dir, self.metrics_file = log_dir, metrics_file
        self._writer = None

    def write(self, record: dict) -> None:
        """One step's scalars; called before the record is appended to the metrics file (the first call reads
        the record the previous start wrote last)."""
        step = record["step"]
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            before = last_record(self.metrics_file)
            self._writer = SummaryWriter(self.log_dir, purge_step=step, flush_secs=FLUSH_S)
            self._start(record, before)
        for tag, key in SCALARS:
            if record.get(key) is not None:
                self._writer.add_scalar(tag, record[key], step, walltime=record.get("time"))

    def _start(self, record: dict, before: dict | None) -> None:
        step, layout = record["step"], record.get("layout") or {}
        what = " ".join(f"{k}{layout[k]}" for k in ("dp", "tp", "pp") if k in layout)
        self._writer.add_text(
            "elastic/layout",
            f"{record.get('world_size')} ranks: {what}, micro-batch "
            f"{layout.get('micro_batch')} x {layout.get('num_microbatches')}, "
            f"{layout.get('dp_mode')}",
            step,
        )
        if before is not None and "time" in before and "time" in record:
            began = record["time"] - record.get("step_time_s", 0.0)
            self._writer.add_scalar("elastic/downtime_s", max(0.0, began - before["time"]), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
