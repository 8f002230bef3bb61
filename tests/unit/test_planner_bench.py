"""benchmarks/planner/run.py --calibrate: the benchmark plans with a profile `elastic-trainer calibrate` measured
on this machine just before, at the benchmark's model and sequence length, the rest kept from --hardware."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks" / "planner" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_calibrate_runs_the_cli_at_the_benchmark_s_model_and_sequence(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    args = bench.parse_args(
        [
            "--model",
            "gpt3-small",
            "--seq-len",
            "64",
            "--hardware",
            "base.toml",
            "--calibrate",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert args.calibrate and bench.calibrated(args) == str(tmp_path / "r-profile.toml")
    assert calls == [
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "calibrate",
            "--base",
            "base.toml",
            "--model",
            "gpt3-small",
            "--seq-len",
            "64",
            "--output",
            str(tmp_path / "r-profile.toml"),
        ]
    ]


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "FileNotFoundError"),
        ("{not json", "JSONDecodeError"),
        ('{"summary": []}', "KeyError: 'layouts'"),
        ('{"layouts": [1, 2]}', "ValueError: its layouts are not rows of this benchmark"),
        ("[]", "TypeError"),
    ],
)
def test_a_screening_that_is_not_a_results_file_is_refused_in_one_line(tmp_path, capsys, content, reason):
    path = tmp_path / "earlier.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--screening", str(path)])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]  # "PROG: error: ...", PROG whatever runs the tests
    assert last.split(": error: ", 1)[1].startswith(
        f"--screening {path}: not a results .json of this benchmark ({reason}"
    ), last


def test_a_results_file_s_screening_is_read_once_when_the_arguments_are(tmp_path):
    path = tmp_path / "earlier.json"
    path.write_text('{"layouts": [{"ranks": 4, "dp": 2}]}')
    assert bench.parse_args(["--screening", str(path)]).screened == [{"ranks": 4, "dp": 2}]
    assert bench.parse_args([]).screened is None


def test_without_calibrate_the_named_profile_is_used():
    assert not bench.parse_args([]).calibrate


def _row(rank, mode, predicted, measured, mb=1):
    return {
        "predicted_rank": rank,
        "dp": 2,
        "tp": 1,
        "pp": 2,
        "micro_batch": mb,
        "dp_mode": mode,
        "predicted_s": predicted,
        "measured_s": measured,
    }


def test_mode_orders_judge_by_the_mode_rounds_medians_where_measured_again():
    """Groups are the layouts that differ only in dp mode; without mode rounds the screening's seconds order
    them, with them the rounds' medians (by predicted rank) do."""
    rows = [
        _row(1, "ddp", 4.8, 6.7),
        _row(2, "zero1", 5.1, 6.2),
        _row(3, "fsdp", 5.8, 6.4),
        _row(4, "ddp", 4.6, 5.6, 2),
    ]
    assert [len(g) for g in bench.mode_groups(rows)] == [3]
    (screened,) = bench.mode_orders(rows)
    assert screened["measured"] == ["zero1", "fsdp", "ddp"] and not screened["match"]
    assert screened["measured_by"] == "screening"
    again = {(2, 1, 2, 1, "ddp"): 5.9, (2, 1, 2, 1, "zero1"): 6.0, (2, 1, 2, 1, "fsdp"): 6.3}
    (again,) = bench.mode_orders(rows, again)
    assert again["measured"] == ["ddp", "zero1", "fsdp"] == again["predicted"] and again["match"]
    assert again["measured_s"] == {"ddp": 5.9, "zero1": 6.0, "fsdp": 6.3} and again["measured_by"] == "mode rounds"


def test_only_modes_measured_more_than_3_percent_apart_count_as_ordered():
    """ddp 1.0 s, zero1 1.02 (2 % slower: a tie here), fsdp 1.10; the prediction puts zero1 first: the tie does
    not count against it, fsdp's place does count."""
    pairs = bench.apart_pairs(["zero1", "ddp", "fsdp"], {"ddp": 1.0, "zero1": 1.02, "fsdp": 1.10})
    assert pairs == [
        {"faster": "ddp", "slower": "fsdp", "predicted": True},
        {"faster": "zero1", "slower": "fsdp", "predicted": True},
    ]
    pairs = bench.apart_pairs(["fsdp", "ddp"], {"ddp": 1.0, "fsdp": 1.10})
    assert pairs == [{"faster": "ddp", "slower": "fsdp", "predicted": False}]
    orders = [{"match": False, "apart": pairs}, {"match": True, "apart": []}]
    assert bench.order_counts(orders) == "1 of 2 equal degrees (0 of 1 pairs measured more than 3% apart)"


