"""The elastic runtime as users run it: `./run.sh` / `elastic-trainer launch` on a hosts file, real torchrun
agents, real process groups. Every test compares the per-step losses with a static single-process run of the
same steps (fp32, 1e-5 relative) and checks from the metrics that every global sample was consumed once:
- the default job (4 -> 8 -> 2 -> 4 ranks) through ./run.sh, every event through the warm start and the
  hand-over in memory;
- two hosts on one machine (127.0.0.1 and 127.0.0.2), the agent of rank 0's host SIGKILLed mid-run: the
  other host re-plans for 2 ranks and resumes from the snapshot in memory of the last step done (or the one
  before), rank 0's files from its own copy; then the host comes back and
  the job grows to 4 again (torchrun SIGTERMs the workers, they save, all re-plan);
- time-based phases (the launcher's stop file); a crashing rank naming itself in the launch log;
- any GPU count runs: 8 -> 5 -> 7 -> 3 GPUs where 5 and 7 leave one idle, every layout the dry run's, every
  event a warm start with the state handed over in memory (no rank reads the checkpoint folder);
- hosts of different sizes (3 + 2) train as one job with one plan, tp inside a host, one GPU idle; then the
  2-slot host freezes (SIGSTOP), is cut off after 10 s without a heartbeat, and the survivors re-plan and
  resume from the snapshot in memory (127.0.0.2's files from 127.0.0.1's copy);
- the second host reached through a real sshd, both agents' output in the driver's log; the launcher
  SIGKILLed: both hosts save the step in flight, and a resumed launch finishes on the trajectory;
- a crash of the whole job, then `launch --resume`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint.storage import complete_checkpoints, step_dirname
from elastic_trainer.config import configs_dir, load_run_config
from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import effective, samples_consumed_once
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import run_job
from tests.sshd import ensure_sshd, sshd

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = load_run_config(configs_dir() / "runs" / "default.toml")
pytestmark = pytest.mark.slow


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def launch_argv(run_dir: Path, hosts: str, *argv: str, cache: str) -> list[str]:
    hosts_file = run_dir.parent / f"{run_dir.name}-hosts.txt"
    hosts_file.write_text(hosts)
    return [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "launch",
        "--hosts",
        str(hosts_file),
        "--run-dir",
        str(run_dir),
        "--rdzv-conf",
        "last_call_timeout=2",
        *argv,
        "--",
        "--data-cache",
        cache,
    ]


def schedule(path: Path, *phases: tuple[int, int]) -> str:
    path.write_text(json.dumps([{"gpus": g, "steps": s} for g, s in phases]))
    return str(path)


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def assert_on_trajectory(run_dir: Path, reference: list[float], steps: int) -> list[dict]:
    """Effective steps 1..steps, each loss within 1e-5 of the static run, samples [0, steps*B) once."""
    kept = effective(metrics(run_dir))
    assert [r["step"] for r in kept] == list(range(1, steps + 1))
    for r in kept:
        assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
    assert samples_consumed_once(kept) and kept[0]["samples"][0] == 0
    assert kept[-1]["samples"][1] == steps * DEFAULT.train.global_batch
    return kept


def processes(marker: str, *more: str) -> list[int]:
    """PIDs whose command line contains `marker` and each of `more` (each NUL-separated arguments). Tests that
    may run beside others name their run folder among them, so that only their own job's processes match."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().decode(errors="replace")
                if all(m in line for m in (marker, *more)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def agent_of(host: str, run_dir: Path) -> int:
    """The agent started for `host` by the job of `run_dir` (its forked workers share its command line; they are
    its children)."""
    found = processes("elastic_trainer.launch.agent\0", f"--local-addr\0{host}\0", str(run_dir))
    agents = [p for p in found if parent(p) not in found]
    assert len(agents) == 1, found
    return agents[0]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in metrics(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)


def test_default_job_through_run_sh(tmp_path, data_cache, reference):
    run_dir = tmp_path / "default"
    counts = tmp_path / "counts.txt"
    proc = subprocess.run(
        [str(ROOT / "run.sh"), "--run-dir", str(run_dir), "--", "--data-cache", data_cache, "--tensorboard"],
        capture_output=True,
        text=True,
        env=dict(env(), ELASTIC_TRAINER_TEST_COUNTS=str(counts)),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    seen = [line.split()[0] for line in counts.read_text().splitlines()]
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "processes_up"]
    assert seen.count("parse_train_flags") == 1  # the train flags, by the launcher only
    # the launcher's plan per phase; rank 0 took the first three and planned the fourth again, with the step
    # time the job measured in the first on the same 4 ranks (plan/measured.py)
    assert seen.count("plan") == 5 and len(starts) == 4
    planned = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "planned"]
    assert [e["source"] for e in planned] == ["spec", "spec", "spec", "planned"]
    assert planned[3]["reason"] == "with the step times and memory this job measured on these hosts"
    assert [r["hosts"] for r in read_jsonl(run_dir / "measured.jsonl")] == [[4], [8], [2], [4]]
    assert seen.count("read_spec") == 4 + 8 + 2 + 4  # job.json, once per rank start
    kept = assert_on_trajectory(run_dir, reference, 32)
    assert len(metrics(run_dir)) == 32  # nothing redone
    assert [r["world_size"] for r in kept] == [4] * 8 + [8] * 8 + [2] * 8 + [4] * 8
    loads = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "state_loaded"]
    saved_worlds = [
        None if e["load"] is None else Layout.from_dict(e["load"]["saved_layout"]).world_size for e in loads
    ]
    assert saved_worlds == [None, 4, 8, 2]  # each start resharded the previous phase's state
    # through the warm path: each next world started beside the current one and read the state from memory
    assert [e["load"]["path"].startswith("memory:") for e in loads[1:]] == [True] * 3
    assert seen.count("read_checkpoint") == 0
    table = proc.stdout[proc.stdout.index("phases:") :]
    assert [line.split()[:2] for line in table.splitlines()[2:6]] == [["1", "4"], ["2", "8"], ["3", "2"], ["4", "4"]]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard (`--tensorboard`: RUN_DIR/tensorboard), read with its own reader: one curve through 3 events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    losses = board.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 33))  # every step once
    assert all(abs(e.value - r["loss"]) <= 1e-6 * r["loss"] for e, r in zip(losses, kept))
    assert [e.value for e in board.Scalars("elastic/world_size")] == [4] * 8 + [8] * 8 + [2] * 8 + [4] * 8
    assert [e.step for e in board.Scalars("elastic/downtime_s")] == [9, 17, 25]
    assert [e.step for e in board.Scalars("train/learning_rate")] == list(range(1, 33))
    again = subprocess.run(
        [str(ROOT / "run.sh"), "--run-dir", str(run_dir), "--resume"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert again.returncode == 0 and "nothing to train: the newest checkpoint is step 32 of 32" in again.stdout


def static_run(tokens, train, until: int) -> list[float]:
    """Steps 1..until of `train` in one plain process, layout 1,1,1."""

    def job(rank, world):
        layout = Layout(1, 1, 1, train.global_batch, 1)
        records = run_job(DEFAULT.model, train, layout, torch.device("cpu"), tokens=tokens, until=until).records
        return [r["loss"] for r in records]

    return run_ranks(job, 1)[0]


def wait_for(run_dir: Path, proc: subprocess.Popen, what, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(what(r) for r in metrics(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_lost_host_then_back(tmp_path, data_cache, sotu_tokens):
    """127.0.0.1 and 127.0.0.2 (2 ranks each) form one job, ranks 0-1 on 127.0.0.1. Its agent is SIGKILLed:
    the rendezvous is the launcher's, so it stays up; 127.0.0.2 re-forms the job alone, re-planned for 2 ranks,
    from the snapshot in memory (`--memory-snapshot-every 1`: 127.0.0.1's files from 127.0.0.2's copy), at
    most one step back. Then the host comes back (its agent restarted by hand with the same
    command, which the launcher does not know of): torchrun stops the workers (SIGTERM: they save), and all
    re-plan for 4 and resume from that save. Every step on the single-process trajectory; every sample once."""
    run_dir = tmp_path / "lost"
    argv = launch_argv(run_dir, "127.0.0.1 slots=2\n127.0.0.2 slots=2\n", "--schedule", "none", cache=data_cache)
    proc = subprocess.Popen(
        [*argv, "--save-every", "2", "--memory-snapshot-every", "1", "--steps", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env(), ELASTIC_TRAINER_SHM_DIR=str(tmp_path / "shm")),  # the lost host's snapshots stay there
    )
    joiner = None
    try:
        wait_for(run_dir, proc, lambda r: r["step"] >= 5)
        assert "(host 0): ranks 0-1 of 4" in (run_dir / "hosts" / "127.0.0.1.log").read_text()
        agent = agent_of("127.0.0.1", run_dir)
        command = Path(f"/proc/{agent}/cmdline").read_bytes().decode().split("\0")[:-1]
        environ = dict(
            kv.split("=", 1) for kv in Path(f"/proc/{agent}/environ").read_bytes().decode().split("\0") if "=" in kv
        )
        killed = time.time()
        os.kill(agent, signal.SIGKILL)  # the host is gone: its workers die with their agent
        wait_for(run_dir, proc, lambda r: r["world_size"] == 2)
        alone = [e for e in read_jsonl(run_dir / "events.jsonl") if e["time"] >= killed]
        joiner = subprocess.Popen(
            command,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.PIPE,
            start_new_session=True,
        )  # the host is back
        back = time.time()
        wait_for(run_dir, proc, lambda r: r["world_size"] == 4 and r["time"] > back)
        (run_dir / "stop").touch()
        out, _ = proc.communicate(timeout=300)
        assert joiner.wait(timeout=120) == 0
    finally:
        proc.kill()
        if joiner is not None:
            joiner.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "agent on 127.0.0.1: killed by SIGKILL: the other hosts go on without it" in out
    assert "agent on 127.0.0.1: killed by SIGKILL; the job went on without them" in out and "stopped at step" in out
    assert [e["host"] for e in alone if e["event"] == "host_lost"] == ["127.0.0.1"]
    assert {e["host"] for e in alone if e["event"] in ("workers_restarting", "rendezvous_done")} == {"127.0.0.2"}
    planned = [e for e in alone if e["event"] == "planned"]
    assert [(e["hosts"], Layout.from_dict(e["layout"]).world_size) for e in planned] == [([2], 2)]
    kept = effective(metrics(run_dir))
    steps = kept[-1]["step"]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=400), steps)
    for r in kept:
        assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
    assert [r["step"] for r in kept] == list(range(1, steps + 1)) and samples_consumed_once(kept)
    events = read_jsonl(run_dir / "events.jsonl")
    loads = [e for e in events if e["event"] == "state_loaded"][1:]  # the two restarts
    assert [Layout.from_dict(e["load"]["saved_layout"]).world_size for e in loads] == [4, 2]
    lost_at, back_at = loads[0]["step"], loads[1]["step"]
    # the snapshot in memory of the last step done, or of the one before when the loss came while it was copied:
    # 127.0.0.1's files from 127.0.0.2's copy
    done = max(r["step"] for r in metrics(run_dir) if r["world_size"] == 4 and r["time"] < killed)
    assert done - 1 <= lost_at <= done and loads[0]["load"]["path"].startswith("memory:"), (done, loads[0])
    sigterm = [e for e in events if e["event"] == "stopping" and e["reason"] == "SIGTERM"]
    assert sigterm and sigterm[-1]["step"] == back_at  # the joiner's restart lost no step
    # rank 0 (whose records these are) moved to 127.0.0.2 and back to the new agent of 127.0.0.1, whose own
    # restart count starts at 0 again
    assert [w for w, _ in itertools.groupby(r["world_size"] for r in kept)] == [4, 2, 4]
    assert [k for k, _ in itertools.groupby(r.get("restart") for r in kept)] == [0, 1, 0]
    assert not processes("--local-addr\x00127.0.0.1\x00", str(run_dir))


def dry_run_plans(argv: list[str]) -> list[str]:
    """The `[plan] ...` line of each phase a dry run of `argv` prints."""
    out = subprocess.run(
        [*argv[: argv.index("--")], "--dry-run", *argv[argv.index("--") :]],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [line.split("[plan] ", 1)[1] for line in out.stdout.splitlines() if "[plan] " in line]


def test_any_gpu_count_runs_as_the_dry_run_said(tmp_path, data_cache, sotu_tokens):
    """8 -> 5 -> 7 -> 3 GPUs, gpt-tiny with global batch 12: no layout fits 5 or 7 GPUs, so those phases train
    on 4 and 6 with one GPU idle, saying so, on the single-process trajectory; every event through the warm
    start and the hand-over in memory. The launcher runs on this CPU
    machine, the job names h100-80g: each phase's layout is the dry run's, which the ranks take from job.json
    (no rank plans), and the flags are parsed once, by the launcher."""
    run_dir = tmp_path / "counts"
    counts = tmp_path / "counts.txt"
    argv = launch_argv(
        run_dir,
        "localhost slots=8\n",
        "--schedule",
        # 3 steps a phase: a next world is launched after the first step of the world that took the last
        # hand-over, so with 2 steps the launcher had one step (~0.8 s) to start it, and under load missed it
        schedule(tmp_path / "s.json", (8, 3), (5, 3), (7, 3), (3, 3)),
        cache=data_cache,
    )
    argv += ["--global-batch", "12", "--steps", "12", "--hardware", "h100-80g"]
    said = dry_run_plans(argv)
    shm = tmp_path / "shm"
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(env(), ELASTIC_TRAINER_TEST_COUNTS=str(counts), ELASTIC_TRAINER_SHM_DIR=str(shm)),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    spec = json.loads((run_dir / "job.json").read_text())
    assert spec["hardware"]["name"] == "h100-80g" and spec["built_by"] == "launch"
    planned = sorted(
        (e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "planned"), key=lambda e: e["phase"]
    )  # a next world plans while the current one trains
    assert [e["source"] for e in planned] == ["spec"] * 4
    assert [(e["held"], e["idle"]) for e in planned] == [(8, 0), (5, 1), (7, 1), (3, 0)]
    assert [e["layout"] for e in planned] == [p["layout"] for p in spec["phases"]]
    for line, event in zip(said, planned):
        assert Layout.from_dict(event["layout"]).describe() in line, (line, event)
    assert "1 idle: no layout of 5 GPUs is valid" in said[1] and "1 idle: no layout of 7 GPUs is valid" in said[2]
    assert proc.stdout.count("1 of the 5 GPUs idle") == 1 and proc.stdout.count("1 of the 7 GPUs idle") == 1
    kept = effective(metrics(run_dir))
    assert [r["world_size"] for r in kept] == [8, 8, 8, 4, 4, 4, 6, 6, 6, 3, 3, 3]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, global_batch=12, steps=12), 12)
    for r in kept:
        assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
    assert samples_consumed_once(kept) and kept[-1]["samples"][1] == 12 * 12
    seen = [line.split()[0] for line in counts.read_text().splitlines()]
    assert seen.count("parse_train_flags") == 1  # by the launcher
    assert seen.count("plan") == 4  # the launcher's own, per phase; no rank planned
    assert seen.count("read_spec") == 8 + 5 + 7 + 3  # once per rank start
    # each next world was started beside the current one and took its state from memory: no rank read the
    # checkpoint folder, which was written meanwhile, and nothing is left in shared memory
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["warm"] for e in events if e["event"] == "launched"] == [False, True, True, True]
    assert [e["step"] for e in events if e["event"] == "handover_done"] == [3, 6, 9]
    assert seen.count("read_checkpoint") == 0
    assert sorted(e["step"] for e in events if e["event"] == "durable_saved") == [3, 6, 9]
    assert proc.stdout.count("memory: save") == 3 and not (shm.exists() and any(shm.iterdir()))


def test_uneven_hosts_leave_a_gpu_idle_then_one_freezes(tmp_path, data_cache, sotu_tokens):
    """Hosts of 3 and 2 slots (5 ranks), global batch 12: one plan for both hosts (tp inside a host) on 4 ranks,
    one idle, taken from job.json. Then the 2-slot host freezes (its agent and workers SIGSTOPped: no process
    exits, its connections stay open): the launcher cuts it off after 10 s without its heartbeat, the survivors'
    blocked workers are restarted, re-plan for the hosts they really have (saying why) and resume from the
    snapshot in memory (127.0.0.2's files from 127.0.0.1's copy), at most one step back, on the trajectory.
    Woken up later, the frozen host has nothing left to do anything."""
    run_dir = tmp_path / "uneven"
    argv = launch_argv(run_dir, "127.0.0.1 slots=3\n127.0.0.2 slots=2\n", "--schedule", "none", cache=data_cache)
    proc = subprocess.Popen(
        [*argv, "--memory-snapshot-every", "1", "--steps", "400", "--global-batch", "12", "--hardware", "h100-80g"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env(), ELASTIC_TRAINER_SHM_DIR=str(tmp_path / "shm")),  # the frozen host's snapshots stay there
    )
    frozen = None
    try:
        wait_for(run_dir, proc, lambda r: r["step"] >= 3)
        frozen = agent_of("127.0.0.2", run_dir)
        group = [p for p in processes("--local-addr\x00127.0.0.2\x00", str(run_dir)) if os.getpgid(p) == frozen]
        os.killpg(frozen, signal.SIGSTOP)
        lost = time.time()
        wait_for(run_dir, proc, lambda r: r["world_size"] == 3 and r["time"] > lost)
        (run_dir / "stop").touch()
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(frozen, signal.SIGCONT)
    assert proc.returncode == 0, out[-4000:]
    assert len(group) > 1  # its workers share the agent's process group: all stopped
    assert not processes("--local-addr\x00127.0.0.2\x00", str(run_dir))
    events = read_jsonl(run_dir / "events.jsonl")
    (cut,) = [e for e in events if e["event"] == "host_lost"]
    assert (cut["host"], cut["reason"], cut["hosts_left"]) == ("127.0.0.2", "frozen", 1)
    assert 10.0 <= cut["silent_s"] < 12.0 and "agent on 127.0.0.2: no heartbeat for " in out
    after = [e for e in events if e["time"] >= cut["time"]]
    assert [e["host"] for e in after if e["event"] == "workers_restarting"] == ["127.0.0.1"]
    planned = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "planned"]
    first, last = planned[0], planned[-1]
    assert sorted(first["hosts"]) == [2, 3] and first["source"] == "spec" and (first["held"], first["idle"]) == (5, 1)
    assert first["layout"]["tp"] == 1 and "1 of the 5 GPUs idle" in out
    assert last["hosts"] == [3] and last["source"] == "planned" and last["idle"] == 0
    assert last["reason"] == "planned for 3+2 per host, got 3 per host"
    kept = effective(metrics(run_dir))
    steps = kept[-1]["step"]
    reference = static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, global_batch=12, steps=400), steps)
    for r in kept:
        assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
    assert [r["step"] for r in kept] == list(range(1, steps + 1)) and samples_consumed_once(kept)
    assert [w for w, _ in itertools.groupby(r["world_size"] for r in kept)] == [4, 3]
    # from the snapshot in memory of the last step done before the cut (or the one before, if the freeze came
    # while it was copied): 127.0.0.2's files from 127.0.0.1's copy, no durable checkpoint
    (resumed,) = [e for e in events if e["event"] == "state_loaded" and e["time"] > cut["time"]]
    done = max(r["step"] for r in metrics(run_dir) if r["time"] < lost)
    assert resumed["load"]["path"].startswith("memory:") and done - 1 <= resumed["step"] <= done, (done, resumed)


