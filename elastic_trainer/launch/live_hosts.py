"""The launcher's count of a phase's live hosts, which the agents' rendezvous takes as its largest size.

TorchElastic's c10d rendezvous closes a round when `max_nodes` hosts have joined, or `last_call_timeout` after
`min_nodes` have. A phase starts with max_nodes = its hosts, so every host is waited for at the start (a slow ssh
login or a cold import on one host must not split the job), but after a host is lost the survivors can never
reach that number and waited out the whole last call (10 s) on every loss.

The launcher knows better: it started each host's agent and sees it exit. It keeps the count of the phase's
live hosts in its rendezvous store (`hosts`: set to the phase's hosts before they start, one less for every
agent that exits with a failure), and every agent's rendezvous uses min(max_nodes, that count) as its largest
size, so the survivors' round closes as soon as the last of them has joined. An agent the launcher did not
start (a host brought back by hand with the same command) counts itself in: agents take a ticket when they
start (`claims`), and a ticket beyond the phase's hosts (`started`) adds one to the count.

Only TorchElastic's own settings object changes class (a property in place of the field), and only where it is
the one this was written against; anything else leaves the rendezvous as torchrun has it, which is correct,
only slower after a loss.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

ENV = "ELASTIC_TRAINER_LAUNCHER_HOSTS"
"""Set by the launcher for its agents: the prefix of this phase's keys in its rendezvous store."""
REFRESH_S = 0.2


def host_store(job, say):
    """The rendezvous store, hosted by the launcher for the whole job (`job`: its JobSetup): no agent hosts it,
    so any host may be lost."""
    from torch.distributed import TCPStore

    from elastic_trainer.config import ConfigError

    try:
        store = TCPStore(
            job.endpoint_host() if job.iface else "0.0.0.0", job.opts.rdzv_port, is_master=True, wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise ConfigError(
            f"cannot host the rendezvous on port {job.opts.rdzv_port} ({e}); choose another with --rdzv-port"
        ) from None
    say(f"rendezvous: {job.endpoint_host()}:{store.port} (c10d, hosted by this launcher)")
    return store


def key_prefix(run_id: str) -> str:
    return f"elastic_trainer/{run_id}"


def publish(store, prefix: str, hosts: int) -> None:
    """Launcher side, before the phase's agents start."""
    store.set(f"{prefix}/started", str(hosts))
    store.set(f"{prefix}/hosts", str(hosts))


def lost(store, prefix: str) -> int:
    """Launcher side: one of the phase's agents exited with a failure; the count now."""
    return store.add(f"{prefix}/hosts", -1)


class LiveHosts:
    """Agent side: the count, read from the launcher's store at most every REFRESH_S seconds."""

    def __init__(self, endpoint: str, prefix: str, timeout_s: float = 10.0):
        from torch.distributed import TCPStore

        host, _, port = endpoint.rpartition(":")
        self._store = TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self._key = f"{prefix}/hosts"
        started = int(self._store.get(f"{prefix}/started"))
        if self._store.add(f"{prefix}/claims", 1) > started:  # not one of the launcher's: count it in
            self._store.add(self._key, 1)
        self._lock = threading.Lock()
        self._value: int | None = None
        self._read_at = 0.0

    def count(self) -> int | None:
        """The launcher's count of live hosts, or None when its store cannot be read (then: torchrun's size)."""
        with self._lock:
            if time.monotonic() - self._read_at >= REFRESH_S:
                try:
                    self._value = self._store.add(self._key, 0)
                except Exception:  # the launcher is gone: its count no longer means anything
                    self._value = None
                self._read_at = time.monotonic()
            return self._value


_settings_class = None


def _follow_class():
    """TorchElastic's RendezvousSettings with max_nodes capped by the launcher's count."""
    global _settings_class
    if _settings_class is None:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

        class LauncherCappedSettings(RendezvousSettings):
            @property
            def max_nodes(self) -> int:
                base = self.__dict__["max_nodes"]
                live = self.__dict__["_live_hosts"].count()
                return base if live is None else max(self.min_nodes, min(base, live))

        _settings_class = LauncherCappedSettings
    return _settings_class


def follow(handler, endpoint: str, prefix: str, timeout_s: float = 10.0) -> str | None:
    """Make `handler` (TorchElastic's c10d rendezvous handler of this agent) follow the launcher's count; None
    when it does, else why not (the rendezvous then stays as it is)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousSettings
    except ImportError as e:
        return f"no dynamic rendezvous in this torch ({e})"
    settings = getattr(handler, "_settings", None)
    if (
        not isinstance(handler, DynamicRendezvousHandler)
        or type(settings) is not RendezvousSettings
        or not isinstance(settings.__dict__.get("max_nodes"), int)
    ):
        return f"the rendezvous handler is a {type(handler).__name__}, not torch's c10d one"
    try:
        live = LiveHosts(endpoint, prefix, timeout_s)
    except Exception as e:  # noqa: BLE001 - whatever the store says, the rendezvous still works without it
        return f"the launcher's store at {endpoint} did not answer ({' '.join(str(e).split())[:200]})"
    object.__setattr__(settings, "_live_hosts", live)
    object.__setattr__(settings, "__class__", _follow_class())  # a frozen dataclass: past its __setattr__
    return None


def from_environment(handler, endpoint: str) -> str | None:
    """`follow` when the launcher asked for it (ENV set); None also when it did not."""
    prefix = os.environ.get(ENV)
    return follow(handler, endpoint, prefix) if prefix else None
