"""Checkpoints through the command line, as users meet them: torchrun, SIGKILL of one worker, `--resume
auto` in another layout, `checkpoint inspect` and `checkpoint export-hf`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

STEPS = 12
TRAIN = [
    "train",
    "--model",
    "gpt-tiny",
    "--global-batch",
    "8",
    "--seq-len",
    "32",
    "--steps",
    str(STEPS),
    "--seed",
    "5",
    "--decay-steps",
    str(STEPS),
]
CLI = [sys.executable, "-m", "elastic_trainer.cli"]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    "-m",
    "elastic_trainer.cli",
]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory, data_cache, sotu_tokens):
    tmp = tmp_path_factory.mktemp("ckpt-cli")
    ckpt, m1, m2, ref = tmp / "ckpt", tmp / "m1.jsonl", tmp / "m2.jsonl", tmp / "ref.jsonl"
    common = ["--data-cache", data_cache]
    subprocess.run(
        CLI + TRAIN + common + ["--metrics-file", str(ref)], env=env(), check=True, capture_output=True, timeout=300
    )
    proc = subprocess.Popen(
        TORCHRUN
        + TRAIN
        + common
        + ["--layout", "2,1,1", "--checkpoint-dir", str(ckpt), "--save-every", "2", "--metrics-file", str(m1)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while len(records(m1)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = children(proc.pid)
    assert workers and proc.poll() is None, "the run ended before it could be killed"
    os.kill(workers[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    killed_at = len(records(m1))
    resumed = subprocess.run(
        TORCHRUN
        + TRAIN
        + common
        + ["--layout", "1,1,2", "--micro-batch", "4", "--checkpoint-dir", str(ckpt), "--metrics-file", str(m2)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return {
        "ckpt": ckpt,
        "ref": records(ref),
        "m2": records(m2),
        "killed_at": killed_at,
        "stdout": resumed.stdout,
        "tmp": tmp,
    }


@pytest.mark.slow
def test_killed_job_resumes_in_another_layout(crashed_and_resumed):
    r = crashed_and_resumed
    first = r["m2"][0]["step"]
    assert 3 <= first <= r["killed_at"] + 1 and first % 2 == 1  # right after a periodic checkpoint
    assert f"resumed step {first - 1} from" in r["stdout"] and "saved with dp=2 tp=1 pp=1" in r["stdout"]
    assert [x["step"] for x in r["m2"]] == list(range(first, STEPS + 1))
    for got in r["m2"]:
        want = r["ref"][got["step"] - 1]
        assert abs(got["loss"] - want["loss"]) / want["loss"] <= 1e-5
        assert got["samples"] == want["samples"]  # the data position continued exactly


@pytest.mark.slow
def test_inspect_reports_the_checkpoint(crashed_and_resumed):
    out = subprocess.run(
        CLI + ["checkpoint", "inspect", str(crashed_and_resumed["ckpt"])],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"step         {STEPS} ({STEPS * 8} samples consumed" in out.stdout
    assert "layout       dp=1 tp=1 pp=2 micro_batch=4 num_microbatches=2 (fsdp), 2 ranks" in out.stdout
    assert "model        52 tensors, 3,432,896 elements" in out.stdout
    assert "integrity    ok" in out.stdout
    js = json.loads(
        subprocess.run(
            CLI + ["checkpoint", "inspect", "--json", str(crashed_and_resumed["ckpt"])],
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    assert js["step"] == STEPS and js["layout"]["pp"] == 2


@pytest.mark.slow
def test_export_hf_loads_in_transformers(crashed_and_resumed):
    transformers = pytest.importorskip("transformers")
    from elastic_trainer.checkpoint.offline import load_model_weights, resolve
    from elastic_trainer.model import GPT

    out = crashed_and_resumed["tmp"] / "hf"
    run = subprocess.run(
        CLI + ["checkpoint", "export-hf", str(crashed_and_resumed["ckpt"]), str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    cfg, weights = load_model_weights(resolve(crashed_and_resumed["ckpt"])[0])
    ours = GPT(cfg).eval()
    ours.load_state_dict(weights)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-5


def test_bad_checkpoint_paths_are_one_line_errors(tmp_path):
    cases = (
        (["inspect", str(tmp_path / "nothing")], "does not exist"),
        (["export-hf", str(tmp_path), str(tmp_path / "o")], "holds no complete checkpoint"),
    )
    for argv, expected in cases:
        run = subprocess.run(CLI + ["checkpoint", *argv], env=env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 2
        assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written