def test_second_host_through_ssh_saves_when_the_launcher_dies(tmp_path, data_cache, reference):
    """The second host is reached through a real sshd. Once step 3 is recorded the launcher is SIGKILLed, its
    stdout closed first: the local agent gets SIGTERM from the kernel, the remote one from remote.sh when ssh's
    connection ends; all ranks finish the step in flight and save it; both hosts' logs go on without the
    launcher, nothing is left running, and a resumed launch through ssh finishes the phase on the trajectory."""
    reason = ensure_sshd()
    if reason:
        pytest.skip(reason)
    with sshd(str(tmp_path / "sshd")) as server:
        run_dir = tmp_path / "ssh"
        ssh = [
            "--force-ssh",
            server.host,
            "--ssh-port",
            str(server.port),
            "--ssh-identity",
            server.identity,
            "--ssh-config",
            "/dev/null",
            "--ssh-option",
            f"UserKnownHostsFile={server.known_hosts}",
            "--ssh-option",
            "StrictHostKeyChecking=yes",
            "--ssh-option",
            "IdentityAgent=none",
        ]

        def argv(*extra: str) -> list[str]:
            return launch_argv(
                run_dir,
                f"127.0.0.1 slots=2\n{server.host} slots=2\n",
                "--schedule",
                schedule(tmp_path / "s.json", (4, 12)),
                *ssh,
                *extra,
                cache=data_cache,
            )

        proc = subprocess.Popen(
            argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(), start_new_session=True
        )
        try:
            wait_for_step(run_dir, proc, 3)
            log = (run_dir / "launch.log").read_text()
            assert "[127.0.0.1] [ranks] " in log and f"[{server.host}] [ranks] " in log  # both hosts, pumped
            proc.stdout.close()
            proc.kill()
            proc.wait(timeout=30)
            deadline = time.monotonic() + 120
            while processes("--local-addr\x00", str(run_dir)):
                assert time.monotonic() < deadline, "the job's processes outlived the launcher"
                time.sleep(0.2)
        finally:
            proc.kill()
        trained = effective(metrics(run_dir))[-1]["step"]
        assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [step_dirname(trained)]
        remote_log = (run_dir / "hosts" / f"{server.host}.log").read_text()
        assert "[agent] stopped by SIGTERM" in remote_log and "BrokenPipeError" not in remote_log
        resumed = subprocess.run(argv("--resume"), capture_output=True, text=True, env=env(), timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
        assert f"{server.host} (ssh)" not in resumed.stdout  # a real run, not a dry run
        assert_on_trajectory(run_dir, reference, 12)
        assert not processes(f"--local-addr\x00{server.host}\x00", str(run_dir))


def test_crash_then_resume(tmp_path, data_cache, reference):
    run_dir = tmp_path / "crash"
    hosts, phases = "localhost slots=4\n", schedule(tmp_path / "s.json", (2, 10), (4, 22))

    def argv(*extra: str) -> list[str]:
        return [*launch_argv(run_dir, hosts, "--schedule", phases, *extra, cache=data_cache), "--save-every", "2"]

    proc = subprocess.Popen(
        argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), start_new_session=True
    )
    try:
        wait_for_step(run_dir, proc, 13)
        tree = [proc.pid, *descendants(proc.pid)]
        for pid in tree:  # everything at once: the machine went down
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    time.sleep(0.5)
    assert not set(tree) & set(processes("elastic_trainer"))
    before = effective(metrics(run_dir))[-1]["step"]
    resumed = subprocess.run(argv("--resume"), capture_output=True, text=True, env=env(), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert "phase 2/2: 4 GPUs" in resumed.stdout and "phase 1/2" not in resumed.stdout
    kept = assert_on_trajectory(run_dir, reference, 32)
    assert before >= 13 and {r["world_size"] for r in kept if r["step"] > 10} == {4}
    # the crash is a segment boundary of its own, with its downtime and the steps trained twice
    rows = [
        [c.strip() for c in line.split("  ") if c.strip()]
        for line in resumed.stdout[resumed.stdout.index("phases:") :].splitlines()[2:]
        if line[:1].isdigit()
    ]
    resumed_at = next(r["step"] for r in kept if r["step"] > 10 and r["start"] != kept[10]["start"])
    assert [r[:2] for r in rows] == [["1", "2"], ["2", "4"], ["2 (resumed)", "4"]]
    assert rows[2][3] == f"{resumed_at}-32" and float(rows[2][5]) > 0 and rows[2][7] == str(before - resumed_at + 1)


PACE_HOOK = """
import os
if os.environ.get("ET_TEST_STEP_AT_LEAST_S"):
    import time
    import elastic_trainer.train.loop as loop

    least, step = float(os.environ["ET_TEST_STEP_AT_LEAST_S"]), loop.Trainer.train_step

    def train_step(self):
        began = time.monotonic()
        out = step(self)
        time.sleep(max(0.0, least - (time.monotonic() - began)))
        return out

    loop.Trainer.train_step = train_step
"""


@pytest.mark.solo  # duration_s phases: both must train on the wall clock
def test_timed_phases_stop_on_request(tmp_path, data_cache, reference):
    """duration_s phases: the next phase's world starts beside the current one; when the phase's time is up
    the launcher asks the ranks (through its store) to stop after their step, they hand their state over in
    memory, and the next phase trains on in its own size."""
    run_dir = tmp_path / "timed"
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps([{"gpus": 2, "duration_s": 7}, {"gpus": 4, "duration_s": 7}]))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PACE_HOOK)
    # paced: at 0.13 s a step the 2-rank phase alone reached the job's last step in its 7 s, leaving the 4-rank
    # phase nothing to train; at >= 0.3 s the 32 steps outlast the first phase on any machine that starts in 7 s
    paced = {
        **env(),
        "ET_TEST_STEP_AT_LEAST_S": "0.3",
        "PYTHONPATH": os.pathsep.join([str(hook), env().get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        launch_argv(run_dir, "localhost slots=4\n", "--schedule", str(timed), cache=data_cache),
        capture_output=True,
        text=True,
        env=paced,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    kept = effective(metrics(run_dir))
    steps = kept[-1]["step"]
    assert_on_trajectory(run_dir, reference, steps)
    worlds = [r["world_size"] for r in kept]
    assert worlds[0] == 2 and worlds[-1] == 4 and worlds == sorted(worlds)  # both phases trained
    events = read_jsonl(run_dir / "events.jsonl")
    requested = [e for e in events if e["event"] == "stop_requested"]
    assert requested and requested[0]["phase"] == 0 and requested[0]["reason"] == "phase end"
    stopped = [e for e in events if e["event"] == "stopping"]
    assert stopped[0]["reason"] == "the phase's time is up" and stopped[0]["time"] >= requested[0]["time"]
    assert [e["step"] for e in events if e["event"] == "handover_done"] == [stopped[0]["step"]]
    if steps < 32:
        assert f"the schedule ended at step {steps} of 32" in proc.stdout


CRASH_HOOK = """
import os
if os.environ.get("ET_TEST_CRASH_AT_STEP"):
    import elastic_trainer.train.loop as loop

    crash_at, step = int(os.environ["ET_TEST_CRASH_AT_STEP"]), loop.Trainer.train_step

    def train_step(self):
        if self.step + 1 == crash_at:
            raise ValueError(f"injected crash in step {crash_at}")
        return step(self)

    loop.Trainer.train_step = train_step
"""


def test_failing_rank_names_itself_in_the_launch_log(tmp_path, data_cache, sotu_tokens):
    """A rank that crashes (a bug, not bad input: here a ValueError injected into step 2 through a
    sitecustomize module every process of the job imports) is reported by torchrun's error recording with its
    host, rank and traceback in the launcher's log; the launcher exits 1 and says what to do."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK)
    run_dir = tmp_path / "failing"
    argv = launch_argv(run_dir, "localhost slots=2\n", "--schedule", "none", "--max-restarts", "0", cache=data_cache)
    crash_env = {
        **env(),
        "ET_TEST_CRASH_AT_STEP": "2",
        "PYTHONPATH": os.pathsep.join([str(hook), env().get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(argv, capture_output=True, text=True, env=crash_env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    log = (run_dir / "launch.log").read_text()
    assert "Root Cause (first observed failure)" in log and "[localhost]   host      : localhost" in log
    assert "[localhost]   rank      : " in log and "ValueError: injected crash in step 2" in log
    assert "phase 1 failed on every host (agent on localhost: exit code 1)" in proc.stdout


@pytest.mark.parametrize(
    "line, message",
    [
        ("a slots=0\n", "hosts.txt:1: slots='0' must be positive"),
        ("a; touch {marker}\n", "hosts.txt:1: 'a;' is not a valid hostname or IP address"),
        ("$(touch {marker}) slots=2\n", "hosts.txt:1: '$(touch' is not a valid hostname or IP address"),
    ],
)
def test_run_sh_refuses_a_bad_hosts_file_in_one_line(tmp_path, line, message):
    marker = tmp_path / "pwned"
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(line.format(marker=marker))
    proc = subprocess.run(
        [str(ROOT / "run.sh"), "--hosts", str(hosts), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()