def test_mode_rounds_is_off_unless_asked_and_never_negative(capsys):
    assert bench.parse_args([]).mode_rounds == 0 and bench.parse_args(["--mode-rounds", "3"]).mode_rounds == 3
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--mode-rounds", "-1"])
    assert exit_.value.code == 2 and "--mode-rounds: must be 0 or more, not -1" in capsys.readouterr().err


def test_an_earlier_screening_is_placed_in_this_plan_by_layout_not_by_its_old_rank(capsys):
    """--screening with another profile: the plan's order changed, so a row's old rank would name another
    layout; each row takes its own layout's rank and prediction here, and one the plan lacks is left out."""

    def cand(dp, pp, mode, seconds):
        return types.SimpleNamespace(
            dp=dp, tp=1, pp=pp, micro_batch=1, num_microbatches=4 // dp, dp_mode=mode, step_time_s=seconds
        )

    cands = [cand(2, 2, "zero1", 5.0), cand(1, 4, "fsdp", 5.5), cand(2, 2, "ddp", 6.0)]  # this plan's order
    old = [
        {**bench.candidate_row(4, 1, cand(2, 2, "ddp", 4.8)), "measured_s": 6.7, "step_s": [6.7, 6.9]},
        {**bench.candidate_row(4, 2, cand(2, 2, "zero1", 5.1)), "measured_s": 6.2, "step_s": [6.2, 6.3]},
        {**bench.candidate_row(4, 3, cand(4, 1, "ddp", 5.2)), "measured_s": 7.0, "step_s": [7.0, 7.1]},
    ]
    rows = bench.repredicted(4, old, cands)
    assert [(r["dp_mode"], r["predicted_rank"], r["predicted_s"], r["measured_s"]) for r in rows] == [
        ("ddp", 3, 6.0, 6.7),
        ("zero1", 1, 5.0, 6.2),
    ]
    assert "[4, 1, 1, 1, 1, 'ddp'] is not in this plan: left out" in capsys.readouterr().out


def test_bench_ranks_with_mode_rounds_keeps_the_finals_medians_for_the_choice(monkeypatch):
    """A screening reused (no rank runs here: the finals and mode rounds are faked): the finals' medians still
    decide chosen/best after the mode rounds ran, and the modes are ordered by the rounds."""
    from elastic_trainer.config import load_model_config
    from elastic_trainer.plan import load_hardware

    args = bench.parse_args(["--model", "gpt-tiny", "--ranks", "4", "--finalists", "1", "--mode-rounds", "1"])
    model, hw = load_model_config("gpt-tiny"), load_hardware("cpu")
    cands = bench.plan(bench.Request(model, 4, 8, 128, hw, 4, dtype="fp32", recompute=(False,))).candidates
    screened = [
        {**bench.candidate_row(4, i + 1, c), "measured_s": 1.0 + i / 100, "step_s": [1.0]} for i, c in enumerate(cands)
    ]
    calls = []

    def finals(world, args, model, req, finalists, tokens, rounds=0, label="final"):
        calls.append((label, [rank for rank, _ in finalists]))  # later-ranked layouts measured faster
        return {rank: [2.0 - rank / 100] for rank, _ in finalists}

    monkeypatch.setattr(bench, "finals", finals)
    rows, summary = bench.bench_ranks(4, args, model, hw, None, screened)
    assert calls[0] == ("final", [1]) and {label for label, _ in calls[1:]} == {"modes"}
    assert summary["chosen"]["median_s"] == 1.99 and summary["chosen_over_best"] == 1.0
    orders = summary["mode_orders"]
    assert orders and all(o["measured_by"] == "mode rounds" for o in orders)
    assert all(o["measured"] == o["predicted"][::-1] for o in orders)  # the fake reverses every group
