"""Scale events as data: one JSON object per line, beside the metrics.

The driver and rank 0 of each start append to the same file (one short write per line, O_APPEND). Every
object has `event` and `time` (seconds since the epoch) plus the writer's tags (phase, restart). The events of
one reconfiguration, in order:

    stop_requested (driver, time-based phases) -> stopping (rank 0: after the last step, with its end time)
    -> saved -> exited (driver: agents gone) -> launched (driver) -> rendezvous_done (each agent: its round
    closed, with when it began) -> processes_up (rank 0: process group formed, with the time its interpreter
    started) -> planned -> state_loaded (with the load's timings and the layout it was saved in) ->
    first_step_done (with that step's time) ... -> finished | stopping

and of a failure within a start: host_lost (driver: an agent exited with a failure, with the hosts left) ->
workers_restarting (each surviving agent, when it saw its workers fail, or a host join) -> rendezvous_done ->
processes_up -> ... as above. Agents write with writer=agent and their host. A world whose workers fail after
they handed the state over is restarted by its agents all the same: that start writes processes_up -> planned
-> already_handed_over (the step it gave the next world) and exits without training.

`elastic.report` turns them, with the metrics, into the phase table and the downtime of each event.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self, path: str | os.PathLike | None, enabled: bool = True, tags: dict | None = None):
        self.tags = dict(tags or {})
        self._fd: int | None = None
        if enabled and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields) -> dict:
        """Append one event (a no-op, returning the record, on ranks that do not write)."""
        record = {"event": event, "time": time.time(), **self.tags, **fields}
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every complete JSON line of a file (a line torn by a crash is skipped); [] if the file is missing."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
