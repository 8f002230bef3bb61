"""The job under a real Slurm (brought up by the test: tests/slurm.py, two emulated nodes, each its own slurmd
on this machine), through launch/slurm/train.sbatch exactly as a user submits it:
- 2 nodes x 2 ranks (one agent per node through srun, each with 2 CPUs; gloo): 4 ranks train on the
  single-process trajectory (1e-5 relative);
- `scontrol requeue` mid-run: the job comes back under the same id and resumes from the newest complete
  checkpoint;
- the job is cancelled and submitted again on 1 node x 2 ranks (a smaller allocation, as after a
  preemption): it re-plans for 2 ranks, reshards the 4-rank checkpoint and stays on the trajectory, every
  sample once;
- the time-limit warning (`--signal=B:USR1@...`, delivered here with `scancel --batch --signal=USR1`) makes
  the ranks save and the job end with code 3 (stopped after saving), its last step checkpointed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from elastic_trainer.checkpoint import storage
from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.exit_codes import EXIT_STOPPED
from elastic_trainer.elastic.report import effective, samples_consumed_once
from tests.e2e.test_launch import DEFAULT, processes, static_run
from tests.slurm import ensure_slurm, slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "slurm" / "train.sbatch"
STEPS = 400  # the run's length (the schedule's); the test stops it long before
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = ensure_slurm()
    if why:
        pytest.skip(why)
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip(f"{ROOT}/.venv is missing (the sbatch script runs the project's own environment)")
    # not under pytest's temporary root: it is private to root, and munged runs as the munge user
    folder = Path(tempfile.mkdtemp(prefix="et-slurm-"))
    try:
        with slurm_cluster(folder, nodes=("et-n1", "et-n2")) as c:
            yield c
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def submit(cluster, run_dir: Path, nodes: int, cpus: int, cache: str, log: Path) -> str:
    train = [
        "--model",
        DEFAULT.model.name,
        "--seed",
        str(DEFAULT.train.seed),
        "--global-batch",
        str(DEFAULT.train.global_batch),
        "--seq-len",
        str(DEFAULT.train.seq_len),
        "--lr",
        str(DEFAULT.train.lr),
        "--warmup-steps",
        str(DEFAULT.train.warmup_steps),
        "--steps",
        str(STEPS),
        "--save-every",
        "3",
        "--keep",
        "0",
        "--data-cache",
        cache,
    ]
    env = cluster.env(ET_ROOT=str(ROOT), ET_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    out = cluster.run(
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        f"--cpus-per-task={cpus}",
        f"--output={log}",
        "--job-name=et-test",
        str(SCRIPT),
        *train,
        env=env,
    )
    return out.stdout.strip().split(";")[0]


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def wait_until(check, what: str, cluster, job: str, log: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            state = cluster.job(job)
            raise AssertionError(
                f"timed out waiting for {what}; job {job}: {state.get('JobState')} "
                f"{state.get('Reason')}\n{log.read_text()[-4000:] if log.exists() else ''}\n"
                f"{cluster.log('slurmd')[-2000:]}"
            )
        time.sleep(0.2)


def step_reached(run_dir: Path, step: int, since: int = 0):
    return lambda: any(r["step"] >= step for r in metrics(run_dir)[since:])


def newest_checkpoint(folder: Path) -> int:
    found = storage.complete_checkpoints(folder)
    return int(found[0].name.split("-")[1]) if found else 0


def test_slurm_job_requeued_resubmitted_smaller_and_stopped_at_the_time_limit(
    cluster, tmp_path, data_cache, sotu_tokens
):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    log_a, log_b = tmp_path / "job-a.out", tmp_path / "job-b.out"
    try:
        # -- 2 nodes x 2 ranks; requeued mid-run --------------------------------------------------------------
        job_a = submit(cluster, run_dir, 2, 2, data_cache, log_a)
        wait_until(step_reached(run_dir, 7), "job A's step 7", cluster, job_a, log_a)
        text_a = log_a.read_text()
        assert "on 2 node(s) x 2 rank(s): et-n[1-2], rendezvous 127.0.0.1:" in text_a  # NodeAddr of et-n1
        assert [r["world_size"] for r in metrics(run_dir)][:7] == [4] * 7
        cluster.run("scontrol", "requeue", job_a)
        before = len(metrics(run_dir))
        wait_until(
            lambda: cluster.job(job_a).get("Restarts") == "1" and cluster.job(job_a).get("JobState") == "RUNNING",
            "job A to run again",
            cluster,
            job_a,
            log_a,
        )
        loads = lambda: [e for e in events(run_dir, "state_loaded") if e["load"]]  # noqa: E731
        wait_until(lambda: loads(), "job A to resume", cluster, job_a, log_a)
        resumed = loads()[0]
        (stop,) = events(run_dir, "stopping")  # written by rank 0 when the ranks agreed to stop
        last_before = stop["step"]
        # Slurm's SIGTERM reached the ranks, which saved the step they ended on; the job resumed from it
        assert resumed["step"] == last_before and stop["reason"] == "SIGTERM", (resumed, stop)
        assert f"[train] stopped after step {last_before} (SIGTERM)" in log_a.read_text()
        assert (
            resumed["load"]["saved_layout"]["dp"]
            * resumed["load"]["saved_layout"]["tp"]
            * resumed["load"]["saved_layout"]["pp"]
            == 4
        )
        wait_until(
            step_reached(run_dir, resumed["step"] + 4, since=before),
            "job A's steps after the requeue",
            cluster,
            job_a,
            log_a,
        )

        # -- cancelled, then submitted again on 1 node x 2 ranks ----------------------------------------------
        cluster.run("scancel", job_a)
        wait_until(
            lambda: (
                cluster.job(job_a).get("JobState") in ("CANCELLED", "COMPLETED", "FAILED", None)
                and not processes(str(checkpoints))
            ),
            "job A to end",
            cluster,
            job_a,
            log_a,
            timeout=120,
        )
        a_last = newest_checkpoint(checkpoints)
        before_b = len(metrics(run_dir))
        job_b = submit(cluster, run_dir, 1, 2, data_cache, log_b)
        wait_until(step_reached(run_dir, a_last + 5, since=before_b), "job B's steps", cluster, job_b, log_b)
        b_loads = [e for e in events(run_dir, "state_loaded") if e["load"]]
        b_resumed = b_loads[-1]
        assert b_resumed["step"] == a_last  # the newest complete checkpoint job A left
        saved = b_resumed["load"]["saved_layout"]
        assert saved["dp"] * saved["tp"] * saved["pp"] == 4  # resharded from 4 ranks ...
        b_records = metrics(run_dir)[before_b:]
        assert {r["world_size"] for r in b_records} == {2}  # ... into a plan for 2

        # -- the time-limit warning: save, exit 3 --------------------------------------------------------------
        cluster.run("scancel", "--batch", "--signal=USR1", job_b)
        wait_until(
            lambda: cluster.job(job_b).get("JobState") in ("COMPLETED", "FAILED"),
            "job B to stop",
            cluster,
            job_b,
            log_b,
            timeout=180,
        )
        state = cluster.job(job_b)
        assert state["ExitCode"] == f"{EXIT_STOPPED}:0", (state, log_b.read_text()[-3000:])
        assert state["JobState"] == "FAILED"  # Slurm's word for a non-zero exit; the code says "stopped"
        last_step = max(r["step"] for r in metrics(run_dir))
        assert newest_checkpoint(checkpoints) == last_step  # the stop saved the step it ended on
        text_b = log_b.read_text()
        assert "time limit near (USR1)" in text_b and f"[train] stopped after step {last_step} (SIGTERM)" in text_b
        assert "[agent] stopped by SIGTERM" in text_b and "Traceback" not in text_b

        # -- one trajectory throughout -----------------------------------------------------------------------
        kept = effective(metrics(run_dir))
        assert [r["step"] for r in kept] == list(range(1, last_step + 1))
        train = dataclasses.replace(DEFAULT.train, steps=STEPS)
        reference = static_run(sotu_tokens, train, last_step)
        for r in kept:
            assert abs(r["loss"] - reference[r["step"] - 1]) / reference[r["step"] - 1] <= 1e-5, r
        assert samples_consumed_once(kept) and kept[0]["samples"][0] == 0
        assert {r["world_size"] for r in kept} == {4, 2}
    finally:
        for pid in processes(str(checkpoints)):  # nothing of the job may outlive the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
