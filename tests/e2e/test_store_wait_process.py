"""Long waits on a real TCP store served by another process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.solo  # a key seen within a poll of being set, timed

PROGRAM = textwrap.dedent("""
    import threading, time
    from torch.distributed import TCPStore
    from elastic_trainer.elastic.handover import Control
    from elastic_trainer.parallel import active

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    threading.Timer(1.6, lambda: server.set("elastic-trainer/job/w1/state", '{"record": 7}')).start()
    began = time.monotonic()
    got = Control(client, "job").wait("w1", "state")
    print("state", got, round(time.monotonic() - began, 2))
    threading.Timer(1.6, lambda: active.release(server, "s", 3, idle=0)).start()
    print("idle", active.wait_idle(client, "s", lambda: False))
    print("gave up", Control(client, "job").wait("w1", "never", give_up=lambda: time.monotonic() - began > 4))
""")


def test_long_waits_on_the_store_log_nothing_and_end_when_the_key_is_set():
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("state {'record': 7} ")
    assert 1.6 <= float(lines[0].split()[-1]) < 1.6 + 0.5  # seen within a poll of being set
    assert lines[1:] == ["idle 3", "gave up None"]
    assert "waitForInput" not in proc.stderr and "timed out" not in proc.stderr, proc.stderr[-2000:]
