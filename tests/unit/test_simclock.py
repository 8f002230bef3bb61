"""The simulated clock against timelines worked out by hand, and the reconfiguration model's arithmetic."""

from __future__ import annotations

import pytest

from elastic_trainer.experiment.simclock import auto_scale, hosts_of, reconfiguration_s, simulate
from elastic_trainer.plan import load_hardware
from elastic_trainer.experiment.policy import Choice


class FakeCandidate:
    """What the clock reads from a candidate: its layout (identity) and step time."""

    def __init__(self, name: str, step_time_s: float):
        self.layout, self.step_time_s = name, step_time_s


def run(name: str, seconds: float, used: int = 8) -> Choice:
    return Choice(used, used, FakeCandidate(name, seconds))  # type: ignore[arg-type]


WAIT = Choice(4, 0, None, "fewer than one replica")
A, B = run("A", 1.0), run("B", 2.0, used=16)


def constant(seconds: float):
    return lambda before, after: seconds


def test_a_change_pays_the_downtime_then_steps_at_the_new_rate():
    t = simulate([10, 10], [A, B], 1.0, constant(3))
    # phase 1: 10 steps of 1 s end at 10; phase 2: 3 s of downtime, then ceil((20 - 13) / 2) = 4 steps of 2 s
    assert [s.time_s for s in t.steps] == [*range(1, 11), 15, 17, 19, 21]
    assert t.phase_steps == [10, 4] and t.downtime_s == 3
    assert [s.downtime_s for s in t.steps if s.downtime_s] == [3] and t.steps[10].downtime_s == 3
    assert [s.step for s in t.steps] == list(range(1, 15))


def test_the_step_in_flight_finishes_and_its_overrun_comes_off_the_next_phase():
    t = simulate([2.5, 10], [A, A], 1.0, constant(3))  # the same choice: no restart between the phases
    assert t.phase_steps == [3, 10] and t.steps[-1].time_s == 13 and t.downtime_s == 0
    t = simulate([2.5, 10], [A, B], 1.0, constant(3))  # 3 steps end at 3 > 2.5; B starts at 3 + 3 = 6
    assert t.phase_steps == [3, 4] and [s.time_s for s in t.steps[3:]] == [8, 10, 12, 14]


def test_a_wait_stops_the_job_and_the_same_choice_after_it_restarts():
    t = simulate([10, 10, 10], [A, WAIT, A], 1.0, constant(3))
    assert t.phase_steps == [10, 0, 7] and t.steps[10].time_s == 24 and t.downtime_s == 3
    ideal = simulate([10, 10, 10], [A, WAIT, A], 1.0)
    assert ideal.count == 20 and ideal.downtime_s == 0


def test_downtime_longer_than_a_phase_leaves_it_empty_and_the_next_change_pays_again():
    t = simulate([10, 2, 10], [A, B, A], 1.0, constant(5))
    # B would start at 15 > 12: nothing in phase 2; A restarts at max(15, 12) + 5 = 20, runs until 22
    assert t.phase_steps == [10, 0, 2] and t.downtime_s == 10 and t.steps[-1].time_s == 22


def test_scale_makes_each_simulated_step_stand_for_that_many_steps():
    assert simulate([100], [A], 10.0).count == 10
    assert simulate([100], [A], 1.0).count == 100
    assert auto_scale([100, 100], [A, B], 15) == pytest.approx((100 / 1 + 100 / 2) / 15)
    with pytest.raises(ValueError):
        auto_scale([10], [WAIT], 5)
    with pytest.raises(ValueError):
        simulate([10], [A, B], 1.0)


def test_reconfiguration_model_by_hand():
    hw = load_hardware("h100-80g")  # 8 GPUs per host, storage 2 GB/s per host, restart 30 s
    before, after = run("A", 1.0, used=16), run("B", 1.0, used=8)
    # 1e9 parameters x 12 bytes = 12 GB: saved by 2 hosts (3 s), restart 30 s, loaded by 1 host (6 s)
    assert reconfiguration_s(10**9, hw, before, after) == pytest.approx(12 / 4 + 30 + 12 / 2)
    assert reconfiguration_s(10**9, hw, None, after) == pytest.approx(30 + 6)
    assert [hosts_of(n, 8) for n in (1, 8, 9, 16)] == [1, 1, 2, 2]
