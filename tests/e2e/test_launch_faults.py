"""Faults of the elastic runtime as a cluster would produce them, each checked against a static single-process
run of the same steps (fp32, 1e-5 relative) with every global sample consumed once:
- the launcher SIGKILLed (the OOM killer) or hung up (its terminal closed) mid-run: its agents stop the ranks,
  which finish the step in flight and save it, whatever happened to the pipes the launcher read; `--resume`
  goes on from exactly that step, and nothing is left running;
- (the host of rank 0 lost on a two-host job: tests/e2e/test_launch.py::test_lost_host_then_back);
- rank 0 SIGKILLed inside a checkpoint's commit (between the data write and the rename, and between the rename
  and `latest`): the restart resumes the newest complete checkpoint, never the partial one.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_trainer.checkpoint import storage
from elastic_trainer.checkpoint.faults import FAULT_ENV
from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import effective
from tests.e2e.test_launch import (
    DEFAULT,
    assert_on_trajectory,
    descendants,
    env,
    launch_argv,
    metrics,
    processes,
    static_run,
    wait_for,
)

pytestmark = pytest.mark.slow
STEPS = 12


@pytest.fixture(scope="module")
def reference(sotu_tokens):
    return static_run(sotu_tokens, dataclasses.replace(DEFAULT.train, steps=STEPS), STEPS)


def gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]:
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_launcher_death_saves_the_step_in_flight(sig, tmp_path, data_cache, reference):
    """The launcher dies by `sig` once step 4 is recorded, its stdout pipe closed first (the terminal or the
    reader is gone too): the ranks finish the step in flight and save it (no periodic save is asked for), their
    output after that is in the host's log, and `--resume` trains the rest on the trajectory."""
    run_dir = tmp_path / "run"

    def argv(*extra: str) -> list[str]:
        return [
            *launch_argv(run_dir, "localhost slots=2\n", "--schedule", "none", *extra, cache=data_cache),
            "--steps",
            str(STEPS),
        ]

    # SIGHUP as a terminal sends it, even when this suite runs under nohup (which the launcher would inherit
    # and rightly take as "keep running")
    proc = subprocess.Popen(
        argv(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env(),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    try:
        wait_for(run_dir, proc, lambda r: r["step"] >= 4)
        tree = [proc.pid, *descendants(proc.pid)]
        proc.stdout.close()  # nobody reads the launcher, nor through it the agents and ranks
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == (-sig if sig == signal.SIGKILL else 0)
        assert gone(tree), [p for p in tree if Path(f"/proc/{p}").exists()]
    finally:
        proc.kill()
    trained = effective(metrics(run_dir))[-1]["step"]
    assert 4 <= trained < STEPS
    saved = storage.complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == [storage.step_dirname(trained)]  # the step in flight, nothing lost
    events = read_jsonl(run_dir / "events.jsonl")
    stopping = [e for e in events if e["event"] == "stopping"]
    assert len(stopping) == 1 and stopping[0]["reason"] == (
        "SIGTERM" if sig == signal.SIGKILL else f"stop file {run_dir / 'stop'}"
    )
    log = (run_dir / "hosts" / "localhost.log").read_text()
    assert f"[checkpoint] step {trained} saved to" in log and "BrokenPipeError" not in log
    if sig == signal.SIGHUP:  # the launcher itself lived on, wrote its log and said how to go on
        assert f"stopped at step {trained}; continue with --resume" in (run_dir / "launch.log").read_text()
    resumed = subprocess.run(argv("--resume"), capture_output=True, text=True, env=env(), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert_on_trajectory(run_dir, reference, STEPS)
    table = resumed.stdout[resumed.stdout.index("phases:") :].splitlines()
    assert [line.split()[:3] for line in table[2:4]] == [["1", "2", "dp2"], ["1", "(resumed)", "2"]]
    assert not processes(str(run_dir))


def test_kills_inside_the_commit_resume_the_newest_complete_checkpoint(tmp_path, data_cache, reference):
    """Rank 0 SIGKILLs itself twice in one job (ELASTIC_TRAINER_TEST_FAULT), each time torchrun restarts the
    ranks: in the commit of step 4 after the files and the manifest are written but before the rename, so step 4
    is still a temporary folder and the restart resumes step 2; in the commit of step 8 after the rename but
    before `latest` is replaced, so step 8 is complete (while `latest` still names step 6) and is resumed."""
    run_dir = tmp_path / "commit"
    argv = launch_argv(run_dir, "localhost slots=2\n", "--schedule", "none", cache=data_cache)
    faults = f"written:4:{tmp_path / 'written.fired'},renamed:8:{tmp_path / 'renamed.fired'}"
    proc = subprocess.run(
        [*argv, "--save-every", "2", "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env(), FAULT_ENV: faults},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    for point, step in (("written", 4), ("renamed", 8)):
        assert (tmp_path / f"{point}.fired").exists()
        assert f"killing this process at {point!r} in the commit of step {step}" in proc.stdout
    loads = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "state_loaded"]
    assert [(e["restart"], e["step"]) for e in loads] == [(0, 0), (1, 2), (2, 8)]
    assert_on_trajectory(run_dir, reference, STEPS)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["latest", "step-00000008", "step-00000010", "step-00000012"]  # --keep 3, no temporary left
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000012"
