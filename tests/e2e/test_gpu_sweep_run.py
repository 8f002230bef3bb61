"""benchmarks/gpu/sweep.py run as a program: its cases in one process, each written."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_gpu_sweep import ROOT


def test_the_sweep_runs_its_cases_in_one_process_and_writes_each(tmp_path):
    out = tmp_path / "sweep.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/gpu/sweep.py"),
            "--smoke",
            "--modes",
            "zero1,ddp",
            "--micro-batches",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["gpu"] is False and got["device"] == "cpu"
    cases = [(c["mode"], c["micro_batch"], c["seq_len"], c["probe"]) for c in got["cases"]]
    assert cases == [("zero1", 1, 8, True), ("ddp", 1, 8, True), ("zero1", 2, 32, False), ("ddp", 2, 32, False)]
    assert all(
        c["step_s"] > 0 and len(c["steps_s"]) == 2 and c["num_microbatches"] == 8 // c["micro_batch"]
        for c in got["cases"]
    )
    assert done.stdout.count("[sweep]") == 4
