"""The simulated clock: when each step of a policy's run ends under a schedule of timed phases, if every step
took the planner's predicted time of the target model on the target hardware and every reconfiguration took
the modelled time of saving, restarting and loading the target's training state.

Rules (the runtime's, in time): a phase's allocation starts at its boundary; a job that changes what it runs
on (GPU count or layout) first pays the reconfiguration; a stop request lets the step in flight finish, so a
step that crosses a boundary ends late and the next phase starts that much later (nothing is rounded away);
a phase without a choice (the policy waits) trains nothing; consecutive phases with the same choice run
through without a restart. `scale` compresses the step count: one simulated step stands for `scale` steps of
the target (it takes `scale` times the predicted step time), while phase lengths and reconfiguration times
stay at full scale, so every ratio is kept. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from elastic_trainer.plan.hardware import Hardware
from elastic_trainer.experiment.policy import Choice

STATE_BYTES_PER_PARAM = 12
"""What a checkpoint holds per parameter: fp32 master weights and AdamW's two fp32 moments."""


@dataclass(frozen=True)
class SimStep:
    step: int
    """Global step number (1-based: the step that just ended)."""
    time_s: float
    """When it ended, seconds from the start of the schedule."""
    phase: int
    downtime_s: float
    """Reconfiguration time charged just before this step (0 for most steps)."""


@dataclass(frozen=True)
class Timeline:
    steps: list[SimStep]
    downtime_s: float
    """Total reconfiguration time charged."""
    phase_steps: list[int]
    """Steps that started in each phase."""

    @property
    def count(self) -> int:
        return len(self.steps)


def hosts_of(used: int, gpus_per_host: int) -> int:
    return max(1, math.ceil(used / gpus_per_host))


def reconfiguration_s(n_params: int, hw: Hardware, before: Choice | None, after: Choice) -> float:
    """Modelled downtime of one change: the old hosts write the training state to shared storage, the
    processes restart, the new hosts read the state back (each host at `storage_gbs`)."""
    state = n_params * STATE_BYTES_PER_PARAM / 1e9  # GB
    save = 0.0 if before is None else state / (hosts_of(before.used, hw.gpus_per_host) * hw.storage_gbs)
    load = state / (hosts_of(after.used, hw.gpus_per_host) * hw.storage_gbs)
    return save + hw.restart_s + load


def simulate(durations: list[float], choices: list[Choice], scale: float,
             downtime: Callable[[Choice | None, Choice], float] | None = None,
             step_time: Callable[[Choice], float] | None = None) -> Timeline:
    """Steps of a run through phases of `durations` seconds, the policy's `choices` per phase; `downtime`
    (previous running choice or None, next choice) -> seconds, None: instant reconfiguration (the ideal);
    `step_time` (choice) -> seconds, None: the planner's prediction."""
    if len(durations) != len(choices):
        raise ValueError(f"{len(durations)} phases but {len(choices)} choices")
    if not scale > 0:
        raise ValueError(f"scale={scale} must be positive")
    steps: list[SimStep] = []
    t, bound, total_down, pending = 0.0, 0.0, 0.0, 0.0
    running: Choice | None = None  # what the job runs right now (None: stopped)
    last: Choice | None = None  # what it ran last (the state to save comes from there)
    per_phase = []
    for phase, (length, choice) in enumerate(zip(durations, choices)):
        start, bound = bound, bound + length
        if choice.waits:
            running = None
            per_phase.append(0)
            continue
        if running is None or running.key() != choice.key():
            t = max(t, start)
            if last is not None:  # the job's very first start is not a reconfiguration
                cost = downtime(last, choice) if downtime else 0.0
                t, total_down, pending = t + cost, total_down + cost, pending + cost
        running = last = choice
        dt = (step_time(choice) if step_time else choice.step_time_s) * scale
        n = max(0, math.ceil((bound - t) / dt - 1e-9))
        for _ in range(n):
            t += dt
            steps.append(SimStep(len(steps) + 1, t, phase, pending))
            pending = 0.0
        per_phase.append(n)
    return Timeline(steps, total_down, per_phase)


def auto_scale(durations: list[float], choices: list[Choice], target_steps: int) -> float:
    """The scale at which these choices would run about `target_steps` steps with instant reconfiguration."""
    if target_steps < 1:
        raise ValueError(f"target_steps={target_steps} must be positive")
    full = sum(length / c.step_time_s for length, c in zip(durations, choices) if not c.waits)
    if full == 0:
        raise ValueError("the policy waits through every phase")
    return full / target_steps
