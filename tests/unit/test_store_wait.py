"""Waiting on the launcher's store: the hand-over's keys and the idle ranks' exit code are asked with `check`,
so a long wait writes nothing to the host's log. With `store.wait` sliced at 1 s, c10d's client logged two
warnings per slice (a warm world on an H100 wrote 2 lines a second per rank while it waited for its state)."""

from __future__ import annotations


def test_a_world_s_waiting_ranks_share_a_request_rate():
    from elastic_trainer.elastic.store_wait import STORE_REQUESTS_PER_S, poll_interval

    assert [poll_interval(n) for n in (1, 8, 32)] == [0.05] * 3  # small worlds: every 50 ms
    assert poll_interval(1024) == 1.6
    assert all(n / poll_interval(n) <= STORE_REQUESTS_PER_S for n in (1, 31, 32, 33, 500, 4096))
