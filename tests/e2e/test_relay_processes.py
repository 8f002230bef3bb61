"""The output relay between real processes: a reader that vanishes or stops reading blocks no writer; a live reader
gets everything."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from elastic_trainer.launch.relay import LOG_ENV

# A process that relays its output, then writes LINES lines from itself and from a forked child (a worker).
WRITER = textwrap.dedent("""
    import os, sys
    from elastic_trainer.launch.relay import start_relay, whole_lines

    relay = start_relay()
    print("ready", flush=True)
    sys.stdin.readline()  # the test closes (or stops reading) its end of our stdout meanwhile
    lines = int(sys.argv[1])
    pid = os.fork()
    whole_lines()  # as a forked rank does: under PYTHONUNBUFFERED a print would be two writes
    for i in range(lines):
        print(f"{'child' if pid == 0 else 'parent'} line {i} " + "x" * 200, flush=True)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    os.write(2, b"stderr line\\n")
    sys.stdout.flush()
    relay.close(timeout=2.0)
    os._exit(0)
""")


def start_writer(log, lines: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(lines)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, LOG_ENV: str(log), "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout.readline() == b"ready\n"
    return proc


def logged(log) -> list[str]:
    return log.read_text().splitlines()


def test_a_vanished_reader_neither_kills_nor_blocks_the_writers(tmp_path):
    log = tmp_path / "hosts" / "h.log"  # its folder is made
    proc = start_writer(log, 2000)
    proc.stdout.close()  # the launcher is gone
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    lines = logged(log)
    assert lines[0] == "ready" and lines[-1] == "stderr line"
    assert sum(line.startswith("parent line") for line in lines) == 2000
    assert sum(line.startswith("child line") for line in lines) == 2000


def test_a_reader_that_stops_reading_does_not_block_the_writers(tmp_path):
    """64 KiB of pipe and 256 chunks of backlog are far less than the 9 MB written: without the relay the writers
    would block forever on a reader that stopped (a stalled ssh, a terminal's scroll lock)."""
    log = tmp_path / "h.log"
    proc = start_writer(log, 20000)
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0  # never read from its stdout
    assert sum(line.startswith(("parent line", "child line")) for line in logged(log)) == 40000
    proc.stdout.close()


def test_a_live_reader_gets_everything(tmp_path):
    log = tmp_path / "h.log"
    proc = start_writer(log, 300)
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    out = proc.stdout.read().decode().splitlines()
    assert proc.wait(timeout=60) == 0
    assert sorted(out) == sorted(logged(log)[1:]) and len(out) == 601


def test_an_unwritable_log_leaves_the_output_to_the_reader(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from elastic_trainer.launch.relay import start_relay; "
            "r = start_relay(); print(r.log_error, flush=True); r.close()",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, LOG_ENV: str(blocker / "h.log")},
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(f"cannot write the host log {blocker / 'h.log'}")
