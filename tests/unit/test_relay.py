"""The agent's output relay (launch/relay.py) and the launcher's own output (driver.Output), when whoever reads
them goes away or stops reading: writers never fail nor block, the log keeps every byte."""

from __future__ import annotations

import os
import signal
import sys

from elastic_trainer.launch.driver import Driver
from elastic_trainer.launch.output import Output


def test_the_launcher_output_survives_a_closed_terminal(tmp_path, monkeypatch):
    read, write = os.pipe()
    os.close(read)  # the terminal is gone: every write fails with EPIPE
    monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w"))
    out = Output(tmp_path / "launch.log")
    out.line("first")
    out.pump("h", _Lines([b"from a rank\n"]))
    out.close()
    assert out.terminal_gone and (tmp_path / "launch.log").read_text() == "first\n[h] from a rank\n"


class _Lines:
    def __init__(self, lines):
        self._lines = list(lines)

    def readline(self):
        return self._lines.pop(0) if self._lines else b""

    def close(self):
        pass


def test_a_hang_up_stops_the_job_unless_nohup_ignores_it():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in Driver._stop_signals()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert set(Driver._stop_signals()) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_hang_up_never_aborts_the_save():
    driver = Driver.__new__(Driver)
    driver._interrupts = 0
    driver._on_signal(signal.SIGHUP, None)
    driver._on_signal(signal.SIGHUP, None)
    assert driver._interrupts == 1  # a stop with a save, however many hang-ups
    driver._on_signal(signal.SIGINT, None)
    assert driver._interrupts == 2  # Ctrl-C after it: abort
