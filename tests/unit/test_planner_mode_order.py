"""benchmarks/planner/mode_order.py: the dp modes of a group stepped in turn on the same ranks, each pair ordered
only when a sign-flip test on its per-cycle ratios tells it from a tie."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))  # mode_order imports this folder's run.py
_spec = importlib.util.spec_from_file_location("planner_mode_order", ROOT / "benchmarks" / "planner" / "mode_order.py")
modes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(modes)


def test_sign_flip_p_counts_the_sign_patterns_by_hand():
    # all n cycles one way: only the all-plus and all-minus patterns reach the observed mean: 2 / 2**n
    assert modes.sign_flip_p([0.1] * 6) == pytest.approx(2 / 64)
    assert modes.sign_flip_p([0.1] * 5) == pytest.approx(2 / 32)  # 5 cycles can never reach p < 0.05
    # [3, 1, 1]: mean 5/3; flipping either 1 gives 1, flipping the 3 gives -1/3 or less: 2 of 8 patterns
    assert modes.sign_flip_p([3.0, 1.0, 1.0]) == pytest.approx(2 / 8)
    assert modes.sign_flip_p([1.0, -1.0]) == 1.0  # mean 0: every pattern is as far
    # beyond EXACT_UP_TO values the patterns are drawn: 20 alike is 2 / 2**20 exactly, about 0 drawn
    assert modes.sign_flip_p([0.1] * 20) < 1e-4 and modes.sign_flip_p([1.0, -1.0] * 10) == 1.0


def test_each_cycle_rotates_the_modes_so_each_follows_each_other_as_often():
    assert [modes.cycle_order(3, c) for c in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]


def test_the_ranks_step_one_trainer_per_mode_in_turn_after_their_warm_up(monkeypatch):
    """No ranks run: a fake trainer records the order of steps and answers its own step count."""
    log = []

    class FakeTrainer:
        def __init__(self, model, cfg, layout, mesh, device, tokens):
            self.name, self.steps = layout.dp_mode, 0

        def train_step(self):
            self.steps += 1
            log.append(self.name)
            return {"step_time_s": float(self.steps)}

    monkeypatch.setattr(modes, "Trainer", FakeTrainer)
    monkeypatch.setattr(modes, "build_mesh", lambda layout, device: None)
    layouts = [types.SimpleNamespace(dp_mode=m) for m in ("ddp", "fsdp")]
    times = modes.interleaved_steps(1, 2, None, None, layouts, None, warmup=2, cycles=3)
    assert log == ["ddp", "ddp", "fsdp", "fsdp", "ddp", "fsdp", "fsdp", "ddp", "ddp", "fsdp"]
    assert times == [[3.0, 4.0, 5.0], [3.0, 4.0, 5.0]]  # the warm-up steps are not measured


def test_a_pair_faster_in_every_one_of_six_cycles_is_ordered_and_checked_against_the_prediction():
    steps = {"ddp": [1.00, 1.02, 0.99, 1.01, 1.00, 1.03], "fsdp": [1.05, 1.06, 1.04, 1.07, 1.05, 1.06]}
    (pair,) = modes.judge_group(steps, {"ddp": 5.0, "fsdp": 4.9})
    ratio = math.exp(sum(math.log(f / d) for d, f in zip(steps["ddp"], steps["fsdp"])) / 6)
    assert pair["faster"] == "ddp" and pair["slower"] == "fsdp" and pair["ratio"] == round(ratio, 4)
    assert pair["faster_in_cycles"] == 6 and pair["p"] == round(2 / 64, 4) and pair["ordered"]
    assert pair["predicted"] is False  # the prediction put fsdp first
    (pair,) = modes.judge_group(steps, {"ddp": 4.9, "fsdp": 5.0})
    assert pair["predicted"] is True


def test_a_pair_that_swaps_from_cycle_to_cycle_is_a_tie_with_no_order_to_match():
    steps = {"ddp": [1.00, 1.10, 1.00, 1.10, 1.00, 1.10], "zero1": [1.05] * 6}
    (pair,) = modes.judge_group(steps, {"ddp": 5.0, "zero1": 4.0})
    assert not pair["ordered"] and pair["predicted"] is None and pair["p"] > 0.5
    groups = [
        {"pairs": [pair]},
        {
            "pairs": modes.judge_group(
                {"ddp": [1.0] * 6, "fsdp": [1.1] * 6, "zero1": [0.9] * 6}, {"zero1": 1.0, "ddp": 2.0, "fsdp": 1.5}
            )
        },
    ]
    # zero1 < ddp < fsdp measured; predicted zero1 < fsdp < ddp: 2 of the 3 ordered pairs agree
    assert modes.counts(groups) == "2 of 3 ordered pairs in the predicted order (1 of 4 pairs a tie at p >= 0.05)"


def test_fewer_than_six_cycles_is_refused_as_it_could_order_nothing(capsys):
    with pytest.raises(SystemExit) as exit_:
        modes.parse_args(["--cycles", "5"])
    assert exit_.value.code == 2 and "--cycles 5: 6 or more" in capsys.readouterr().err
    assert modes.parse_args([]).cycles == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--degrees", "2,x"], "--degrees 2,x: three positive integers DP,TP,PP"),
        (["--degrees", "2,1"], "--degrees 2,1: three positive integers DP,TP,PP"),
        (["--degrees", "0,1,4"], "--degrees 0,1,4: three positive integers DP,TP,PP"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--hardware", "no-such-profile"], "unknown hardware 'no-such-profile'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        modes.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


def test_degrees_without_a_group_of_modes_stop_before_measuring_and_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(modes, "measure_group", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_:
        modes.main(["--model", "gpt-tiny", "--ranks", "4", "--degrees", "4,1,2", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no group of dp modes at degrees 4,1,2 in this plan (groups at: 2,1,2" in err
    assert not list(tmp_path.iterdir())


def _run(micro_batches: dict[int, dict[str, list[float]]], **shape) -> dict:
    """A finished mode_order.py result of gpt-tiny's dp2 groups at 2 ranks (the predictions left out)."""
    groups = [
        {"degrees": [2, 1, 1], "micro_batch": mb, "steps_s": steps, "pairs": []} for mb, steps in micro_batches.items()
    ]
    return {
        "model": "gpt-tiny",
        "ranks": 2,
        "global_batch": 8,
        "seq_len": 32,
        **shape,
        "cycles": len(next(iter(micro_batches.values()))["ddp"]),
        "groups": groups,
    }


