"""A host's output, kept whatever happens to the launcher that reads it.

An agent's standard output and error (and so its forked or spawned workers', which inherit them) are the
write end of a pipe that a thread of the agent reads. Every byte goes to the host's log file in the run
folder first, then, while anyone reads it, to the stream the agent was started with: the launcher's pipe, or
ssh's. When that reader is gone (the launcher was SIGKILLed, its terminal closed, ssh dropped) or stalls, the
ranks do not notice: their writes go into a pipe this process always drains, so a rank's progress line can
neither raise BrokenPipeError nor block the step. Bytes the reader could not take are only in the log.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from pathlib import Path

LOG_ENV = "ELASTIC_TRAINER_HOST_LOG"
"""The log file of this host's agent and ranks (set by the launcher per host; appended to)."""
CHUNK = 1 << 16
BACKLOG = 256
"""Chunks held for a reader that is slower than the ranks write; beyond that they are only in the log."""


class Relay:
    def __init__(self, log_path: str | os.PathLike | None):
        self._log = None
        self.log_error: str | None = None
        if log_path:
            try:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                self._log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                self.log_error = f"cannot write the host log {log_path} ({e.strerror or e})"
        self._out = os.dup(1)  # the reader's end: the launcher's pipe, ssh's, or a terminal
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._queue: queue.Queue[bytes | None] = queue.Queue(BACKLOG)
        self.reader_gone = False
        self._pump = threading.Thread(target=self._drain, name="relay-drain", daemon=True)
        self._forward = threading.Thread(target=self._send, name="relay-send", daemon=True)
        self._pump.start()
        self._forward.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._read, CHUNK)
            except InterruptedError:
                continue
            if not chunk:
                break
            if self._log is not None:
                try:
                    os.write(self._log, chunk)
                except OSError:
                    pass  # a full or vanished disk: the reader still gets it
            if not self.reader_gone:
                try:
                    self._queue.put_nowait(chunk)
                except queue.Full:
                    pass  # a reader this far behind gets what follows; the log has it all
        self._queue.put(None)

    def _send(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self.reader_gone:
                continue
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self._out, view) :]
            except OSError:  # EPIPE (reader gone) or EIO (a hung-up terminal)
                self.reader_gone = True

    def close(self, timeout: float = 5.0) -> None:
        """End the relay: this process's stdout and stderr go to /dev/null, what is in the pipe is written out
        (waiting at most `timeout` for a slow reader)."""
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        self._pump.join(timeout)
        self._forward.join(timeout)
        if self._log is not None:
            os.close(self._log)


def whole_lines() -> None:
    """This process's sys.stdout and sys.stderr write each line with one write(2), however Python buffers
    (PYTHONUNBUFFERED writes a print's text and its newline apart): ranks sharing a host's pipe then never
    split each other's lines (a pipe keeps writes of up to 4 KiB whole)."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if old is None:
            continue
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=True,
        )
        setattr(sys, name, stream)


def start_relay() -> Relay | None:
    """The relay of this process when the launcher asked for one (LOG_ENV set), else None."""
    path = os.environ.get(LOG_ENV)
    return Relay(path) if path else None
