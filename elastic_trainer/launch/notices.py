"""Changes of the job's hosts that the launcher hears of before they happen, so that it can re-form the job on
the new hosts through a warm start and a hand-over in memory instead of losing a world.

Two sources:
- **a scheduler's notice**: SIGTERM to a host's agent (what Kubernetes sends a pod it deletes, what a spot
  instance's termination handler or Slurm sends a host it takes back). The agent does not stop its workers
  at once: it posts the notice on the launcher's store (`Control.notify`). The launcher starts a world without
  the host and stops the current one when that is ready, or a quarter of the grace period (`--notice-grace-s`,
  default 30 s) after the notice, whichever comes first; the stopping ranks write the durable checkpoint right
  after the state in memory, so nothing depends on the host living until the next world has loaded. Half the
  grace period after the notice, or at once when the launcher does not answer, the agent stops its workers as
  TorchElastic does (they save to the checkpoint folder, if still training).
- **the hosts file**: the launcher reads it again whenever it changes. A host removed from it leaves the job,
  a host added joins it, both as a planned reconfiguration. This is the discovery channel of a hosts-file job:
  whatever knows the cluster (a person, a cluster's agent, a script) edits the file.

A host that gave notice stays out of the job until the hosts file lists it again after a version without it.
What the launcher does with a change is the driver's (`Driver._reform`): the current phase goes on in a world
on the new hosts, started beside the current one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from elastic_trainer.launch.hosts import Host, HostsError, read_hosts

NOTICE_GRACE_ENV = "ELASTIC_TRAINER_NOTICE_GRACE_S"
"""For the launcher's agents: seconds between a scheduler's SIGTERM and its SIGKILL (--notice-grace-s)."""
DEFAULT_GRACE_S = 30.0
"""Kubernetes' default terminationGracePeriodSeconds."""


@dataclass
class Change:
    hosts: list[Host]
    """The job's hosts from now on."""
    why: str
    """One line: which hosts leave or join, and how the launcher heard of it."""
    deadline: float | None = None
    """time.time() by which the current world must have stopped (a notice's grace); None: no hurry."""


@dataclass
class Notices:
    path: str
    default_slots: int
    hosts: list[Host]
    """The hosts as the launcher uses them now."""
    _stamp: tuple | None = None
    _file: list[Host] = field(default_factory=list)
    """The hosts the file lists (its last readable version)."""
    _noticed: dict[str, bool] = field(default_factory=dict)
    """{host that gave notice: whether a version of the file without it was seen since}."""
    _seen: int = 0
    _bad: str | None = None

    def __post_init__(self):
        self._stamp = self._file_stamp()
        self._file = list(self.hosts)

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def poll(self, control, say) -> Change | None:
        """One look at both sources (one round trip and one stat): the change, if any (`say`: a line for the
        user, when the edited file cannot be used)."""
        reasons, deadline = [], None
        count, posted = control.notices(self._seen, [h.name for h in self._file])
        self._seen = count
        for host, notice in posted.items():
            if host not in self._noticed:
                self._noticed[host] = False
                grace = float(notice.get("grace_s", DEFAULT_GRACE_S))
                deadline = min(deadline or float("inf"), time.time() + grace / 4)
                reasons.append(f"{host} gave notice (SIGTERM to its agent, {grace:g} s of grace)")
        stamp = self._file_stamp()
        if stamp != self._stamp and stamp is not None:
            self._stamp = stamp
            reasons += self._reread(say)
        hosts = [h for h in self._file if h.name not in self._noticed]
        if [(h.name, h.slots) for h in hosts] == [(h.name, h.slots) for h in self.hosts]:
            return None
        self.hosts = hosts
        return Change(hosts, "; ".join(reasons) or "the hosts changed", deadline)

    def _reread(self, say) -> list[str]:
        try:
            listed = read_hosts(self.path, self.default_slots)
        except HostsError as e:
            if str(e) != self._bad:
                say(f"the hosts file changed but cannot be used ({e}); the job keeps its hosts")
            self._bad = str(e)
            return []
        self._bad = None
        names = {h.name for h in listed}
        for host in list(self._noticed):
            if host not in names:
                self._noticed[host] = True
            elif self._noticed[host]:  # listed again after a version without it: it is back
                del self._noticed[host]
        before = {h.name for h in self._file}
        left, joined = sorted(before - names), [h.name for h in listed if h.name not in before]
        self._file = listed
        return ([f"{', '.join(left)} left the hosts file"] if left else []) + (
            [f"{', '.join(joined)} joined the hosts file"] if joined else []
        )


def take_sigterm_as_notice(config, stop_signal: int) -> None:
    """In a launcher's agent (`config`: TorchElastic's launch config, before it starts): SIGTERM becomes a notice
    to the launcher that this host goes away. The workers keep training; the launcher re-forms the job without
    this host and asks them to stop and hand their state over. Half the grace period later, on a second
    SIGTERM, or at once when the launcher's store does not answer, the agent does what TorchElastic does with
    SIGTERM: it stops its workers, which save to the checkpoint folder. `stop_signal` (which the launcher's
    death and the launcher itself send) does that at once."""
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    from elastic_trainer.elastic.handover import Control, host_name

    noticed = []
    grace = float(os.environ.get(NOTICE_GRACE_ENV) or DEFAULT_GRACE_S)

    def notify() -> bool:
        if noticed:
            return False
        try:
            control = Control.from_environment(timeout_s=2.0)
        except (RuntimeError, OSError, ValueError):
            return False
        return control is not None and control.notify(host_name(), grace)

    def on_sigterm(signum, frame) -> None:
        if not notify():
            _terminate_process_handler(signum, frame)  # raises: TorchElastic stops the workers
        noticed.append(time.time())
        print(
            f"[agent] SIGTERM: the launcher was told that {host_name()} goes away and re-forms the job without "
            f"it; the ranks here stop by themselves in {grace / 2:g} s otherwise",
            file=sys.stderr,
            flush=True,
        )
        timer = threading.Timer(grace / 2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    config.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"  # TorchElastic's, for its workers' start: SIGTERM is ours
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(stop_signal, lambda signum, frame: _terminate_process_handler(signal.SIGTERM, frame))
