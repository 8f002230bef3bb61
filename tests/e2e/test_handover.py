"""Planned reconfigurations through a warm start and an in-memory hand-over, as users run them (the launcher,
real torchrun agents): every test compares the per-step losses with a static single-process run of the same
steps (fp32, 1e-5 relative), checks from the metrics that every global sample was consumed once, and ends
with no process of the job and nothing in its shared-memory folder (ELASTIC_TRAINER_SHM_DIR, one per test):
- (an odd-count schedule through the warm path, 8 -> 5 -> 7 -> 3 ranks with global batch 12 and idle ranks:
  tests/e2e/test_launch.py::test_any_gpu_count_runs_as_the_dry_run_said);
- two hosts on one machine (127.0.0.1, 127.0.0.2), each with its own shared-memory folder: 2 + 2 -> 2 + 0 ->
  2 + 2 ranks moves every piece of the leaving host to the other (from the stopping world's server) and back;
  no rank reads a durable checkpoint, and each hand-over fetched bytes from the other host; the first world
  (started cold) writes its state as DCP plans it then, the second (warm) as it planned while waiting, into
  files it allocated once the next world was started;
- one job through three faults: a rank of the waiting world SIGKILLed (its agent restarts it; it waits
  again), a stopping rank SIGKILLed inside its write to memory (its world restarts from the durable checkpoint,
  trains again and hands over), the launcher SIGKILLed while the next world waits; `--resume` finishes.
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
from elastic_trainer.elastic.report import effective, samples_consumed_once
from tests.e2e.test_launch import DEFAULT, descendants, env, launch_argv, metrics, processes, schedule, static_run
from tests.e2e.test_launch_faults import gone

pytestmark = pytest.mark.slow


def job_env(tmp_path: Path, **extra: str) -> dict:
    return dict(
        env(),
        ELASTIC_TRAINER_SHM_DIR=str(tmp_path / "shm"),
        ELASTIC_TRAINER_TEST_COUNTS=str(tmp_path / "counts.txt"),
        **extra,
    )


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def assert_on_trajectory(run_dir: Path, reference: list[float], batch: int) -> list[dict]:
    kept = effective(metrics(run_dir))
    assert [r["step"] for r in kept] == list(range(1, len(reference) + 1))
    for r in kept:
        assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
    assert samples_consumed_once(kept) and kept[0]["samples"][0] == 0 and kept[-1]["samples"][1] == len(kept) * batch
    return kept


def job_processes(run_dir: Path) -> list[int]:
    """Processes of the job: agents and workers name its spec (under run_dir) in their arguments, agents
    started ahead of their world its hosts' log folder in their environment."""
    found = set(processes(str(run_dir)))
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(run_dir).encode() in (entry / "environ").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def assert_nothing_left(tmp_path: Path, run_dir: Path) -> None:
    """No process of the job and no in-memory state."""
    assert gone(job_processes(run_dir)), job_processes(run_dir)
    shm = tmp_path / "shm"
    assert not shm.exists() or not any(shm.iterdir()), sorted(str(p) for p in shm.rglob("*"))


def durable_reads(tmp_path: Path) -> int:
    counts = tmp_path / "counts.txt"
    return (
        [line.split()[0] for line in counts.read_text().splitlines()].count("read_checkpoint") if counts.exists() else 0
    )


