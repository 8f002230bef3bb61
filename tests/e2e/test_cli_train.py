"""`elastic-trainer train` as users run it: one plain process, and 4 ranks under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["train", "--model", "gpt-tiny", "--global-batch", "8", "--seq-len", "32", "--steps", "4", "--seed", "3"]


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def run(cmd: list[str], cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache, sotu_tokens):
    out = tmp_path_factory.mktemp("single") / "metrics.jsonl"
    script = Path(sys.executable).parent / "elastic-trainer"
    proc = run([str(script), *ARGS, "--metrics-file", str(out), "--data-cache", data_cache], data_cache)
    return out, proc


def test_single_process_writes_progress_and_metrics(single):
    out, proc = single
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(records[0])
    assert "step 4/4 | loss" in proc.stdout
    assert proc.stdout.startswith("[plan] 1 x cpu (1 per host): dp=1 tp=1 pp=1")  # planned, no --layout given


@pytest.mark.slow
def test_torchrun_four_ranks_matches_single_process(single, tmp_path, data_cache):
    out = tmp_path / "metrics.jsonl"
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "elastic_trainer.cli",
            *ARGS,
            "--layout",
            "2,1,2",
            "--micro-batch",
            "2",
            "--metrics-file",
            str(out),
            "--data-cache",
            data_cache,
        ],
        data_cache,
    )
    ref = losses(single[0])
    got = losses(out)
    assert len(got) == len(ref) == 4
    for a, b in zip(got, ref):
        assert abs(a - b) / b <= 1e-5
