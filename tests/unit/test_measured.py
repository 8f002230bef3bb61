"""plan/measured.py and the planner's use of it: a job's measured step times, recorded per start in the run
folder, rank the layouts it ran at its next plans; the other layouts of their family are corrected by the
family's ratio; nothing else changes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.plan import PlanError, Request, load_hardware, measured, plan
from elastic_trainer.plan.hardware import GIB
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.planner import _ranked, plan_or_none
from elastic_trainer.plan.report import plan_dict, summary

KEY = measured.job_key("gpt-tiny", 8, 64, "auto", "cpu", False)
A = Layout(2, 1, 1, 4, 1, "zero1")


def steps(*seconds: float) -> list[dict]:
    return [{"step_time_s": s} for s in seconds]


def test_a_start_records_its_steady_step_time_and_later_plans_read_it_back(tmp_path):
    path = measured.path_for(str(tmp_path / "metrics.jsonl"))
    assert path == tmp_path / "measured.jsonl" and measured.path_for(None) is None
    assert measured.record(path, KEY, A, (2,), steps(9.0, 1.0), 0.5) is None  # too few steps to say
    entry = measured.record(path, KEY, A, (2,), steps(9.0, 1.0, 3.0, 2.0), 0.5)  # the first (warm-up) left out
    assert entry["step_s"] == 2.0 and entry["steps"] == 3 and entry["predicted_s"] == 0.5
    measured.record(path, KEY, A, (2,), steps(9.0, 4.0, 4.0), 0.5)
    measured.record(path, {**KEY, "global_batch": 16}, A, (2,), steps(9.0, 7.0, 7.0), 0.5)  # another job's
    measured.record(path, KEY, A, (1, 1), steps(9.0, 7.0, 7.0), 0.5)  # other hosts
    with open(path, "a") as f:
        f.write('{"model": "gpt-tiny", "cut sh')  # a crash mid-line
    assert measured.for_hosts(path, KEY, (2,)) == ((A, 3.0, None, 0),)  # the median of this job's starts on 2 ranks
    assert measured.for_hosts(path, KEY, (1, 1)) == ((A, 7.0, None, 0),)
    assert measured.for_hosts(tmp_path / "none.jsonl", KEY, (2,)) == ()
    assert all(json.loads(line)["hosts"] for line in path.read_text().splitlines()[:-1])


@pytest.fixture
def request_4():
    return Request(load_model_config("gpt-tiny"), 4, 8, 64, load_hardware("cpu"), 4, dtype="fp32")


def test_a_layout_the_job_ran_is_ranked_by_its_measurement(request_4):
    first = plan(request_4).chosen
    again = plan(dataclasses.replace(request_4, measured=((first.layout, first.step_time_s * 0.9),)))
    assert again.chosen.layout == first.layout and again.chosen.source == "measured"
    assert again.chosen.step_time_s == pytest.approx(first.step_time_s * 0.9)  # not a prediction: the figure
    assert again.chosen.time.total == pytest.approx(first.step_time_s)  # the model's own is kept beside it
    assert f"measured {first.step_time_s * 0.9:.3f} s/step by an earlier start" in summary(again)
    assert "1 measured by this job" in summary(again)


def test_a_layout_twice_as_slow_as_predicted_gives_way_after_one_phase_and_its_family_with_it(request_4):
    """The profile's prediction for A is wrong by 2x (as a profile edited on purpose would make it): after one
    phase on A, the next plan moves to the best layout outside A's family (the same degrees and dp mode, which
    share every term of the model, so their predictions are doubled too); the rest keep their predictions."""
    before = plan(request_4)
    a = before.chosen
    after = plan(dataclasses.replace(request_4, measured=((a.layout, 2 * a.step_time_s),)))
    family = measured.family(a.layout)
    outside = [c for c in before.candidates if measured.family(c.layout) != family]
    assert after.chosen.layout == outside[0].layout and after.chosen.step_time_s == outside[0].step_time_s
    for c in after.candidates:
        if c.layout == a.layout:
            assert c.source == "measured" and c.step_time_s == pytest.approx(2 * a.step_time_s)
        elif measured.family(c.layout) == family:
            assert c.source == "corrected" and c.correction == pytest.approx(2.0)
        else:
            assert c.source == "predicted" and c.correction == 1.0
    # B then measures slower than A did: the plan after it returns to A, the faster of the two it measured
    b = after.chosen
    back = plan(dataclasses.replace(request_4, measured=((a.layout, 2 * a.step_time_s), (b.layout, 3 * a.step_time_s))))
    assert back.chosen.layout != b.layout and back.chosen.step_time_s <= 2 * a.step_time_s


def test_a_start_records_with_gpus_idle_and_not_under_another_device_s_profile(tmp_path):
    """resolve.record_measured: with 1 of 4 ranks idle the prediction is for the 3 used (the record keyed by
    the 4 held); a job planned with a GPU profile on CPU ranks records nothing (those are not GPU seconds)."""
    from elastic_trainer import cli_parser, resolve

    def spec(*argv: str):
        args = cli_parser.train_args(
            [
                "--model",
                "gpt-tiny",
                "--global-batch",
                "6",
                "--seq-len",
                "64",
                "--metrics-file",
                str(tmp_path / "metrics.jsonl"),
                *argv,
            ]
        )
        return resolve.train_spec(args, built_by="test", world_size=4, local_world_size=4, hosts_known=True)

    three = Layout(3, 1, 1, 2, 1, "ddp")
    entry = resolve.record_measured(spec("--hardware", "cpu"), three, (4,), steps(5.0, 1.0, 1.0), "cpu")
    assert entry["hosts"] == [4] and entry["predicted_s"] > 0 and entry["layout"]["dp"] == 3
    assert resolve.record_measured(spec("--hardware", "h100-80g"), three, (4,), steps(5.0, 1.0, 1.0), "cpu") is None
    assert len((tmp_path / "measured.jsonl").read_text().splitlines()) == 1


def test_a_start_on_cpu_records_the_largest_heap_its_ranks_kept(tmp_path):
    path = tmp_path / "measured.jsonl"
    records = [{"step_time_s": 1.0, "kept_memory_gib": k} for k in (1.5, 2.5, 2.25)]
    assert measured.record(path, KEY, A, (2,), records, 1.0)["kept_memory_gib"] == 2.5
    assert measured.record(path, KEY, A, (2,), steps(1.0, 1.0, 1.0), 1.0)["kept_memory_gib"] is None  # a GPU's


def test_later_plans_read_back_the_largest_peak_a_layout_took(tmp_path):
    """The largest peak over a layout's starts (GPU: the allocator's; CPU: the kept heap), whichever a start
    recorded; a start that recorded none leaves the others' figure."""
    path = tmp_path / "measured.jsonl"
    measured.record(path, KEY, A, (2,), [{"step_time_s": 1.0, "kept_memory_gib": k} for k in (1.0, 1.5, 1.25)], 1.0)
    measured.record(path, KEY, A, (2,), [{"step_time_s": 3.0, "kept_memory_gib": k} for k in (1.0, 1.25, 1.0)], 1.0)
    measured.record(path, KEY, A, (2,), steps(2.0, 2.0, 2.0), 1.0)
    b = Layout(1, 1, 2, 8, 1, "fsdp")
    measured.record(path, KEY, b, (2,), [{"step_time_s": 1.0, "max_memory_gib": k} for k in (3.0, 4.0, 4.5)], 1.0)
    assert measured.for_hosts(path, KEY, (2,)) == ((A, 2.0, 1.5, 3), (b, 1.0, 4.5, 3))


