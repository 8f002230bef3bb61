"""The launcher's count of live hosts as the agents' rendezvous size (launch/live_hosts.py), on TorchElastic's own
c10d rendezvous handlers talking to a real TCPStore: a round that would wait out its last call closes as soon
as the hosts the launcher counts have joined."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_trainer.launch import live_hosts

LAST_CALL_S = 60  # what a round with fewer than max_nodes hosts would wait without the launcher's count


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def handler(store: TCPStore, run_id: str, addr: str, max_nodes: int = 2, min_nodes: int = 1):
    params = RendezvousParameters(
        "c10d",
        f"127.0.0.1:{store.port}",
        run_id,
        min_nodes,
        max_nodes,
        local_addr=addr,
        is_host="false",
        last_call_timeout=str(LAST_CALL_S),
        join_timeout="120",
        keep_alive_interval="1",
        keep_alive_max_attempt="2",
    )
    return get_rendezvous_handler(params)


def endpoint(store: TCPStore) -> str:
    return f"127.0.0.1:{store.port}"


def test_the_size_follows_the_launchers_count(store):
    prefix = live_hosts.key_prefix("job-p0")
    live_hosts.publish(store, prefix, 3)
    h = handler(store, "job-p0", "127.0.0.1", max_nodes=3, min_nodes=2)
    assert live_hosts.follow(h, endpoint(store), prefix) is None
    settings = h._settings
    assert settings.max_nodes == 3 and settings.min_nodes == 2
    assert live_hosts.lost(store, prefix) == 2
    time.sleep(live_hosts.REFRESH_S)
    assert settings.max_nodes == 2
    live_hosts.lost(store, prefix)
    time.sleep(live_hosts.REFRESH_S)
    assert settings.max_nodes == 2  # never below min_nodes: too few hosts left waits, as torchrun would
    assert live_hosts.lost(store, prefix) == 0


def test_an_agent_the_launcher_did_not_start_counts_itself_in(store):
    prefix = live_hosts.key_prefix("job-p1")
    live_hosts.publish(store, prefix, 2)
    live_hosts.LiveHosts(endpoint(store), prefix)
    live_hosts.LiveHosts(endpoint(store), prefix)  # the launcher's two agents: the count stays
    assert live_hosts.lost(store, prefix) == 1  # one of them is lost
    back = live_hosts.LiveHosts(endpoint(store), prefix)  # the host comes back, started by hand
    assert back.count() == 2


def test_a_survivor_does_not_wait_for_a_lost_host(store, monkeypatch):
    """A round of max 2 hosts with only one left: torchrun's rendezvous would close it LAST_CALL_S after the
    first join; with the launcher's count at 1 it closes at once, with the survivor alone."""
    prefix = live_hosts.key_prefix("job-p2")
    live_hosts.publish(store, prefix, 2)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher's agents run
    survivor = handler(store, "job-p2", "127.0.0.1")
    assert live_hosts.follow(survivor, endpoint(store), prefix) is None
    live_hosts.lost(store, prefix)
    result = {}
    thread = threading.Thread(target=lambda: result.update(info=survivor.next_rendezvous()), daemon=True)
    thread.start()
    thread.join(LAST_CALL_S / 2)
    assert not thread.is_alive(), "the survivor waited for the lost host"
    assert (result["info"].rank, result["info"].world_size) == (0, 1)
    survivor.shutdown()


def test_without_the_launchers_keys_the_rendezvous_is_left_alone(store):
    h = handler(store, "job-p3", "127.0.0.1")
    reason = live_hosts.follow(h, endpoint(store), live_hosts.key_prefix("job-p3"), timeout_s=0.5)
    assert reason and "did not answer" in reason  # no count published: a launcher of an older version
    assert type(h._settings).__name__ == "RendezvousSettings" and h._settings.max_nodes == 2
    assert "not torch's c10d one" in live_hosts.follow(object(), endpoint(store), "x")