def test_hand_over_between_two_hosts(tmp_path, data_cache, sotu_tokens):
    """127.0.0.2 leaves (2 + 2 -> 2 + 0 ranks) and comes back: its ranks' pieces reach 127.0.0.1 from the
    stopping world's server on 127.0.0.2, then the new ranks of 127.0.0.2 fetch theirs from 127.0.0.1."""
    run_dir = tmp_path / "two"
    argv = launch_argv(
        run_dir,
        "127.0.0.1 slots=2\n127.0.0.2 slots=2\n",
        "--schedule",
        schedule(tmp_path / "s.json", (4, 3), (2, 3), (4, 3)),
        cache=data_cache,
    )
    proc = subprocess.run([*argv, "--steps", "9"], capture_output=True, text=True, env=job_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=9), 9)
    kept = assert_on_trajectory(run_dir, reference, DEFAULT.train.global_batch)
    assert [r["world_size"] for r in kept] == [4] * 3 + [2] * 3 + [4] * 3
    done = events(run_dir, "handover_done")
    assert [e["step"] for e in done] == [3, 6]
    assert all(e["handover"]["bytes_fetched"] > 0 for e in done), done  # pieces crossed between the hosts
    # the first world started cold: DCP planned its write on the spot; the second, warm, had planned it ahead
    in_memory = [e["save"] for e in events(run_dir, "saved") if e["save"].get("where") == "memory"]
    assert [s["planned"] for s in in_memory] == [False, True]
    # the warm world's files were allocated once the launcher had started the next world (checkpoint/spare.py)
    assert in_memory[0]["allocated_ahead"] is None and in_memory[1]["allocated_ahead"]["bytes"] > 0, in_memory
    assert durable_reads(tmp_path) == 0
    assert_nothing_left(tmp_path, run_dir)


def _world_workers(run_dir: Path, phase: int) -> list[int]:
    """The workers of phase `phase`'s agent (an agent started ahead of its world shows `--parked` as its
    command line: its events name its pid)."""
    agents = {e["pid"] for e in events(run_dir, "rendezvous_done") if e.get("phase") == phase}
    assert len(agents) == 1, agents
    return descendants(agents.pop())


def _wait_event(run_dir: Path, proc, what, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        hit = next((e for e in read_jsonl(run_dir / "events.jsonl") if what(e)), None)
        if hit is not None:
            return hit
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)


def test_faults_around_a_hand_over(tmp_path, data_cache, sotu_tokens):
    """Phases of 4, 2, 4 and 2 ranks, 12, 6, 6 and 6 steps. (1) Once phase 2's world waits, one of its
    workers is SIGKILLed: its agent restarts the workers, which wait again and take the state. (2) The first
    rank to reach the end of its write to memory at step 18 is SIGKILLed: its world restarts from the durable
    checkpoint of step 12, trains steps 13-18 again and hands over. (3) Once phase 4's world waits, the
    launcher is SIGKILLed: the agents stop their ranks, phase 3's save the step in flight to disk. `--resume`
    trains the rest."""
    run_dir = tmp_path / "faults"
    phases = schedule(tmp_path / "s.json", (4, 12), (2, 6), (4, 6), (2, 6))

    def argv(*extra: str) -> list[str]:
        return [
            *launch_argv(run_dir, "localhost slots=4\n", "--schedule", phases, *extra, cache=data_cache),
            "--steps",
            "30",
        ]

    fault = f"in_memory:18:{tmp_path / 'fired'}"
    proc = subprocess.Popen(
        argv(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(tmp_path, ELASTIC_TRAINER_TEST_FAULT=fault),
        start_new_session=True,
    )
    try:
        _wait_event(run_dir, proc, lambda e: e["event"] == "next_world_ready" and e.get("phase") == 1)
        waiting = _world_workers(run_dir, 1)
        os.kill(waiting[-1], signal.SIGKILL)
        _wait_event(run_dir, proc, lambda e: e["event"] == "next_world_ready" and e.get("phase") == 3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert gone(processes(str(run_dir)))
    assert (tmp_path / "fired").exists()
    restarts = events(run_dir, "workers_restarting")
    assert [e["phase"] for e in restarts] == [1, 1], restarts  # phase 2's world waiting, then stopping
    resumed = subprocess.run(argv("--resume"), capture_output=True, text=True, env=job_env(tmp_path), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=30), 30)
    assert_on_trajectory(run_dir, reference, DEFAULT.train.global_batch)
    assert [e["step"] for e in events(run_dir, "handover_done")][:2] == [12, 18]
    assert_nothing_left(tmp_path, run_dir)
