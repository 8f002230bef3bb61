"""The launcher's view of the processes it runs: one host's agent, one phase's world of agents, and how a
phase ended."""

from __future__ import annotations

import signal
import subprocess
import threading
from dataclasses import dataclass, field


@dataclass
class Agent:
    host: str
    proc: subprocess.Popen
    pump: threading.Thread


@dataclass
class World:
    """The agents of one phase's start."""

    index: int
    prefix: str
    """Its live-hosts keys in the store."""
    agents: list[Agent]
    launched: float
    warm: bool
    began: float = 0.0
    """When it became the world that trains (a warm world is launched before)."""
    gone: set[str] = field(default_factory=set)
    bad_since: float | None = None

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
