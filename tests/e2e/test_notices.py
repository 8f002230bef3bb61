"""Hosts that leave or join while the job trains, heard of before it happens (launch/notices.py), as users run
them: the launcher, real torchrun agents, two or three hosts on one machine (127.0.0.x), each with its own
shared-memory folder. Every test compares the per-step losses with a static single-process run of the same
steps (fp32, 1e-5 relative), checks that every global sample was consumed once, and ends with no process of
the job and nothing in its shared-memory folder.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import effective
from tests.e2e.test_handover import (
    _wait_event,
    assert_nothing_left,
    assert_on_trajectory,
    durable_reads,
    events,
    job_env,
)
from tests.e2e.test_launch import DEFAULT, launch_argv, metrics, schedule, static_run

pytestmark = [pytest.mark.slow, pytest.mark.solo]  # re-forms timed against a running job's steps

STEPS = 150
"""Room for two re-forms before the schedule's end (the job is stopped two steps after the second): each
takes 4-6 s, which at 0.2 s per step (this machine on 2026-11-28, planned with its profile) is up to 30
steps."""


def start(
    tmp_path: Path, data_cache: str, hosts: str, *argv: str, steps: int = STEPS
) -> tuple[subprocess.Popen, Path, Path]:
    run_dir = tmp_path / "job"
    phases = schedule(tmp_path / "s.json", (4, steps))  # one phase of 4 ranks: only the hosts change it
    cmd = [*launch_argv(run_dir, hosts, "--schedule", phases, *argv, cache=data_cache), "--steps", str(steps)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(tmp_path), start_new_session=True
    )
    return proc, run_dir, run_dir.parent / "job-hosts.txt"


def wait_step(run_dir: Path, proc, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step for r in metrics(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)


def agent_of(run_dir: Path, proc, host: str) -> int:
    return _wait_event(run_dir, proc, lambda e: e["event"] == "rendezvous_done" and e.get("host") == host)["pid"]


def finish(proc) -> str:
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    return out


def test_a_host_leaves_on_notice_and_another_joins(tmp_path, data_cache, sotu_tokens):
    """2 + 2 ranks on 127.0.0.1 and 127.0.0.2. At step 3, 127.0.0.2's agent gets SIGTERM (a scheduler's
    notice): the launcher re-forms the job on 127.0.0.1 alone, in a world started beside the running one, which
    takes the state from memory (127.0.0.2's pieces from its server). Then 127.0.0.3 is added to the hosts
    file: the job re-forms on 127.0.0.1 + 127.0.0.3 the same way (two steps later the job is stopped). No
    durable checkpoint is read, and the noticed agent ends with exit code 0 after its ranks handed over."""
    proc, run_dir, hosts_file = start(tmp_path, data_cache, "127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    noticed = agent_of(run_dir, proc, "127.0.0.2")
    wait_step(run_dir, proc, 3)
    os.kill(noticed, signal.SIGTERM)
    _wait_event(run_dir, proc, lambda e: e["event"] == "handover_done")
    tmp = hosts_file.with_suffix(".new")
    tmp.write_text("127.0.0.1 slots=2\n127.0.0.3 slots=2\n")
    os.replace(tmp, hosts_file)
    first = events(run_dir, "handover_done")[0]
    joined = _wait_event(run_dir, proc, lambda e: e["event"] == "handover_done" and e["time"] > first["time"])
    wait_step(run_dir, proc, joined["step"] + 2)
    (run_dir / "stop").touch()  # the rest of the schedule would only train on
    out = finish(proc)
    trained = effective(metrics(run_dir))[-1]["step"]
    assert trained < STEPS
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=STEPS), trained)
    kept = assert_on_trajectory(run_dir, reference, DEFAULT.train.global_batch)
    sizes = [r["world_size"] for r in kept]
    changes = [sizes[i] for i in range(len(sizes)) if i == 0 or sizes[i] != sizes[i - 1]]
    assert changes == [4, 2, 4], changes
    done = events(run_dir, "handover_done")
    assert len(done) == 2 and all(e["handover"]["bytes_fetched"] > 0 for e in done), done
    # a host leaves: its durable checkpoint before the next world loads; a host joins: after that world's first step
    durable = events(run_dir, "durable_saved")
    assert [d["step"] for d in durable[:2]] == [e["step"] for e in done]
    assert durable[0]["time"] < done[0]["time"] and durable[1]["time"] > done[1]["time"]
    assert durable_reads(tmp_path) == 0
    changed = events(run_dir, "hosts_changed")
    assert ["gave notice" in changed[0]["why"], "127.0.0.3 joined the hosts file" in changed[1]["why"]] == [True] * 2
    assert [e["hosts"] for e in events(run_dir, "launched")] == [
        [["127.0.0.1", 2], ["127.0.0.2", 2]],
        [["127.0.0.1", 2]],
        [["127.0.0.1", 2], ["127.0.0.3", 2]],
    ]
    exits = [e for e in events(run_dir, "exited") if "127.0.0.2" in e["codes"]]
    assert exits == [exits[0]] and exits[0]["codes"]["127.0.0.2"] == 0, exits
    assert "127.0.0.2 gave notice" in out and "re-formed on 127.0.0.1:2" in out
    assert [line.split()[3:5] for line in out.splitlines() if line.startswith("1 (new hosts)")] == [
        ["2", "dp2"],
        ["4", "dp4"],
    ]
    assert_nothing_left(tmp_path, run_dir)


def test_without_warm_starts_a_host_removed_from_the_file_costs_a_restart(tmp_path, data_cache, sotu_tokens):
    """--no-warm-start: 127.0.0.2 is removed from the hosts file; the ranks save to the checkpoint folder and
    exit, and the phase starts again on 127.0.0.1 alone from there. No step is lost or trained twice."""
    proc, run_dir, hosts_file = start(
        tmp_path, data_cache, "127.0.0.1 slots=2\n127.0.0.2 slots=2\n", "--no-warm-start", steps=24
    )
    wait_step(run_dir, proc, 3)
    tmp = hosts_file.with_suffix(".new")
    tmp.write_text("127.0.0.1 slots=2\n")
    os.replace(tmp, hosts_file)
    restarted = _wait_event(run_dir, proc, lambda e: e["event"] == "first_step_done" and e["step"] > 3)
    wait_step(run_dir, proc, restarted["step"] + 1)
    (run_dir / "stop").touch()  # the rest of the schedule would only train on
    out = finish(proc)
    trained = effective(metrics(run_dir))[-1]["step"]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=24), trained)
    kept = assert_on_trajectory(run_dir, reference, DEFAULT.train.global_batch)
    assert kept[0]["world_size"] == 4 and kept[-1]["world_size"] == 2
    assert len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]) == trained  # none redone
    assert events(run_dir, "handover_done") == [] and durable_reads(tmp_path) == 2  # each new rank, once
    assert "127.0.0.2 left the hosts file" in out
    assert_nothing_left(tmp_path, run_dir)