def test_two_runs_of_a_group_pooled_are_judged_on_all_their_cycles_under_the_profile_given():
    """Each run alone: ddp faster by the same ratio in 5 of 6 cycles, a tie; their 12 cycles together: ordered.
    Counted by hand: with equal magnitudes a sign pattern is as far from 0 when at most one of 6 (two of 12)
    cycles goes either way: 1 + 6 + 6 + 1 of 64 patterns alone, 2 * (1 + 12 + 66) of 4096 pooled."""
    first = {"ddp": [1.0, 1.0, 1.0, 1.0, 1.0, 1.1], "fsdp": [1.1, 1.1, 1.1, 1.1, 1.1, 1.0]}
    second = {"ddp": [2.0, 2.2, 2.0, 2.0, 2.0, 2.0], "fsdp": [2.2, 2.0, 2.2, 2.2, 2.2, 2.2]}  # a slower hour
    (alone,) = modes.judge_group(first, {"ddp": 1.0, "fsdp": 1.0})
    assert not alone["ordered"] and alone["p"] == round(14 / 64, 4)
    result = modes.pooled([_run({4: first}), _run({4: second})], modes.load_hardware("cpu"))
    (group,) = result["groups"]
    assert group["steps_s"] == {m: first[m] + second[m] for m in first}
    logs = [math.log(d / f) for d, f in zip(first["ddp"] + second["ddp"], first["fsdp"] + second["fsdp"])]
    (pair,) = group["pairs"]
    assert pair["p"] == round(modes.sign_flip_p(logs), 4) == round(158 / 4096, 4) and pair["ordered"]
    assert pair["faster"] == "ddp" and pair["faster_in_cycles"] == 10 and pair["cycles"] == 12
    # the prediction is the profile's, not either run's
    predicted = modes.predicted_times(_run({4: first}), modes.load_hardware("cpu"))
    assert group["predicted_s"] == {m: round(predicted[(2, 1, 1, 4, m)], 4) for m in ("ddp", "fsdp")}
    assert pair["predicted"] == (predicted[(2, 1, 1, 4, "ddp")] < predicted[(2, 1, 1, 4, "fsdp")])
    assert result["pooled"] == 2 and result["cycles"] == 12 and result["summary"] == modes.counts(result["groups"])


def test_runs_of_different_groups_or_shapes_are_not_pooled():
    steps = {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}
    with pytest.raises(
        ValueError,
        match=r"cannot pool runs of different groups: .*groups 2,1,1 micro 4 "
        r"\(ddp/fsdp\); .*groups 2,1,1 micro 2 \(ddp/fsdp\)",
    ):
        modes.pooled([_run({4: steps}), _run({2: steps})], modes.load_hardware("cpu"))
    with pytest.raises(ValueError, match="seq_len 32.*seq_len 64"):
        modes.pooled([_run({4: steps}), _run({4: steps}, seq_len=64)], modes.load_hardware("cpu"))
    with pytest.raises(ValueError, match=r"micro 4 \(ddp/fsdp\); .* micro 4 \(ddp/fsdp/zero1\)"):
        modes.pooled([_run({4: steps}), _run({4: {**steps, "zero1": [1.0] * 6}})], modes.load_hardware("cpu"))
    with pytest.raises(ValueError, match=r"profile cpu plans no ddp or fsdp at degrees \[2, 1, 1\] micro 3"):
        modes.pooled([_run({3: steps})], modes.load_hardware("cpu"))


