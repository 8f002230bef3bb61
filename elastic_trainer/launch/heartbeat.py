"""Frozen hosts cut off in seconds: each agent's heartbeat in the launcher's store, and what follows its silence.

A host that dies is seen at once (its agent exits; `driver._watch`). A host that hangs instead (a frozen kernel,
its processes stopped, a cable pulled) exits nothing: ssh stays up, and the other hosts' ranks block inside a
collective until the backend's timeout (30 min for gloo, 10 for NCCL). So every agent of a launcher's job adds
one to its counter in the launcher's store every BEAT_S seconds (`Beat`, a thread of the agent), and the launcher
(`Watch`) declares a host gone once its counter has not moved for the hang timeout (`--hang-timeout-s`, default
10 s; 0: off), measured on the launcher's own clock, so no two hosts' clocks are compared.

The heartbeat is the agent's, not the training loop's: a slow step (a long checkpoint write, a first step that
compiles, an evaluation) runs in the workers and never stops it, so no length of step is taken for a hang. What
stops it is what stops a whole host: its processes stopped, its kernel frozen, its network gone. A host is
watched from its first beat on (before that its agent is still starting: an ssh login, a cold import).

Cutting a host off (`Watch.cut`): the launcher marks it gone in the store (`gone/HOST`), lowers the count of live
hosts (so the survivors' next rendezvous round closes without it), adds one to `cuts`, and kills the host's agent
and workers where they are local processes (a stopped process still takes SIGKILL). The survivors' workers are
blocked in a collective with the frozen host and would wait out the backend's timeout: each surviving agent reads
`cuts` with its beat and, when it has moved since its workers started, kills them. TorchElastic restarts them in
the next round, without the frozen host, and they resume as after any lost host (where the frozen workers were
killed, their reset connections usually fail the survivors' workers first). An agent on another host that wakes
after it was cut off reads its own `gone` key at its next beat, kills its workers and exits without letting them
save (`EXIT_FENCED`): it never rejoins the world that went on without it, and a new launch may take the host
again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

ENV = "ELASTIC_TRAINER_HANG_TIMEOUT_S"
"""Set by the launcher for its agents: the hang timeout in seconds (0 or unset: no heartbeat)."""
BEAT_S = 1.0
"""Seconds between an agent's beats. The launcher's hang timeout must be a few of them (the CLI's least: 3)."""


def beat_key(prefix: str, host: str) -> str:
    return f"{prefix}/beat/{host}"


def gone_key(prefix: str, host: str) -> str:
    return f"{prefix}/gone/{host}"


def cuts_key(prefix: str) -> str:
    return f"{prefix}/cuts"


class Watch:
    """Launcher side, one per world: the hosts whose agents have beaten at least once and not since
    `timeout_s` seconds."""

    def __init__(self, store, prefix: str, hosts: list[str], timeout_s: float, clock: Callable[[], float] = None):
        self.store, self.prefix, self.timeout_s = store, prefix, timeout_s
        self.clock = clock or time.monotonic
        self._seen: dict[str, tuple[int, float]] = {h: (0, self.clock()) for h in hosts}
        """host -> (its counter, when the launcher saw it change)."""
        self._read_at: float | None = None

    READ_EVERY_S = BEAT_S / 4
    """The counters are read at most this often (the launcher polls its world every 0.1 s)."""

    def silent(self, exclude: set[str] = frozenset()) -> dict[str, float]:
        """{host: seconds since its last beat} for each watched host silent for longer than the timeout."""
        if self.timeout_s <= 0:
            return {}
        now, out = self.clock(), {}
        if self._read_at is not None and now - self._read_at < self.READ_EVERY_S:
            return out
        self._read_at = now
        for host, (count, since) in self._seen.items():
            if host in exclude:
                continue
            now_count = self.store.add(beat_key(self.prefix, host), 0)
            if now_count != count:
                self._seen[host] = (now_count, now)
            elif count > 0 and now - since > self.timeout_s:
                out[host] = now - since
        return out

    def cut(self, host: str) -> None:
        """Mark `host` gone and tell the other agents to restart their workers without it."""
        self.store.set(gone_key(self.prefix, host), "1")
        self.store.add(cuts_key(self.prefix), 1)
        self._seen.pop(host, None)


class Beat(threading.Thread):
    """Agent side: beats every `interval` seconds; `on_cut()` when the launcher has cut another host off,
    `on_fenced()` (which should not return) when it has cut this one off."""

    def __init__(
        self,
        store,
        prefix: str,
        host: str,
        on_cut: Callable[[], None],
        on_fenced: Callable[[], None],
        interval: float = BEAT_S,
    ):
        super().__init__(name="elastic-trainer-heartbeat", daemon=True)
        self.store, self.prefix, self.host, self.interval = store, prefix, host, interval
        self.on_cut, self.on_fenced = on_cut, on_fenced
        self._cuts = store.add(cuts_key(prefix), 0)
        self._lock = threading.Lock()
        self._done = threading.Event()

    def acknowledge(self) -> None:
        """The agent starts workers in a round that closed after every cut made so far (a frozen host cannot
        join a round): those cuts are not theirs to act on. Without this, workers that failed on their own (a
        cut host's processes killed reset their connections) and were restarted at once would be killed again
        by the beat that reads the cut after them."""
        with self._lock:
            self._cuts = self.store.add(cuts_key(self.prefix), 0)

    def beat_once(self) -> bool:
        """One beat; False once this host is cut off (after `on_fenced`)."""
        self.store.add(beat_key(self.prefix, self.host), 1)
        if self.store.check([gone_key(self.prefix, self.host)]):
            self.on_fenced()
            return False
        with self._lock:
            cuts = self.store.add(cuts_key(self.prefix), 0)
            if cuts != self._cuts:
                self._cuts = cuts
                self.on_cut()
        return True

    def run(self) -> None:
        while not self._done.is_set():
            try:
                if not self.beat_once():
                    return
            except Exception:  # noqa: BLE001 - the launcher's store unreachable: its own death or a partition
                pass  # stay silent: the launcher (if any) cuts this host off; its death stops the agent anyway
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()


def kill_workers(pids) -> None:
    """SIGKILL each worker pid that still exists (they are blocked in a collective; nothing of theirs is
    worth waiting for)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_for_agent(agent, endpoint: str) -> Beat | None:
    """The heartbeat of a launcher's agent (TorchElastic's LocalElasticAgent `agent`), when the launcher asked
    for one (ENV, and the live-hosts prefix); None otherwise."""
    from torch.distributed import TCPStore

    from elastic_trainer.elastic.exit_codes import EXIT_FENCED
    from elastic_trainer.elastic.handover import host_name
    from elastic_trainer.launch import live_hosts

    prefix = os.environ.get(live_hosts.ENV)
    timeout = float(os.environ.get(ENV) or 0)
    if not prefix or timeout <= 0:
        return None
    host, _, port = endpoint.rpartition(":")

    def workers() -> list[int]:
        context = getattr(agent, "_pcontext", None)
        return list(context.pids().values()) if context is not None else []

    def on_cut() -> None:
        print("[agent] another host stopped answering: restarting the workers without it", file=sys.stderr, flush=True)
        kill_workers(workers())

    def on_fenced() -> None:
        print(
            "[agent] this host was cut off after it stopped answering; the job went on without it: exiting",
            file=sys.stderr,
            flush=True,
        )
        kill_workers(workers())
        os._exit(EXIT_FENCED)

    try:
        store = TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        beat = Beat(store, prefix, host_name(), on_cut, on_fenced)
    except Exception as e:  # noqa: BLE001 - without it the job runs, only a hang goes unnoticed
        why = " ".join(str(e).split())[:200]
        print(f"[agent] warning: no heartbeat, a hang of this host goes unnoticed: {why}", file=sys.stderr, flush=True)
        return None
    beat.start()
    return beat
