"""The allocator's restart of a process (a real re-exec): its heap serves large buffers; a bad switch is one line,
exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_trainer.launch import allocator

PROBE = """
import os, sys
from elastic_trainer.launch.allocator import restart_keeping_freed_memory
restart_keeping_freed_memory()
def mappings():  # the heap's own line grows in place: only other mappings count
    with open("/proc/self/maps") as f:
        return {line.split()[0] for line in f if not line.rstrip().endswith("[heap]")}
before = mappings()
buffer = bytearray(256 << 20)
new = []
for span in mappings() - before:
    start, end = (int(x, 16) for x in span.split("-"))
    new.append(end - start)
print(os.environ.get("MALLOC_MMAP_MAX_"), int(any(size >= 256 << 20 for size in new)))
"""


def probe(env: dict[str, str]) -> tuple[str, bool]:
    """(MALLOC_MMAP_MAX_ as the process ended up with it, whether a 256 MB buffer got a mapping of its own)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != allocator.SWITCH_ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[0], out[1] == "1"


@pytest.mark.skipif(any(os.path.exists(p) for p in allocator.GPU_DEVICES), reason="a GPU host: nothing restarts")
def test_the_restarted_process_serves_a_large_buffer_from_its_heap():
    """The process starts itself again with the variables; glibc then grows the heap for a 256 MB buffer instead
    of mapping it anew (what it does without them, and with the switch off)."""
    assert probe({}) == ("0", False)
    assert probe({allocator.SWITCH_ENV: "system"}) == ("None", True)


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--model", "gpt-tiny", "--metrics-file", "m.jsonl"],
        ["launch", "--hosts", "hosts.txt", "--run-dir", "run"],
    ],
)
def test_a_bad_switch_is_one_line_and_exit_code_2(tmp_path, command):
    """Checked where the command starts (the launcher too, before its agents), before anything is written."""
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n")
    env = {**os.environ, allocator.SWITCH_ENV: "System"}
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"elastic-trainer: error: {allocator.SWITCH_ENV}='System' is not valid (valid: keep, system)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts.txt"]
