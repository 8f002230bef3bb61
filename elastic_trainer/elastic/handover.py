"""The control channel of a planned reconfiguration: the launcher's store, a few keys per world.

The launcher hosts a TCPStore for the rendezvous anyway; it gives its agents ELASTIC_TRAINER_CONTROL=
HOST:PORT/JOB (the workers inherit it), and the launcher, the stopping world's rank 0 and the next world's
ranks talk through these keys, each under JOB/W/ for the world W (its rendezvous id, TORCHELASTIC_RUN_ID in
its ranks: one per start of a phase, so a phase re-formed on other hosts is a world of its own):

    first_step   N's first step is done: the launcher may start the next world beside it
    next         the launcher started the world M warm, beside N: N hands its state over in memory
    stop         the launcher asks N to stop after its current step (its phase's time is up, or its hosts
                 change and M, on the new ones, is ready): {"why": ..., "leaving": [N's hosts that go away]}
    ready        (M) built, connected and waiting: the launcher may now stop the current world
    state        (M) what M starts from: {"record": the in-memory state's record} once it is written, or
                 {"none": why} (the stopping world exited without one: M takes the newest checkpoint)
    loaded       (M) M has read the state ({"step": ...}), or {"gone": why}: the stopping world may release it

and one per host under JOB/notice/: a scheduler's notice that the host goes away (`notify`), which its
agent posts on SIGTERM and the launcher answers by re-forming the job without it (launch/notices.py).

Nothing here decides anything: `train.job` and the launcher's driver do.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from elastic_trainer.elastic.store_wait import poll_interval, wait_key

HOST_ENV = "ELASTIC_TRAINER_HOST"
"""The host's name in the hosts file (set by the launcher per host)."""
CONTROL_ENV = "ELASTIC_TRAINER_CONTROL"
WARM_ENV = "ELASTIC_TRAINER_WARM"
"""For the agents (and so the workers) of a world started beside the current one: `early` (build the model,
then wait for the state) or `late` (wait, then build: old and new would not fit on the device together)."""
PHASE_END = "the phase's time is up"
HOSTS_CHANGE = "the job's hosts change"
"""Why the launcher asks a world to stop (the `stop` key's "why"): both hand the state over to a waiting world."""


def host_name() -> str:
    """This host's name as the hosts file gives it (the launcher sets it), else the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


class Control:
    def __init__(self, store, job: str):
        self.store, self.job = store, job
        self.lost = False
        """The store stopped answering (the launcher is gone)."""

    @classmethod
    def from_environment(cls, timeout_s: float = 30.0) -> Control | None:
        """The launcher's store as a client, when this process was started by the launcher."""
        value = os.environ.get(CONTROL_ENV)
        if not value:
            return None
        from torch.distributed import TCPStore

        address, _, job = value.partition("/")
        host, _, port = address.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, job)

    @staticmethod
    def environment(address: str, job: str) -> dict[str, str]:
        return {CONTROL_ENV: f"{address}/{job}"}

    def _key(self, world, name: str) -> str:
        return f"elastic-trainer/{self.job}/{world}/{name}"

    # Every operation survives the launcher's death (its store gone): the ranks then learn of it from their
    # agents' SIGTERM and save as always, so a lost channel only means "no news".

    def set(self, world, name: str, value: dict | str = "") -> None:
        try:
            self.store.set(self._key(world, name), json.dumps(value))
        except (RuntimeError, OSError):
            self.lost = True

    def unset(self, world, name: str) -> None:
        try:
            self.store.delete_key(self._key(world, name))
        except (RuntimeError, OSError):
            self.lost = True

    def get(self, world, name: str):
        """The key's value, or None when it is not set or the store is gone (one round trip)."""
        if self.lost:
            return None
        key = self._key(world, name)
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except (RuntimeError, OSError):
            self.lost = True
            return None

    def wait(self, world, name: str, give_up=lambda: False, waiters: int = 1):
        """Block until the key is set (its value) or `give_up()` turns true or the store is gone (None);
        `waiters`: the ranks that wait for it together (they share a request rate: store_wait.poll_interval)."""
        key = self._key(world, name)
        if self.lost:
            return None
        try:
            set_ = wait_key(self.store, key, give_up, poll_interval(waiters))
            return json.loads(self.store.get(key)) if set_ else None
        except (RuntimeError, OSError):
            self.lost = True
            return None

    # -- notices: a host that will go away (a scheduler's SIGTERM to its agent, with a grace period) ---------

    def notify(self, host: str, grace_s: float) -> bool:
        """Post that `host` goes away within `grace_s` (False: the launcher's store did not answer)."""
        try:
            self.store.set(self._key("notice", host), json.dumps({"host": host, "grace_s": grace_s}))
            self.store.add(self._key("notice", "count"), 1)
            return True
        except (RuntimeError, OSError):
            self.lost = True
            return False

    def notices(self, seen: int, hosts) -> tuple[int, dict[str, dict]]:
        """(the notice count, the notices of `hosts`) — the second looked up only when the count passed `seen`
        (one round trip otherwise)."""
        try:
            count = self.store.add(self._key("notice", "count"), 0)
            if count == seen:
                return count, {}
            keys = {h: self._key("notice", h) for h in hosts}
            return count, {h: json.loads(self.store.get(k)) for h, k in keys.items() if self.store.check([k])}
        except (RuntimeError, OSError):
            self.lost = True
            return seen, {}


