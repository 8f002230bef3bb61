"""The loopback sshd helper: a real ssh round trip to 127.0.0.2, exit codes, and cleanup after exit."""

import os
import subprocess

import pytest

from tests.sshd import ensure_sshd, sshd


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ssh_round_trip_and_cleanup(tmp_path):
    reason = ensure_sshd()
    if reason:
        pytest.skip(reason)
    with sshd(str(tmp_path)) as s:
        pid = int(open(os.path.join(os.path.dirname(s.identity), "sshd.pid")).read())
        base = ["ssh", "-p", str(s.port), "-i", s.identity, *s.ssh_options(), s.host, "--"]

        r = subprocess.run([*base, "echo hello; echo oops >&2"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "hello\n" and "oops" in r.stderr  # streams come back separately

        assert subprocess.run([*base, "exit 7"], capture_output=True, timeout=30).returncode == 7

        # a key the server doesn't know is refused (ssh's own failure code is 255)
        bad = ["ssh", "-p", str(s.port), "-i", str(tmp_path / "no-such-key"), *s.ssh_options(), s.host, "true"]
        r = subprocess.run(bad, capture_output=True, text=True, timeout=30)
        assert r.returncode == 255 and "Permission denied" in r.stderr, r.stderr

        # a detached remote process outlives its ssh session; the context's cleanup must still kill it
        r = subprocess.run(
            [*base, "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=30
        )
        orphan = int(r.stdout)
        assert alive(pid) and alive(orphan)
    assert not alive(pid)
    assert not alive(orphan)
