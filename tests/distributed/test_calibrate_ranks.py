"""calibrate's measurements that need ranks: the collective shares, measured on forked gloo ranks."""

from __future__ import annotations

from elastic_trainer.parallel import calibrate


def test_collective_shares_measured_on_ranks(monkeypatch):
    """The real calls on 2 forked gloo ranks: positive shares (their values are this machine's)."""
    gather, scatter = calibrate.measure_collective_shares([2], [2**16], repeat=1)
    assert gather > 0 and scatter > 0