def test_pool_from_the_command_line_writes_the_pooled_result_and_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(modes, "measure_group", lambda *a: pytest.fail("measured"))
    steps = {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}
    names = []
    for i in range(2):
        names.append(str(tmp_path / f"run{i}.json"))
        Path(names[-1]).write_text(json.dumps(_run({4: steps})))
    result = modes.main(["--pool", *names, "--out", str(tmp_path / "pooled")])
    assert result == json.loads((tmp_path / "pooled.json").read_text()) and result["cycles"] == 12
    assert result["pooled"] == names  # the sources named in the pooled result
    assert "2 runs pooled, 12 cycles per group, profile cpu" in capsys.readouterr().out
    assert modes.main(["--pool", *names])["cycles"] == 12  # without --out: printed, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pooled.json", "run0.json", "run1.json"]
    Path(names[1]).write_text(json.dumps(_run({2: steps})))
    with pytest.raises(SystemExit) as exit_:
        modes.main(["--pool", *names, "--out", str(tmp_path / "mixed")])
    assert exit_.value.code == 2 and "cannot pool runs of different groups" in capsys.readouterr().err
    assert not (tmp_path / "mixed.json").exists()


def test_pooled_predictions_are_the_profile_s_given_and_groups_match_in_any_order():
    """The same measured pair (ddp faster in every cycle) is in or out of the predicted order as the profile
    given makes ddp or fsdp the costlier; the second run lists its groups the other way round."""
    fast = {4: {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}, 2: {"ddp": [2.0] * 6, "fsdp": [2.4] * 6}}
    runs = [_run({4: fast[4], 2: fast[2]}), _run({2: fast[2], 4: fast[4]})]
    cpu = modes.load_hardware("cpu")
    for costly, in_order in (("ddp", False), ("fsdp", True)):
        hw = dataclasses.replace(cpu, **{f"{costly}_hooks_ns_per_param": 50.0})
        result = modes.pooled(runs, hw)
        assert [g["micro_batch"] for g in result["groups"]] == [4, 2]  # the first run's order
        for g in result["groups"]:
            assert g["steps_s"] == {m: t * 2 for m, t in fast[g["micro_batch"]].items()}
            assert g["predicted"][-1] == costly and g["pairs"][0]["predicted"] is in_order


def test_more_cycles_than_counted_exactly_are_tested_on_drawn_patterns_never_at_p_0():
    steps = {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}
    result = modes.pooled([_run({4: steps})] * 3, modes.load_hardware("cpu"))
    (pair,) = result["groups"][0]["pairs"]
    logs = [math.log(1.0 / 1.1)] * 18  # beyond EXACT_UP_TO: 2 of 2**18 patterns as far, about 1.5 drawn
    assert pair["cycles"] == 18 > modes.EXACT_UP_TO and pair["p"] == round(modes.sign_flip_p(logs), 4)
    assert 0 < modes.sign_flip_p(logs) <= 5 / (modes.DRAWN + 1) and pair["ordered"]


def test_pool_takes_the_model_file_the_runs_used_when_their_model_is_no_preset(tmp_path, capsys):
    """The script's default model (the bench model, named bench-512x8) pools without --model; another name needs
    its file."""
    steps = {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_run({4: steps}, model="bench-512x8")))
    assert modes.main(["--pool", str(path), str(path)])["cycles"] == 12
    path.write_text(json.dumps(_run({4: steps}, model="my-model")))
    with pytest.raises(SystemExit) as exit_:
        modes.parse_args(["--pool", str(path)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and "the runs' model 'my-model' is no preset and --model" in err


@pytest.mark.parametrize("argv", [["--calibrate"], ["--degrees", "2,1,1"]])
def test_pool_refuses_the_options_that_measure(tmp_path, capsys, argv):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run({4: {"ddp": [1.0] * 6, "fsdp": [1.1] * 6}})))
    with pytest.raises(SystemExit) as exit_:
        modes.parse_args(["--pool", str(path), *argv])
    assert exit_.value.code == 2 and f"{argv[0]} measures; --pool only judges" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("{not json", "Expecting property name"),
        ('{"groups": []}', "not a finished mode_order.py result (needs model, ranks, global_batch, seq_len, cycles"),
        ("[1, 2]", "not a finished mode_order.py result"),
        (
            json.dumps(
                {
                    "model": "gpt-tiny",
                    "ranks": 2,
                    "global_batch": 8,
                    "seq_len": 32,
                    "cycles": 6,
                    "groups": [{"degrees": [2, 1, 1]}],
                }
            ),
            "groups with degrees, micro_batch and steps_s",
        ),
    ],
)
def test_pool_refuses_a_missing_unreadable_or_unfinished_result_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        modes.parse_args(["--pool", str(path)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and f"--pool {path}" in err and message in err
