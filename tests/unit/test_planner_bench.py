"""benchmarks/planner/run.py --calibrate: the benchmark plans with a profile `elastic-trainer calibrate` measured
on this machine just before, at the benchmark's model and sequence length, the rest kept from --hardware."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks" / "planner" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_calibrate_runs_the_cli_at_the_benchmark_s_model_and_sequence(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, check: calls.append((cmd, check)))
    args = bench.parse_args(["--model", "gpt3-small", "--seq-len", "64", "--hardware", "base.toml", "--calibrate",
                             "--out", str(tmp_path / "r")])
    assert args.calibrate and bench.calibrated(args) == str(tmp_path / "r-profile.toml")
    assert calls == [([sys.executable, "-m", "elastic_trainer.cli", "calibrate", "--base", "base.toml", "--model",
                       "gpt3-small", "--seq-len", "64", "--output", str(tmp_path / "r-profile.toml")], True)]


def test_without_calibrate_the_named_profile_is_used():
    assert not bench.parse_args([]).calibrate
