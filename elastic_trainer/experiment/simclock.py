"""The simulated clock: when each step of a policy's run ends under a schedule of timed phases, if every step
took the planner's predicted time of the target model on the target hardware and every reconfiguration took
the modelled time of handing the target's training state over (`reconfiguration_s`: through host memory from
a running world to a warm-started one, or through shared storage and a restart after the job waited).

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
from collections.abc import Callable
from dataclasses import dataclass

from elastic_trainer.experiment.policy import Choice
from elastic_trainer.plan.hardware import Hardware

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


def exchange_gb(state_gb: float, old_hosts: int, new_hosts: int) -> float:
    """GB the busiest host receives or sends between hosts in a hand-over. The simulator's choices: the hosts
    of the smaller world are hosts of the larger one (hosts are added or removed, never swapped), and the old
    hosts hold an even 1/old_hosts share of every piece. A new host needs state/new_hosts: a host it keeps
    already holds 1/old_hosts of that and receives the rest, an added host receives all of it; an old host
    sends its share of what every other new host needs (all of its state when it is removed)."""
    need = state_gb / new_hosts
    received = need if new_hosts > old_hosts else need * (1 - 1 / old_hosts)
    sent = state_gb / old_hosts * (1.0 if old_hosts > new_hosts else (new_hosts - 1) / new_hosts)
    return max(received, sent)


def rank_share(hw: Hardware, used: int) -> float:
    """What a rank of `used` gets of its own copy rate: all of it on GPU hosts; on a shared host (CPU ranks)
    the host's `compute_units` divided among its ranks."""
    ranks = min(used, hw.gpus_per_host)
    return min(1.0, hw.compute_units / ranks) if hw.shared_host else 1.0


def handover_s(state_gb: float, hw: Hardware, before: Choice, after: Choice) -> float:
    """The warm path: every old rank writes its share of the state into its host's memory, each new host
    fetches the pieces held on other hosts, every new rank reads its share, plus the fixed set-up."""
    old_hosts, new_hosts = hosts_of(before.used, hw.gpus_per_host), hosts_of(after.used, hw.gpus_per_host)
    write = state_gb / before.used / (hw.shm_write_gbs * rank_share(hw, before.used))
    exchange = exchange_gb(state_gb, old_hosts, new_hosts) / hw.inter_host_gbs
    read = state_gb / after.used / (hw.shm_read_gbs * rank_share(hw, after.used))
    return write + exchange + read + hw.handover_setup_s


def cold_restart_s(state_gb: float, hw: Hardware, before: Choice | None, after: Choice) -> float:
    """The restart path: the old hosts write the state to shared storage, the processes restart, the new
    hosts read it back (each host at `storage_gbs`); the first start (`before` None) only loads."""
    save = 0.0 if before is None else state_gb / (hosts_of(before.used, hw.gpus_per_host) * hw.storage_gbs)
    load = state_gb / (hosts_of(after.used, hw.gpus_per_host) * hw.storage_gbs)
    return save + hw.restart_s + load


def reconfiguration_s(n_params: int, hw: Hardware, before: Choice | None, after: Choice, warm: bool = True) -> float:
    """Modelled downtime of one change from `before` (None: the job's first start) to `after`. A running job
    (`warm`) hands over through host memory to the next world, warm-started beside it (`handover_s`); a job
    that stopped (a phase without GPUs came between) or starts for the first time pays the restart through
    shared storage (`cold_restart_s`)."""
    state = n_params * STATE_BYTES_PER_PARAM / 1e9  # GB
    if warm and before is not None:
        return handover_s(state, hw, before, after)
    return cold_restart_s(state, hw, before, after)


def simulate(
    durations: list[float],
    choices: list[Choice],
    scale: float,
    downtime: Callable[[Choice, Choice, bool], float] | None = None,
    step_time: Callable[[Choice], float] | None = None,
) -> Timeline:
    """Steps of a run through phases of `durations` seconds, the policy's `choices` per phase; `downtime`
    (the choice whose state is handed on, the next choice, whether the job ran up to the change (False: a
    phase without GPUs stopped it)) -> seconds, None: instant reconfiguration (the ideal);
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
                cost = downtime(last, choice, running is not None) if downtime else 0.0
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
