"""Stop requests: SIGTERM or a stop file asks the job to finish its current step, save and exit.

Every rank polls its local flag after each step and the flags are combined with one all-reduce, so all
ranks stop after the same step even when only one of them got the signal.
"""

from __future__ import annotations

import os
import signal


class StopRequest:
    def __init__(self, stop_file: str | None = None, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.stop_file = stop_file
        self.reason: str | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame) -> None:
        self.reason = signal.Signals(signum).name

    def local(self) -> bool:
        """Whether this rank has been asked to stop."""
        if self.reason is None and self.stop_file and os.path.exists(self.stop_file):
            self.reason = f"stop file {self.stop_file}"
        return self.reason is not None

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
