"""The launcher's view of the processes it runs: one host's agent, one start of a phase (a world of agents),
how a phase ended, and the starting and stopping of agents (`Processes`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field

from elastic_trainer.launch.agent import LAUNCHER_GONE, PARKED
from elastic_trainer.launch.commands import AgentSpec, Placement


@dataclass
class Agent:
    host: str
    proc: subprocess.Popen
    pump: threading.Thread


@dataclass
class World:
    """The agents of one phase's start."""

    index: int
    key: str
    """Its rendezvous id: its keys on the control channel (elastic/handover.py)."""
    prefix: str
    """Its live-hosts keys in the store."""
    agents: list[Agent]
    placed: list[tuple[str, int]]
    """(host, ranks) as launched."""
    launched: float
    warm: bool
    began: float = 0.0
    """When its phase began to train (a warm world is launched before; a re-formed one goes on with the clock
    of the world it replaces)."""
    gone: set[str] = field(default_factory=set)
    bad_since: float | None = None
    reform_by: float | None = None
    """Its hosts changed (launch/notices.py): stop it once its replacement is ready, at the latest then."""
    leaving: list[str] = field(default_factory=list)
    """Its hosts that the change takes away."""
    watch: object = None
    """Its agents' heartbeats (launch/heartbeat.Watch)."""

    def alive(self) -> bool:
        return any(a.proc.poll() is None for a in self.agents)


@dataclass
class PhaseOutcome:
    codes: dict[str, int]
    stop_requested: bool
    interrupted: bool = False
    handed_over: bool = False
    """The next phase's world took the state over (and trains): this phase's world finishes meanwhile."""


def codes_line(codes: dict[str, int]) -> str:
    """`agent on HOST: exit code N` (or `killed by SIGNAL`) for each host, in one line."""

    def describe(code: int) -> str:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    return ", ".join(f"agent on {host}: {describe(code)}" for host, code in codes.items())


@dataclass
class Processes:
    """Starting agents (parked ones first: a parked agent imported the training stack while the job trained)
    and stopping them."""

    job: object
    out: object
    parked: dict = field(default_factory=dict)
    """{host: an agent started ahead of its world} (local hosts, with warm starts)."""

    def park(self, index: int) -> None:
        """Start an agent, parked, on each local host of phase `index` that has none: it imports the training
        stack while the job trains and takes its command line when its world is launched (agent.unpark)."""
        job = self.job
        if index >= len(job.phases) or job.phases[index].waits or not job.opts.warm_start:
            return
        for placement in job.placements(job.phases[index]):
            if placement.local and placement.host.name not in self.parked:
                argv, env = job.command(placement, None)
                self.parked[placement.host.name] = self.spawn(placement.host.name, [*argv[:3], PARKED], env)

    def start(self, placement: Placement, spec: AgentSpec, extra_env: dict[str, str]) -> Agent:
        parked = self.parked.pop(placement.host.name, None) if placement.local else None
        argv, env = self.job.command(placement, spec, extra_env)
        if parked is not None and parked.proc.poll() is None:
            parked.proc.stdin.write((json.dumps({"argv": argv[3:], "env": env}) + "\n").encode())
            parked.proc.stdin.flush()
            return parked
        return self.spawn(placement.host.name, argv, env)

    def spawn(self, host: str, argv: list[str], env: dict[str, str]) -> Agent:
        # stdin stays an open pipe: a remote host's bootstrap stops its agent when the pipe closes
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        pump = threading.Thread(target=self.out.pump, args=(host, proc.stdout), daemon=True)
        pump.start()
        return Agent(host, proc, pump)

    @staticmethod
    def terminate(agents: list[Agent]) -> None:
        """Stop agents as the launcher's death would: LAUNCHER_GONE (not SIGTERM, which is a scheduler's notice)
        to a local agent, which stops its workers; to ssh, which closes, and remote.sh sends it on."""
        for a in agents:
            if a.proc.poll() is None:
                a.proc.send_signal(LAUNCHER_GONE)
                a.proc.stdin.close()

    @staticmethod
    def kill(agents: list[Agent]) -> None:
        """SIGKILL agents and whatever shares their process group (a local agent's workers; ssh for a remote
        one): for hosts cut off, which may be stopped and would never act on a gentler signal."""
        for a in agents:
            try:
                os.killpg(a.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """The parked agents still waiting: their stdin closed, they exit without starting anything."""
        for parked in self.parked.values():
            self.terminate([parked])
            parked.pump.join()
        self.parked.clear()
