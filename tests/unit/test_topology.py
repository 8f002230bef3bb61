"""Where ranks sit on hosts: which group sizes stay within one host, for equal and unequal hosts, checked
against every order in which torchrun could number the hosts."""

from __future__ import annotations

import itertools

import pytest

from elastic_trainer.config import ConfigError, load_model_config
from elastic_trainer.plan import Request, load_hardware, plan
from elastic_trainer.plan.topology import Topology


def brute_within(sizes: tuple[int, ...], size: int) -> bool:
    """Every aligned group of `size` consecutive ranks on one host, for every order of the hosts."""
    world = sum(sizes)
    for order in set(itertools.permutations(sizes)):
        host_of = [h for h, n in enumerate(order) for _ in range(n)]
        if any(len(set(host_of[g : g + size])) != 1 for g in range(0, world, size)):
            return False
    return True


@pytest.mark.parametrize(
    "size, world, per_host, within",
    [
        (2, 16, 8, True),
        (8, 16, 8, True),
        (16, 16, 8, False),
        (3, 12, 8, False),
        (3, 6, 8, True),
        (6, 12, 8, False),
        (4, 12, 8, True),
    ],
)
def test_uniform_hosts(size, world, per_host, within):
    assert Topology.uniform(world, per_host).within(size) is within
    assert brute_within(Topology.uniform(world, per_host).sizes, size) is within


@pytest.mark.parametrize("sizes", [(3, 1), (1, 3), (4, 2), (2, 4, 6), (6, 3), (8, 8, 4), (5,), (2, 2, 2, 1)])
def test_unequal_hosts_match_every_rank_order(sizes):
    topo = Topology(sizes)
    for size in range(1, sum(sizes) + 1):
        if sum(sizes) % size == 0:
            assert topo.within(size) is brute_within(sizes, size), (sizes, size)


def test_describe_and_bad_sizes():
    assert Topology.uniform(16, 8).describe() == "8 per host"
    assert Topology((3, 1)).describe() == "3+1 per host"
    with pytest.raises(ConfigError):
        Topology((2, 0))
    with pytest.raises(ConfigError):
        Topology(())


def test_planner_keeps_tp_inside_unequal_hosts():
    """3+1 hosts: only tp=1 is valid even though 4 ranks on one host could use tp=2 or 4."""
    model, cpu = load_model_config("gpt-tiny"), load_hardware("h100-80g")
    one_host = plan(Request(model, 4, 8, 32, cpu, 4))
    assert {c.tp for c in one_host.candidates} == {1, 2, 4}
    split = plan(Request(model, 4, 8, 32, cpu, 3, host_sizes=(3, 1)))
    assert {c.tp for c in split.candidates} == {1}
    assert all("span hosts (3+1 per host)" in c.reason for c in split.rejected if c.tp > 1)
    assert {c.tp for c in plan(Request(model, 6, 12, 32, cpu, 4, host_sizes=(4, 2))).candidates} == {1, 2}


def test_host_sizes_must_hold_the_world():
    model, hw = load_model_config("gpt-tiny"), load_hardware("h100-80g")
    with pytest.raises(ConfigError, match=r"hosts with 3\+2 ranks do not hold world_size=4"):
        Request(model, 4, 8, 32, hw, 3, host_sizes=(3, 2))
