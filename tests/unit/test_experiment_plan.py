"""The experiment before anything runs: the shipped schedule and settings, one-line errors for bad ones, and the
claims the experiment must show, checked on the plan (simulated clock, both profiles)."""

from __future__ import annotations

import json

import pytest

from elastic_trainer.cli import main
from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.schedule import run_end
from elastic_trainer.experiment.config import DEFAULT_CONFIG, load_experiment
from elastic_trainer.experiment.profile import plan_profile, runtime_schedule


def test_the_shipped_schedule_is_tenplex_philly_schedule():
    exp = load_experiment()
    assert exp.gpus == [16, 8, 4, 8] * 3 + [16, 8, 4, 8]
    assert exp.durations == [35 * 60.0] * 15 + [13 * 60.0] and sum(exp.durations) == 538 * 60
    assert (exp.target.model.name, exp.target.seq_len, exp.target.global_batch) == ("gpt3-xl", 1024, 128)
    assert exp.table == {16: (2, 2, 4), 8: (1, 2, 4), 4: (1, 2, 2)} and exp.frozen == (2, 4)
    assert exp.profiles == ("h100-80g", "v100-16g")


@pytest.mark.parametrize("profile", ["h100-80g", "v100-16g"])
def test_ours_trains_most_and_reaches_95_percent_of_its_ideal(profile):
    plan = plan_profile(load_experiment(), profile)
    steps = {name: p.timeline.count for name, p in plan.policies.items()}
    assert all(steps["ours"] >= n for n in steps.values())
    assert steps["ours"] > steps["dp-only"] and steps["ours"] > steps["static"]
    ours = plan.policies["ours"]
    assert ours.timeline.count >= 0.95 * ours.ideal.count
    # 15 changes of GPU count, each paying the modelled hand-over through host memory (seconds, not a restart)
    assert ours.timeline.downtime_s == pytest.approx(sum(s.downtime_s for s in ours.timeline.steps))
    paid = [s.downtime_s for s in ours.timeline.steps if s.downtime_s]
    assert len(paid) == 15 and all(plan.hardware.handover_setup_s < d < 10 for d in paid)
    assert set(plan.reconfiguration["handover_s"]) == {"16->8", "8->4", "4->8", "8->16"}


def test_a_wait_keeps_the_restart_through_storage_and_every_other_change_hands_over():
    plan = plan_profile(load_experiment(), "h100-80g")
    dp_only, hw = plan.policies["dp-only"], plan.hardware
    state = plan.reconfiguration["state_gb"]
    restart = state / hw.storage_gbs + hw.restart_s + state / hw.storage_gbs  # 8 GPUs (one host) both sides
    assert restart == pytest.approx(45.8, abs=0.05)
    after_wait = {i for i, c in enumerate(dp_only.choices) if i and dp_only.choices[i - 1].waits}
    paid = {s.phase: s.downtime_s for s in dp_only.timeline.steps if s.downtime_s}
    assert after_wait and after_wait <= set(paid)
    for phase, seconds in paid.items():
        if phase in after_wait:
            assert seconds == pytest.approx(restart, abs=0.02)
        else:
            assert seconds < 10


def test_runtime_schedules_carry_the_steps_and_restart_where_the_clock_does():
    exp = load_experiment()
    plan = plan_profile(exp, "h100-80g")
    for name, p in plan.policies.items():
        phases = runtime_schedule(exp.small, p)
        assert sum(ph.steps for ph in phases) == p.timeline.count, name
    static = runtime_schedule(exp.small, plan.policies["static"])
    assert run_end(static, 0) == len(static) - 1  # one start runs the whole static job
    dp_only = runtime_schedule(exp.small, plan.policies["dp-only"])
    assert sum(1 for ph in dp_only if ph.gpus == 0) == 4  # after each 4-GPU wait the job starts again
    assert all(ph.layout == (2, 2, 4) or ph.layout == (1, 2, 4) for ph in dp_only if ph.gpus)


def write(tmp_path, text: str, phases=None) -> str:
    (tmp_path / "schedule.json").write_text(json.dumps(phases or [{"gpus": 4, "duration_s": 60}]))
    path = tmp_path / "e.toml"
    path.write_text(text)
    return str(path)


GOOD = DEFAULT_CONFIG.read_text()


@pytest.mark.parametrize(
    "text,phases,message",
    [
        (GOOD, [{"gpus": 4, "steps": 6}], "the experiment needs time phases"),
        (GOOD, [{"gpus": 4, "duration_s": 6, "layout": "4,1,1"}], "without pinned layouts"),
        (GOOD.replace('"ours", ', '"mine", '), None, "unknown policy 'mine'"),
        (GOOD.replace('8 = "1,2,4"', '8 = "1,2,2"'), None, "8 = '1,2,2' does not use 8 GPUs"),
        (GOOD.replace('dp_mode = "ddp"', 'dp_mode = "zero3"'), None, "dp_mode='zero3' is not one of fsdp, ddp, zero1"),
        (GOOD.replace('model = "gpt-tiny"', 'modle = "gpt-tiny"'), None, "[small]: unknown key(s) modle"),
    ],
)
def test_bad_experiment_files_are_one_line_errors(tmp_path, text, phases, message):
    with pytest.raises(ConfigError) as error:
        load_experiment(write(tmp_path, text, phases))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_dry_run_prints_every_policy_per_profile(capsys):
    assert main(["experiment", "--dry-run", "--profile", "v100-16g"]) == 0
    out = capsys.readouterr().out
    assert "v100-16g: gpt3-xl, global batch 128 x 1024" in out and "h100-80g" not in out
    for name in ("ours", "tenplex-table", "dp-only", "fsdp-only", "static"):
        assert f"  {name}: " in out
    assert "4: waits (fewer than one tp2 x pp4 replica (8 GPUs))" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--time-scale", "0"], "argument --time-scale: '0' is not a finite number > 0"),
        (["--target-steps", "0"], "argument --target-steps: '0' is not an integer in [1, 1000000]"),
        (["--policy", "elastic"], "unknown policy 'elastic'"),
        (["--profile", "tpu"], "unknown hardware 'tpu'"),
    ],
)
def test_bad_experiment_flags_exit_2_in_one_line(capsys, argv, message):
    assert main(["experiment", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_real_clock_checks_the_hosts_file_before_anything_runs(tmp_path, capsys):
    small = tmp_path / "hosts.txt"
    small.write_text("a slots=8\n")
    argv = ["experiment", "--clock", "real", "--profile", "h100-80g", "--work-dir", str(tmp_path / "w")]
    assert main([*argv, "--hosts", str(small)]) == 2
    err = capsys.readouterr().err
    assert "has 8 slots; the schedule" in err and err.rstrip().endswith("needs 16") and err.count("\n") == 1
    assert main([*argv, "--hosts", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert "missing.txt" in err and err.count("\n") == 1
    assert not (tmp_path / "w").exists()
