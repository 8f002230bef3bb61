"""Elasticity policies: each one's rule, checked on GPT-3 XL as the experiment plans it, and ours never slower
than any other policy for any GPU count (it searches a superset with the same step-time model)."""

from __future__ import annotations

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.experiment.policy import POLICIES, Policy, choices
from elastic_trainer.plan import PlanError, Request, load_hardware

XL = load_model_config("gpt3-xl")


def request(hardware: str, gpus: int = 16) -> Request:
    return Request(XL, gpus, 128, 1024, load_hardware(hardware), 8)


@pytest.mark.parametrize("hardware", ["h100-80g", "v100-16g"])
def test_tenplex_table_runs_its_degrees_and_skips_counts_it_does_not_list(hardware):
    table = Policy("tenplex-table")
    got = choices(table, request(hardware), [16, 8, 4, 12])
    assert [c.candidate.degrees for c in got[:3]] == [(2, 2, 4), (1, 2, 4), (1, 2, 2)]
    assert got[3].waits and "12 GPUs are not in the table (4, 8, 16): skipped" in got[3].note


def test_dp_only_keeps_tp2_pp4_waits_below_one_replica_and_leaves_the_rest_idle():
    got = choices(Policy("dp-only"), request("h100-80g"), [16, 8, 4, 12])
    assert [c.candidate.degrees for c in (got[0], got[1], got[3])] == [(2, 2, 4), (1, 2, 4), (1, 2, 4)]
    assert got[2].waits and got[2].used == 0 and "fewer than one tp2 x pp4 replica" in got[2].note
    assert got[3].used == 8 and got[3].note == "4 GPU(s) idle"


def test_fsdp_only_shards_over_every_gpu_and_static_keeps_the_smallest_allocation():
    fsdp = choices(Policy("fsdp-only"), request("v100-16g"), [16, 8, 4])
    assert [(c.candidate.degrees, c.candidate.dp_mode) for c in fsdp] == [
        ((16, 1, 1), "fsdp"),
        ((8, 1, 1), "fsdp"),
        ((4, 1, 1), "fsdp"),
    ]
    static = choices(Policy("static", static_gpus=4), request("v100-16g"), [16, 8, 4, 2])
    assert {c.candidate.layout for c in static[:3]} == {static[2].candidate.layout}
    assert [c.used for c in static] == [4, 4, 4, 0] and static[3].waits


def test_a_policy_without_a_fitting_layout_waits_with_the_planner_reason():
    tiny_memory = Request(XL, 4, 128, 1024, load_hardware("v100-16g"), 8)
    got = Policy("tenplex-table", table={4: (4, 1, 1)}).choose(tiny_memory)
    assert not got.waits  # sharded over 4 it fits 16 GB
    got = Policy("tenplex-table", table={1: (1, 1, 1)}).choose(Request(XL, 1, 128, 1024, load_hardware("v100-16g"), 8))
    assert got.waits and "no layout of 1 GPU(s) fits in memory" in got.note  # XL's state needs > 16 GB
    assert "GiB per GPU > 14.3 GiB usable" in got.note


def test_ours_leaves_gpus_idle_when_fewer_are_faster():
    got = Policy("ours").choose(request("h100-80g", 12))
    best_of_12 = Policy("fsdp-only").choose(request("h100-80g", 12))  # 8 of the 12 in dp8
    assert got.used == 8 and got.step_time_s <= best_of_12.step_time_s


@pytest.mark.parametrize("hardware", ["h100-80g", "v100-16g"])
def test_ours_is_never_slower_than_another_policy(hardware):
    counts = list(range(4, 17))
    ours = choices(Policy("ours"), request(hardware), counts)
    for name in POLICIES[1:]:
        for mine, other in zip(ours, choices(Policy(name, static_gpus=4), request(hardware), counts)):
            assert not mine.waits
            if not other.waits:
                assert mine.step_time_s <= other.step_time_s * (1 + 1e-9), (name, mine.held)


def test_unknown_policy_and_static_without_a_count_are_plan_errors():
    with pytest.raises(PlanError, match="unknown policy 'elastic' \\(valid: ours, tenplex-table"):
        Policy("elastic")
    with pytest.raises(PlanError, match="static_gpus"):
        Policy("static")
