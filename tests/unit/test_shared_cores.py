"""plan/shared_cores.py: torch's pipeline orders, and the schedule on shared cores against hand computations."""

from __future__ import annotations

import pytest

from elastic_trainer.plan.shared_cores import makespan, orders


def names(ops):
    return " ".join(f"{kind}{m}" for kind, m in ops)


def test_orders_are_torch_s_1f1b_and_gpipe():
    # Schedule1F1B (torch/distributed/pipelining/schedules.py): stage s warms up with min(a, pp - s) forwards
    one_f_one_b = orders(4, 6)
    assert names(one_f_one_b[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(one_f_one_b[2]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert names(one_f_one_b[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert [names(ops) for ops in orders(3, 2)] == ["F0 F1 B0 B1"] * 3  # fewer micro-batches than stages: GPipe


def test_dedicated_cores_give_the_pipeline_formula():
    # one rank per core: sum of the stages + (a - 1) x the slowest, for equal and for uneven stages
    assert makespan((1.0, 1.0, 1.0, 1.0), 8, 1, 4.0) == pytest.approx(11.0)
    # by hand, pp=2, a=2, stages 1 and 3 s: stage 1 runs F0 [1/3, 4/3], B0 [4/3, 10/3], F1 [10/3, 13/3],
    # B1 [13/3, 19/3]; stage 0's B1 follows in [19/3, 7]
    assert makespan((1.0, 3.0), 2, 1, 2.0) == pytest.approx(7.0) == pytest.approx(1 + 3 + 3)


def test_one_core_runs_all_the_work_back_to_back():
    assert makespan((1.0, 3.0), 2, 1, 1.0) == pytest.approx(8.0)
    assert makespan((0.5, 0.25, 2.0), 5, 2, 1.0) == pytest.approx(5 * 2 * 2.75)


def test_without_a_pipeline_the_copies_share_the_cores():
    assert makespan((2.0,), 3, 4, 1.9) == pytest.approx(3 * 2.0 * 4 / 1.9)
    assert makespan((2.0,), 3, 1, 1.9) == pytest.approx(6.0)  # one rank: at most one core


def test_shared_cores_by_hand():
    # pp=2, a=1, stages 1 and 1 s, 2 copies of each on 2 cores: F0 on stage 0 (2 ranks, a core each) 1/3, F0 on
    # stage 1 1/3, B0 on stage 1 2/3, B0 on stage 0 2/3: 2 s, no two stages ever at once
    assert makespan((1.0, 1.0), 1, 2, 2.0) == pytest.approx(2.0)
    # the same on 1 core: every operation at half speed
    assert makespan((1.0, 1.0), 1, 2, 1.0) == pytest.approx(4.0)
    # uneven stages: slower than the dedicated schedule, faster than all the work on one core
    uneven = makespan((0.3, 0.3, 0.3, 0.9), 8, 1, 1.9)
    assert makespan((0.3, 0.3, 0.3, 0.9), 8, 1, 4.0) == pytest.approx(1.8 + 7 * 0.9)
    assert 8.1 < uneven < 8 * 1.8 and uneven > 8 * 1.8 / 1.9


def test_a_stage_s_own_collectives_share_the_cores_with_the_other_stages_work():
    # pp=2, a=1, forward half of each 1 s stage; stage 0 first gathers for 0.5 s, stage 1 ends with a 2 s
    # reduction. On 2 cores: H [0, 0.5], F0 on stage 0 [0.5, 1], on stage 1 [1, 1.5], B0 on stage 1 [1.5, 2];
    # then stage 1's reduction and stage 0's B0 side by side, a core each: done at 2.5 and 4
    assert makespan((1.0, 1.0), 1, 1, 2.0, 0.5, (0.5, 0.0), (0.0, 2.0)) == pytest.approx(4.0)
    # on 1 core they halve each other from 2: B0 at 3, the reduction's last 1.5 s alone: 4.5
    assert makespan((1.0, 1.0), 1, 1, 1.0, 0.5, (0.5, 0.0), (0.0, 2.0)) == pytest.approx(4.5)
    # none given: the schedule alone
    assert makespan((1.0, 1.0), 1, 1, 2.0, 0.5, (0.0, 0.0), (0.0, 0.0)) == makespan((1.0, 1.0), 1, 1, 2.0, 0.5)
