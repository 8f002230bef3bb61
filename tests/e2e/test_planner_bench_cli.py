"""benchmarks/planner/run.py as a program: a failed calibrate or a missing screening file stops it with one line."""

from __future__ import annotations

import subprocess
import sys

from tests.unit.test_planner_bench import ROOT


def test_a_failed_calibrate_stops_the_benchmark_with_one_line_not_a_traceback(tmp_path):
    """calibrate's own error (here: a model that does not exist) is printed by calibrate; the benchmark adds one
    line and exits with calibrate's code (2: bad input) before measuring anything."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "planner" / "run.py"),
            "--model",
            "no-such-model",
            "--calibrate",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "elastic-trainer: error: unknown model 'no-such-model'" in proc.stderr
    assert "[bench] calibrate exited 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_missing_screening_stops_the_benchmark_before_calibrate_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "planner" / "run.py"),
            "--screening",
            str(tmp_path / "none.json"),
            "--calibrate",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "[bench]" not in proc.stdout, proc.stderr
    assert not list(tmp_path.iterdir())  # no profile, no results
