"""The launcher's own output: every agent's lines, prefixed with the host, to stdout and the launch log."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from elastic_trainer.elastic.exit_codes import ERROR_MARK


class Output:
    """Prefixed lines from every agent to stdout and the launch log, one line at a time."""

    def __init__(self, path: Path):
        self._lock = threading.Lock()
        self._log = open(path, "a", buffering=1)
        self.errors: list[str] = []
        """The ranks' one-line errors (without the mark), each once, in order of arrival."""
        self.terminal_gone = False
        """Standard output failed (a closed terminal or a reader that went away): the log goes on alone."""

    def line(self, text: str) -> None:
        with self._lock:
            self._log.write(text + "\n")
            if self.terminal_gone:
                return
            try:
                print(text, flush=True)
            except OSError:  # EIO from a hung-up terminal, EPIPE from a dead pipe reader
                self.terminal_gone = True
                sys.stdout = open(os.devnull, "w")  # nothing left for the interpreter to flush at exit

    def log_only(self, lines: list[str]) -> None:
        """Lines already printed (before the log existed) into the log."""
        with self._lock:
            for text in lines:
                self._log.write(text + "\n")

    def pump(self, host: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode(errors="replace").rstrip()
            if ERROR_MARK in text:
                error = text.split(ERROR_MARK, 1)[1]
                with self._lock:
                    if error not in self.errors:
                        self.errors.append(error)
            self.line(f"[{host}] {text}")
        stream.close()

    def close(self) -> None:
        self._log.close()
