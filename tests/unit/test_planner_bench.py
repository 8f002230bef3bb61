"""benchmarks/planner/run.py --calibrate: the benchmark plans with a profile `elastic-trainer calibrate` measured
on this machine just before, at the benchmark's model and sequence length, the rest kept from --hardware."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks" / "planner" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_calibrate_runs_the_cli_at_the_benchmark_s_model_and_sequence(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    args = bench.parse_args(["--model", "gpt3-small", "--seq-len", "64", "--hardware", "base.toml", "--calibrate",
                             "--out", str(tmp_path / "r")])
    assert args.calibrate and bench.calibrated(args) == str(tmp_path / "r-profile.toml")
    assert calls == [[sys.executable, "-m", "elastic_trainer.cli", "calibrate", "--base", "base.toml", "--model",
                      "gpt3-small", "--seq-len", "64", "--output", str(tmp_path / "r-profile.toml")]]


def test_a_failed_calibrate_stops_the_benchmark_with_one_line_not_a_traceback(tmp_path):
    """calibrate's own error (here: a model that does not exist) is printed by calibrate; the benchmark adds one
    line and exits non-zero before measuring anything."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner" / "run.py"), "--model", "no-such-model",
                           "--calibrate", "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[bench] calibrate exited" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_without_calibrate_the_named_profile_is_used():
    assert not bench.parse_args([]).calibrate


def _row(rank, mode, predicted, measured, mb=1):
    return {"predicted_rank": rank, "dp": 2, "tp": 1, "pp": 2, "micro_batch": mb, "dp_mode": mode,
            "predicted_s": predicted, "measured_s": measured}


def test_mode_orders_judge_by_the_mode_rounds_medians_where_measured_again():
    """Groups are the layouts that differ only in dp mode; without mode rounds the screening's seconds order
    them, with them the rounds' medians (by predicted rank) do."""
    rows = [_row(1, "ddp", 4.8, 6.7), _row(2, "zero1", 5.1, 6.2), _row(3, "fsdp", 5.8, 6.4), _row(4, "ddp", 4.6, 5.6, 2)]
    assert [len(g) for g in bench.mode_groups(rows)] == [3]
    (screened,) = bench.mode_orders(rows)
    assert screened["measured"] == ["zero1", "fsdp", "ddp"] and not screened["match"]
    assert screened["measured_by"] == "screening"
    (again,) = bench.mode_orders(rows, {1: 5.9, 2: 6.0, 3: 6.3})
    assert again["measured"] == ["ddp", "zero1", "fsdp"] == again["predicted"] and again["match"]
    assert again["measured_s"] == {"ddp": 5.9, "zero1": 6.0, "fsdp": 6.3} and again["measured_by"] == "mode rounds"


def test_mode_rounds_is_off_unless_asked():
    assert bench.parse_args([]).mode_rounds == 0 and bench.parse_args(["--mode-rounds", "3"]).mode_rounds == 3


def test_an_earlier_screening_is_placed_in_this_plan_by_layout_not_by_its_old_rank(capsys):
    """--screening with another profile: the plan's order changed, so a row's old rank would name another
    layout; each row takes its own layout's rank and prediction here, and one the plan lacks is left out."""
    def cand(dp, pp, mode, seconds):
        return types.SimpleNamespace(dp=dp, tp=1, pp=pp, micro_batch=1, num_microbatches=4 // dp,
                                     dp_mode=mode, step_time_s=seconds)

    cands = [cand(2, 2, "zero1", 5.0), cand(1, 4, "fsdp", 5.5), cand(2, 2, "ddp", 6.0)]  # this plan's order
    old = [{**bench.candidate_row(4, 1, cand(2, 2, "ddp", 4.8)), "measured_s": 6.7, "step_s": [6.7, 6.9]},
           {**bench.candidate_row(4, 2, cand(2, 2, "zero1", 5.1)), "measured_s": 6.2, "step_s": [6.2, 6.3]},
           {**bench.candidate_row(4, 3, cand(4, 1, "ddp", 5.2)), "measured_s": 7.0, "step_s": [7.0, 7.1]}]
    rows = bench.repredicted(4, old, cands)
    assert [(r["dp_mode"], r["predicted_rank"], r["predicted_s"], r["measured_s"]) for r in rows] == [
        ("ddp", 3, 6.0, 6.7), ("zero1", 1, 5.0, 6.2)]
    assert "[4, 1, 1, 1, 1, 'ddp'] is not in this plan: left out" in capsys.readouterr().out
