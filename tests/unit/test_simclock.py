"""The simulated clock against timelines worked out by hand, and the reconfiguration model's arithmetic: the
hand-over through host memory of a running job, the restart through storage after a wait."""

from __future__ import annotations

import pytest

from elastic_trainer.experiment.policy import Choice
from elastic_trainer.experiment.simclock import auto_scale, exchange_gb, hosts_of, reconfiguration_s, simulate
from elastic_trainer.plan import load_hardware


class FakeCandidate:
    """What the clock reads from a candidate: its layout (identity) and step time."""

    def __init__(self, name: str, step_time_s: float):
        self.layout, self.step_time_s = name, step_time_s


def run(name: str, seconds: float, used: int = 8) -> Choice:
    return Choice(used, used, FakeCandidate(name, seconds))  # type: ignore[arg-type]


WAIT = Choice(4, 0, None, "fewer than one replica")
A, B = run("A", 1.0), run("B", 2.0, used=16)


def constant(seconds: float):
    return lambda before, after, warm: seconds


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


def test_a_change_of_a_running_job_hands_over_warm_and_one_after_a_wait_restarts():
    calls = []

    def record(before, after, warm):
        calls.append((before.candidate.layout, after.candidate.layout, warm))
        return 1.0

    simulate([10, 10, 10, 10], [A, B, WAIT, A], 1.0, record)
    assert calls == [("A", "B", True), ("B", "A", False)]  # the state after the wait is B's, from storage


H100 = load_hardware("h100-80g")  # 8 GPUs per host; write 2.5, read 3 GB/s per rank; 40 GB/s between hosts; 3 s


def test_hand_over_across_hosts_by_hand():
    assert (H100.shm_write_gbs, H100.shm_read_gbs, H100.inter_host_gbs, H100.handover_setup_s) == (2.5, 3.0, 40.0, 3.0)
    two_hosts, one_host = run("A", 1.0, used=16), run("B", 1.0, used=8)
    # 1e9 parameters x 12 bytes = 12 GB. 16 -> 8: each of 16 ranks writes 0.75 GB (0.3 s); the kept host needs
    # all 12 GB and holds half: 6 GB from the other host, which sends its 6 GB (0.15 s at 40 GB/s); each of
    # 8 ranks reads 1.5 GB (0.5 s); 3 s set-up
    assert reconfiguration_s(10**9, H100, two_hosts, one_host) == pytest.approx(0.3 + 6 / 40 + 0.5 + 3)
    # 8 -> 16: 8 ranks write 1.5 GB (0.6 s); the added host needs its 6 GB, all from the old host; 16 ranks
    # read 0.75 GB (0.25 s)
    assert reconfiguration_s(10**9, H100, one_host, two_hosts) == pytest.approx(0.6 + 6 / 40 + 0.25 + 3)


def test_hand_over_within_a_host_by_hand():
    eight, four = run("A", 1.0, used=8), run("B", 1.0, used=4)
    # 8 ranks write 1.5 GB (0.6 s), nothing crosses hosts, 4 ranks read 3 GB (1 s), 3 s set-up
    assert reconfiguration_s(10**9, H100, eight, four) == pytest.approx(0.6 + 0 + 1.0 + 3)
    cpu = load_hardware("cpu")  # CPU ranks share the host: compute_units of its 8 ranks copy at once
    share = cpu.compute_units / 8
    assert reconfiguration_s(10**9, cpu, eight, four) == pytest.approx(
        12 / 8 / (cpu.shm_write_gbs * share)
        + 12 / 4 / (cpu.shm_read_gbs * cpu.compute_units / 4)
        + cpu.handover_setup_s
    )


def test_exchange_is_the_busiest_host_s_traffic():
    assert exchange_gb(12, 1, 1) == 0
    assert exchange_gb(12, 2, 1) == exchange_gb(12, 1, 2) == 6  # half the state crosses
    assert exchange_gb(12, 2, 2) == 3  # each host needs 6 GB, half of it held by the other
    assert exchange_gb(12, 4, 1) == 9  # the kept host receives 3/4 of 12 GB
    assert exchange_gb(12, 1, 4) == 9  # the one old host sends 3 GB to each of 3 added hosts


def test_after_a_wait_and_at_the_first_start_the_restart_model_by_hand():
    before, after = run("A", 1.0, used=16), run("B", 1.0, used=8)
    # 12 GB saved by 2 hosts at 2 GB/s (3 s), restart 30 s, loaded by 1 host (6 s)
    assert reconfiguration_s(10**9, H100, before, after, warm=False) == pytest.approx(12 / 4 + 30 + 12 / 2)
    assert reconfiguration_s(10**9, H100, None, after) == pytest.approx(30 + 6)
    assert [hosts_of(n, 8) for n in (1, 8, 9, 16)] == [1, 1, 2, 2]
