"""The control channel of a planned reconfiguration: the launcher's store, a few keys per phase.

The launcher hosts a TCPStore for the rendezvous anyway; it gives its agents ELASTIC_TRAINER_CONTROL=
HOST:PORT/JOB (the workers inherit it), and the launcher, the stopping world's rank 0 and the next world's
ranks talk through these keys, each under JOB/pN/ for the world of phase N:

    first_step   N's first step is done: the launcher may start the next world beside it
    next         the launcher started the world of phase M warm, beside N: N hands its state over in memory
    stop         the launcher asks N to stop after its current step (its phase's time is up)
    ready        (M) built, connected and waiting: the launcher may now stop the current world
    state        (M) what M starts from: {"record": the in-memory state's record} once it is written, or
                 {"none": why} (the stopping world exited without one: M takes the newest checkpoint)
    loaded       (M) M has read the state ({"step": ...}), or {"gone": why}: the stopping world may release it

Nothing here decides anything: `train.job` and the launcher's driver do.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

HOST_ENV = "ELASTIC_TRAINER_HOST"
"""The host's name in the hosts file (set by the launcher per host)."""
CONTROL_ENV = "ELASTIC_TRAINER_CONTROL"
WARM_ENV = "ELASTIC_TRAINER_WARM"
"""For the agents (and so the workers) of a world started beside the current one: `early` (build the model,
then wait for the state) or `late` (wait, then build: old and new would not fit on the device together)."""
WAIT_SLICE_S = 1.0
"""How long one blocking wait on the store lasts before the waiter checks whether it was asked to stop."""


def host_name() -> str:
    """This host's name as the hosts file gives it (the launcher sets it), else the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


class Control:
    def __init__(self, store, job: str):
        self.store, self.job = store, job
        self.lost = False
        """The store stopped answering (the launcher is gone)."""

    @classmethod
    def from_environment(cls) -> "Control | None":
        """The launcher's store as a client, when this process was started by the launcher."""
        value = os.environ.get(CONTROL_ENV)
        if not value:
            return None
        from torch.distributed import TCPStore

        address, _, job = value.partition("/")
        host, _, port = address.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        return cls(store, job)

    @staticmethod
    def environment(address: str, job: str) -> dict[str, str]:
        return {CONTROL_ENV: f"{address}/{job}"}

    def _key(self, phase: int, name: str) -> str:
        return f"elastic-trainer/{self.job}/p{phase}/{name}"

    # Every operation survives the launcher's death (its store gone): the ranks then learn of it from their
    # agents' SIGTERM and save as always, so a lost channel only means "no news".

    def set(self, phase: int, name: str, value: dict | str = "") -> None:
        try:
            self.store.set(self._key(phase, name), json.dumps(value))
        except (RuntimeError, OSError):
            self.lost = True

    def unset(self, phase: int, name: str) -> None:
        try:
            self.store.delete_key(self._key(phase, name))
        except (RuntimeError, OSError):
            self.lost = True

    def get(self, phase: int, name: str):
        """The key's value, or None when it is not set or the store is gone (one round trip)."""
        if self.lost:
            return None
        key = self._key(phase, name)
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except (RuntimeError, OSError):
            self.lost = True
            return None

    def wait(self, phase: int, name: str, give_up=lambda: False):
        """Block until the key is set (its value) or `give_up()` turns true or the store is gone (None)."""
        key = self._key(phase, name)
        while not give_up() and not self.lost:
            try:
                self.store.wait([key], timedelta(seconds=WAIT_SLICE_S))
                return json.loads(self.store.get(key))
            except (RuntimeError, OSError) as e:
                if "timeout" not in str(e).lower():  # a slice that timed out goes on; anything else is the end
                    self.lost = True
        return None


@dataclass
class Handover:
    """One world's side of the channel (its phase), as the job loop uses it."""

    control: Control
    phase: int
    warm: bool
    """This world was started beside the current one: it waits for the state before it loads."""
    late: bool = False
    """It builds its model only once it has the state (the old world's is released by then)."""

    def asked_to_stop(self) -> bool:
        return self.control.get(self.phase, "stop") is not None

    def successor(self) -> int | None:
        """The phase of the world waiting for this one's state (None: nobody waits)."""
        value = self.control.get(self.phase, "next")
        return None if value is None else int(value)

    def first_step_done(self) -> None:
        self.control.set(self.phase, "first_step")

    def ready(self) -> None:
        self.control.set(self.phase, "ready")

    def wait_state(self, give_up) -> dict | None:
        return self.control.wait(self.phase, "state", give_up)

    def hand_over(self, successor: int, record: dict | None, why: str = "") -> None:
        self.control.set(successor, "state", {"record": record} if record else {"none": why})

    def loaded(self, step: int) -> None:
        self.control.set(self.phase, "loaded", {"step": step})

    def wait_loaded(self, successor: int, give_up) -> dict | None:
        return self.control.wait(successor, "loaded", give_up)

    def wait_first_step(self, successor: int, give_up) -> None:
        self.control.wait(successor, "first_step", give_up)