def _tiny(request_4, **hardware):
    return dataclasses.replace(request_4, hardware=dataclasses.replace(request_4.hardware, **hardware))


def test_a_layout_the_job_ran_is_judged_by_the_memory_it_measured(request_4):
    """A CPU profile whose kept-heap envelope is far too wide rejects every layout: once a start of 10 steps
    has run one (its peak recorded), the next plan checks it at the model's bytes times its own measured /
    planned ratio, admits it and names it measured; its family, whose ratio is below 1, is not loosened with
    it. A start of 3 steps admits nothing (the kept heap still grows); a peak equal to the plan keeps a
    pipelined layout (pp = 2, uneven stages) valid; a peak that would not fit these hosts keeps it out."""
    a = plan(request_4).chosen
    assert a.pp > 1, "uneven stages: the check must not count every rank at the largest one's peak"
    per_rank = rank_peak_gib(request_4, a)
    same = plan(dataclasses.replace(request_4, measured=(measured.Measurement(a.layout, a.step_time_s, per_rank, 10),)))
    assert same.chosen.layout == a.layout and same.chosen.memory_source == "measured"
    assert f"(measured {per_rank:.1f} GiB at the largest rank's peak, planned {per_rank:.1f})" in summary(same)
    usable = request_4.hardware.usable_bytes / GIB
    wide = _tiny(request_4, kept_heap=4 * usable / per_rank, kept_heap_unpipelined=4 * usable / per_rank)
    with pytest.raises(PlanError, match="fits in memory"):
        plan(wide)
    after = plan(dataclasses.replace(wide, measured=(measured.Measurement(a.layout, 1.0, per_rank, 10),)))
    assert [c.layout for c in after.candidates] == [a.layout]
    assert after.chosen.memory_source == "measured" and after.chosen.measured_memory_gib == per_rank
    assert "measured" == plan_dict(after)["chosen"]["memory_source"]
    short = dataclasses.replace(wide, measured=(measured.Measurement(a.layout, 1.0, per_rank, 3),))
    assert plan_or_none(short) is None
    kept_out = next(c for c in _ranked(short).rejected if c.layout == a.layout)
    assert kept_out.reason.endswith(
        "(an earlier start ran it for 3 steps: 10 are needed to admit it on its measured peak)"
    )
    # by hand: the model's host bytes for `a` under `wide`, scaled by the peak over its planned largest rank
    full = rank_peak_gib(wide, a) * usable / host_gib(wide, a.layout) * 1.01
    need = host_gib(wide, a.layout) * full / rank_peak_gib(wide, a)
    over = dataclasses.replace(wide, measured=(measured.Measurement(a.layout, 1.0, full, 10),))
    assert plan_or_none(over) is None
    ran = [c for c in _ranked(over).rejected if c.layout == a.layout]
    assert len(ran) == 1 and ran[0].memory_source == "measured"
    assert ran[0].reason == f"needs {need:.1f} GiB per host > {usable:.1f} GiB usable (as an earlier start measured)"


