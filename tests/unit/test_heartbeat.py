"""Frozen-host detection (launch/heartbeat.py) on a real TCPStore, the launcher's clock replaced by a hand-moved
one: a host is silent only after it has beaten and then not for longer than the timeout; a cut reaches every
other agent's beat once and the cut host's own as a fence."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed import TCPStore

from elastic_trainer.cli_parser import HANG_TIMEOUT
from elastic_trainer.launch import heartbeat

PREFIX = "elastic_trainer/job-p0"


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Calls:
    def __init__(self):
        self.cuts, self.fenced = 0, 0

    def cut(self):
        self.cuts += 1

    def fence(self):
        self.fenced += 1


def beat(store, host: str, calls: Calls) -> heartbeat.Beat:
    return heartbeat.Beat(store, PREFIX, host, calls.cut, calls.fence)


def test_silent_after_the_timeout_from_the_last_beat(store):
    clock = Clock()
    watch = heartbeat.Watch(store, PREFIX, ["a", "b", "late"], 10.0, clock)
    a, b = beat(store, "a", Calls()), beat(store, "b", Calls())
    a.beat_once(), b.beat_once()
    assert watch.silent() == {}
    for _ in range(12):  # a beats every second, b stopped after its first beat; "late" never started
        clock.now += 1.0
        a.beat_once()
        assert watch.silent() == ({"b": pytest.approx(clock.now - 100.0)} if clock.now - 100.0 > 10 else {})
    clock.now += 0.5
    assert watch.silent(exclude={"b"}) == {}
    assert watch.silent() == {}  # read at most every READ_EVERY_S: the same instant reads nothing
    clock.now += 0.5
    assert watch.silent() == {"b": pytest.approx(clock.now - 100.0)}
    b.beat_once()  # it answers again before it was cut: it is not silent any more
    clock.now += 0.5
    assert watch.silent() == {}


def test_no_timeout_watches_nothing(store):
    clock = Clock()
    watch = heartbeat.Watch(store, PREFIX, ["a"], 0, clock)
    beat(store, "a", Calls()).beat_once()
    clock.now += 1e6
    assert watch.silent() == {}


def test_a_cut_reaches_the_others_once_and_fences_the_cut_host(store):
    clock = Clock()
    watch = heartbeat.Watch(store, PREFIX, ["a", "b", "c"], 10.0, clock)
    calls = {h: Calls() for h in "abc"}
    beats = {h: beat(store, h, calls[h]) for h in "abc"}
    for b in beats.values():
        assert b.beat_once()
    assert watch.silent() == {}  # the launcher's clock starts at the beat it sees
    clock.now += 11
    beats["a"].beat_once(), beats["b"].beat_once()
    assert watch.silent() == {"c": pytest.approx(11.0)}
    watch.cut("c")
    clock.now += 0.5
    assert watch.silent() == {}  # a cut host is no longer watched
    assert beats["a"].beat_once() and beats["b"].beat_once()
    assert beats["a"].beat_once()  # the same cut only once
    assert (calls["a"].cuts, calls["b"].cuts, calls["a"].fenced) == (1, 1, 0)
    assert not beats["c"].beat_once()  # woken up: it finds itself cut off
    assert (calls["c"].fenced, calls["c"].cuts) == (1, 0)
    late = beat(store, "d", Calls())  # an agent started after the cut does not take it for its own
    assert late.beat_once() and late.on_cut.__self__.cuts == 0


def test_workers_started_after_a_cut_are_not_cut(store):
    watch = heartbeat.Watch(store, PREFIX, ["a", "b"], 10.0, Clock())
    calls = Calls()
    a = beat(store, "a", calls)
    watch.cut("b")
    a.acknowledge()  # a's workers failed on their own (b's reset connections) and restarted in a round without b
    assert a.beat_once() and calls.cuts == 0
    watch.cut("c")
    assert a.beat_once() and calls.cuts == 1


def test_the_thread_beats_until_stopped(store):
    calls = Calls()
    b = heartbeat.Beat(store, PREFIX, "a", calls.cut, calls.fence, interval=0.01)
    b.start()
    while store.add(heartbeat.beat_key(PREFIX, "a"), 0) < 3:
        pass
    b.stop()
    b.join(timeout=5)
    assert not b.is_alive()


def test_hang_timeout_flag():
    assert HANG_TIMEOUT("0") == 0.0 and HANG_TIMEOUT("10") == 10.0 and HANG_TIMEOUT("3") == 3.0
    for bad in ("2", "-1", "nan", "x", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not 0 \\(off\\) or a finite number in"):
            HANG_TIMEOUT(bad)


class FakeProc:
    def __init__(self, code=None):
        self.returncode = code

    def poll(self):
        return self.returncode


def test_the_launcher_cuts_a_silent_host_and_not_one_that_finished(store):
    """driver._watch on a world of three agents: b stops beating (frozen), c exits 0 and so stops too (its
    workers finished before the others'); only b is cut off, killed, counted out and reported."""
    from elastic_trainer.launch import driver as driver_module
    from elastic_trainer.launch import live_hosts
    from elastic_trainer.launch.worlds import Agent, World

    clock = Clock()
    agents = {h: Agent(h, FakeProc(), None) for h in "abc"}
    world = World(0, "job-p0", PREFIX, list(agents.values()), [(h, 1) for h in "abc"], 0.0, False)
    world.watch = heartbeat.Watch(store, PREFIX, list(agents), 10.0, clock)
    live_hosts.publish(store, PREFIX, 3)
    calls = {h: Calls() for h in "abc"}
    beats = {h: beat(store, h, calls[h]) for h in "abc"}
    events, lines, killed = [], [], []
    d = driver_module.Driver.__new__(driver_module.Driver)
    d.events = type("Events", (), {"emit": lambda self, name, **f: events.append((name, f))})()
    d.say = lines.append
    d.processes = type("Processes", (), {"kill": staticmethod(lambda agents: killed.extend(a.host for a in agents))})()
    for b in beats.values():
        b.beat_once()
    d._watch(world, store)
    agents["c"].proc.returncode = 0
    for _ in range(11):
        clock.now += 1.0
        beats["a"].beat_once()
        d._watch(world, store)
    assert killed == ["b"] and world.gone == {"b"}
    assert store.add(f"{PREFIX}/hosts", 0) == 2
    assert events == [("host_lost", {"phase": 0, "host": "b", "reason": "frozen", "silent_s": 11.0, "hosts_left": 2})]
    assert lines == ["agent on b: no heartbeat for 11.0 s: cut off, the other hosts go on without it"]
    assert beats["a"].beat_once() and calls["a"].cuts == 1  # a's blocked workers are killed
