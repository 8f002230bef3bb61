"""benchmarks/gpu/checkup.py, the GPU check-up kit, in the form it takes without a GPU (what CI can run, so the
kit cannot rot): every case is a real `elastic-trainer torchrun ... train` job, each dp mode, tp, pp and the
micro-batch sweep eager and compiled; every one trains, each row has the planner's predictions beside the
measurements, `calibrate --compile` writes a profile that loads, and the output says plainly that the figures
are not GPU figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_trainer.plan import load_hardware

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_cpu_form_runs_every_case_and_says_it_is_not_gpu_figures(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "checkup.py"), "--out", str(tmp_path), "--sweep", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "cpu-form" / "checkup.json").read_text())
    assert report["gpu_figures"] is False and "NOT GPU FIGURES" in report["note"]
    assert proc.stdout.count("NOT GPU FIGURES") == 2  # before the cases and under the table
    cases = {c["name"]: c for c in report["cases"]}
    assert {
        "dp2 fsdp",
        "dp2 ddp",
        "dp2 zero1",
        "tp2",
        "pp2",
        "1 rank mb1",
        "1 rank mb1 compiled",
    } == set(cases)  # the sweep of micro-batches is --sweep's: one size here (each compiled size compiles anew)
    for case in cases.values():
        assert case["ok"] and case["returncode"] == 0, case
        assert case["step_s"] > 0 and case["predicted_step_s"] > 0 and case["predicted_memory_gib"] > 0
        assert case["max_memory_gib"] is None and "mfu" not in case  # no CUDA allocator, no GPU peak
    compiled_log = Path(cases["1 rank mb1 compiled"]["log"]).read_text()
    assert "[compile] rank 0's 4 blocks as 1 graph(s)" in compiled_log
    assert all(line in proc.stdout for line in report["table"])
    profile = load_hardware(report["calibrate"]["profile"])
    assert profile.device == "cpu" and profile.compiled_speedup > 0 and profile.tflops > 0