@dataclass
class Handover:
    """One world's side of the channel, as the job loop uses it."""

    control: Control
    world: str
    """Its rendezvous id (TORCHELASTIC_RUN_ID)."""
    warm: bool
    """This world was started beside the current one: it waits for the state before it loads."""
    late: bool = False
    """It builds its model only once it has the state (the old world's is released by then)."""
    ranks: int = 1
    """The world's training ranks: each waits on the store, and together they keep to a request rate."""

    def stop_request(self) -> dict | None:
        """The launcher's request that this world stop after its step, or None: {"why": PHASE_END or
        HOSTS_CHANGE, "leaving": [its hosts that go away]}."""
        value = self.control.get(self.world, "stop")
        if value is None:
            return None
        value = value if isinstance(value, dict) else {}
        return {"why": value.get("why") or PHASE_END, "leaving": list(value.get("leaving") or [])}

    def successor(self) -> str | None:
        """The world waiting for this one's state (None: nobody waits)."""
        return self.control.get(self.world, "next")

    def handed_over(self) -> tuple[bool, int | None]:
        """Whether this world, asked to stop, has already given the next world its start (the `state` key: a
        state in memory, of the step returned, or none, the next world then loading the newest checkpoint).
        A world whose workers fail after that (their agent restarts them) must not train on beside the next
        one: the restart asks this first."""
        if self.stop_request() is None:
            return False, None
        successor = self.successor()
        given = self.control.get(successor, "state") if successor else None
        if not isinstance(given, dict):
            return False, None
        record = given.get("record")
        return True, record.get("step") if isinstance(record, dict) else None

    def first_step_done(self) -> None:
        self.control.set(self.world, "first_step")

    def ready(self) -> None:
        self.control.set(self.world, "ready")

    def wait_state(self, give_up) -> dict | None:
        return self.control.wait(self.world, "state", give_up, self.ranks)

    def hand_over(self, successor: str, record: dict | None, why: str = "") -> None:
        self.control.set(successor, "state", {"record": record} if record else {"none": why})

    def loaded(self, step: int) -> None:
        self.control.set(self.world, "loaded", {"step": step})

    def wait_loaded(self, successor: str, give_up) -> dict | None:
        return self.control.wait(successor, "loaded", give_up, self.ranks)

    def wait_first_step(self, successor: str, give_up) -> None:
        self.control.wait(successor, "first_step", give_up, self.ranks)
