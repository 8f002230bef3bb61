"""Divergence is bad input: a NaN injected into one rank's loss mid-run stops the job with one line naming the
step (exit 2, no traceback, no restart), nothing is saved for that step, and the newest checkpoint, the last
good step, loads and continues on the trajectory of a run that never saw the NaN.

The NaN comes from a sitecustomize hook every process of the job imports (the agent's forked workers inherit
it): it multiplies the loss of rank ET_TEST_NAN_RANK by NaN in step ET_TEST_NAN_AT_STEP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "elastic_trainer.cli"]
STEPS = 6
TRAIN = [
    "train",
    "--model",
    "gpt-tiny",
    "--global-batch",
    "4",
    "--seq-len",
    "32",
    "--steps",
    str(STEPS),
    "--seed",
    "3",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
]
pytestmark = pytest.mark.slow

NAN_HOOK = r"""
import os

if os.environ.get("ET_TEST_NAN_AT_STEP"):
    import elastic_trainer.parallel.engine as engine
    import elastic_trainer.train.loop as loop

    at, current = int(os.environ["ET_TEST_NAN_AT_STEP"]), [0]
    train_step, loss_fn = loop.Trainer.train_step, engine.Engine.loss_fn

    def counted(self):
        current[0] = self.step + 1
        return train_step(self)

    def poisoned(self, logits, targets):
        loss = loss_fn(self, logits, targets)
        if current[0] == at and os.environ.get("RANK", "0") == os.environ.get("ET_TEST_NAN_RANK", "0"):
            loss = loss * float("nan")
        return loss

    loop.Trainer.train_step, engine.Engine.loss_fn = counted, poisoned
"""


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def base_env() -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )


def nan_env(tmp_path: Path, step: int, rank: int) -> dict:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(NAN_HOOK)
    env = base_env()
    return dict(
        env,
        ET_TEST_NAN_AT_STEP=str(step),
        ET_TEST_NAN_RANK=str(rank),
        PYTHONPATH=os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p),
    )


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache, sotu_tokens) -> list[float]:
    """Losses of the same run without a NaN, on one process."""
    out = tmp_path_factory.mktemp("nan-reference") / "metrics.jsonl"
    run = subprocess.run(
        CLI + TRAIN + ["--data-cache", data_cache, "--metrics-file", str(out)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return [r["loss"] for r in records(out)]


def test_nan_under_torchrun_stops_in_one_line_and_the_last_good_step_resumes(tmp_path, data_cache, reference):
    ckpt, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    common = ["--data-cache", data_cache, "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics)]
    run = subprocess.run(
        CLI
        + [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            *TRAIN,
            "--layout",
            "2,1,1",
            "--save-every",
            "1",
            *common,
        ],
        env=nan_env(tmp_path, step=4, rank=1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    shown = f"exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert run.returncode == 2, shown
    errors = [line for line in run.stderr.splitlines() if line.startswith("elastic-trainer: error:")]
    assert len(errors) == 1 and "training diverged at step 4: loss nan" in errors[0], shown
    assert "the newest checkpoint is still step 3" in errors[0], shown
    assert "Traceback" not in run.stdout + run.stderr and "ChildFailedError" not in run.stderr, shown
    assert run.stdout.count("step 1/6") == 1, shown  # not restarted
    # nothing of step 4 was saved or logged; steps 1-3 match the run that never saw a NaN
    assert checkpoints(ckpt) == ["step-00000001", "step-00000002", "step-00000003"]
    assert [r["step"] for r in records(metrics)] == [1, 2, 3]
    assert [r["loss"] for r in records(metrics)] == pytest.approx(reference[:3], rel=1e-5)
    # the newest checkpoint loads (in another layout) and continues on the reference trajectory
    resumed = subprocess.run(CLI + TRAIN + common, env=base_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[checkpoint] resumed step 3 from" in resumed.stdout
    kept = records(metrics)
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in kept] == pytest.approx(reference, rel=1e-5)


def test_nan_under_launch_puts_the_line_on_top(tmp_path, data_cache, reference):
    """Through `launch` (what ./run.sh runs): the driver stops every host, does not restart the phase, and
    ends with the rank's line and the newest checkpoint; exit 2."""
    hosts, run_dir = tmp_path / "hosts.txt", tmp_path / "run"
    hosts.write_text("localhost slots=2\n")
    argv = CLI + [
        "launch",
        "--hosts",
        str(hosts),
        "--run-dir",
        str(run_dir),
        "--model",
        "gpt-tiny",
        "--schedule",
        "none",
        "--rdzv-conf",
        "last_call_timeout=2",
        "--",
        *TRAIN[3:],
        "--save-every",
        "2",
        "--data-cache",
        data_cache,
    ]
    run = subprocess.run(argv, env=nan_env(tmp_path, step=3, rank=0), capture_output=True, text=True, timeout=300)
    shown = f"exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert run.returncode == 2, shown
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic-trainer: error: training diverged at step 3: loss nan"), shown
    assert "newest checkpoint: step 2" in last, shown
    assert "Traceback" not in run.stderr, shown
    assert checkpoints(run_dir / "checkpoints") == ["step-00000002"]
    kept = records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in kept] == [1, 2]
    assert [r["loss"] for r in kept] == pytest.approx(reference[:2], rel=1e-5)