def test_a_layout_that_took_twice_its_planned_memory_takes_its_family_out_of_a_host_it_no_longer_fits(request_4):
    """A profile that plans half the memory a layout takes (its kept heap edited on purpose): after one start
    records twice the planned peak, every other layout of its family is checked at twice its planned bytes,
    and those that then exceed the host are rejected, saying why; other families keep their predictions."""
    a = plan(request_4).chosen
    fam = [
        c
        for c in plan(request_4).candidates
        if measured.family(c.layout) == measured.family(a.layout) and c.layout != a.layout
    ]
    assert fam, "the chosen layout's family has other micro-batches"
    # a host just big enough for the family's largest planned member, and the measured peak twice the plan
    largest = max(host_gib(request_4, c.layout) for c in fam)
    base = request_4.hardware.memory_gb - request_4.hardware.usable_bytes / GIB
    snug = _tiny(request_4, memory_gb=base + 1.2 * largest)
    before = plan(snug)
    assert {c.layout for c in fam} <= {c.layout for c in before.candidates}
    doubled = 2 * rank_peak_gib(snug, a)
    after = plan(dataclasses.replace(snug, measured=(measured.Measurement(a.layout, 1.0, doubled, 10),)))
    out = {c.layout: c for c in after.rejected}
    for c in fam:
        need = 2 * host_gib(snug, c.layout)  # every rank of the host at twice its plan
        if need > snug.hardware.usable_bytes / GIB:
            assert (
                out[c.layout].memory_source == "corrected" and "x2.00, as its family measured" in out[c.layout].reason
            )
        else:
            assert c.layout in {x.layout for x in after.candidates}
    assert any(c.layout in out for c in fam), "the doubled peak takes one of the family out"
    others = [c for c in after.candidates if measured.family(c.layout) != measured.family(a.layout)]
    assert others and all(c.memory_source == "predicted" for c in others)


def rank_peak_gib(req, c) -> float:
    from elastic_trainer.plan.candidates import rank_peak_bytes

    return rank_peak_bytes(req, c) / GIB


def host_gib(req, layout) -> float:
    """By hand: the planned bytes of every rank on the one host (each stage's dp x tp ranks)."""
    from elastic_trainer.plan.memory import stage_memories

    stages = stage_memories(req.model, layout, req.seq_len, req.compute_dtype)
    return sum(req.hardware.rank_bytes(m.total, layout) for m in stages) * layout.dp * layout.tp / GIB
