"""What each policy does under one hardware profile, before anything runs: its choice per phase (the planner,
for the target job), the simulated timeline and its zero-downtime ideal, and the schedule the runtime gets.
Pure Python: `elastic-trainer experiment --dry-run` prints this, the tests check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.schedule import Phase, same_run
from elastic_trainer.experiment.config import Experiment, JobSpec
from elastic_trainer.experiment.policy import Choice, choices
from elastic_trainer.experiment.simclock import STATE_BYTES_PER_PARAM, Timeline, auto_scale, reconfiguration_s, simulate
from elastic_trainer.plan import Hardware, Request, load_hardware
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import stage_numel


@dataclass
class PolicyPlan:
    name: str
    choices: list[Choice]
    timeline: Timeline
    """Steps under the simulated clock, with the modelled reconfiguration time."""
    ideal: Timeline
    """The same choices with instant reconfiguration."""


@dataclass
class ProfilePlan:
    profile: str
    hardware: Hardware
    scale: float
    """One simulated step stands for `scale` steps of the target."""
    reconfiguration: dict
    """The downtime model's inputs and its values for the reference policy's changes, for the record."""
    policies: dict[str, PolicyPlan]

    @property
    def cap(self) -> int:
        """The step count every policy's learning-rate schedule is set for (the most any policy reaches)."""
        return max(1, *(p.timeline.count for p in self.policies.values()))


def target_request(exp: Experiment, hw: Hardware, held: int | None = None) -> Request:
    t = exp.target
    return Request(t.model, held or max(exp.gpus), t.global_batch, t.seq_len, hw, exp.gpus_per_host)


def model_params(model) -> int:
    """Parameters of the whole model (one stage holding every layer)."""
    return stage_numel(model, Layout(1, 1, 1, 1, 1), 0)


def plan_profile(exp: Experiment, profile: str, scale: float | None = None, target_steps: int = 64) -> ProfilePlan:
    """Every policy's choices and timelines under `profile`; `scale` None: chosen so that ours' ideal run
    has about `target_steps` steps."""
    hw = load_hardware(profile)
    req = target_request(exp, hw)
    picked = {name: choices(exp.policy(name), req, exp.gpus) for name in exp.policies}
    reference = picked.get("ours") or next(iter(picked.values()))
    if scale is None:
        scale = auto_scale(exp.durations, reference, target_steps)
    n_params = model_params(exp.target.model)

    def downtime(before: Choice, after: Choice, warm: bool) -> float:
        return reconfiguration_s(n_params, hw, before, after, warm)

    plans = {
        name: PolicyPlan(name, c, simulate(exp.durations, c, scale, downtime), simulate(exp.durations, c, scale))
        for name, c in picked.items()
    }
    model = reconfiguration_model(n_params, hw, reference)
    return ProfilePlan(profile, hw, scale, model, plans)


def reconfiguration_model(n_params: int, hw: Hardware, reference: list[Choice]) -> dict:
    """The downtime model's inputs and its values for the reference policy's changes, for the record: each
    distinct hand-over between consecutive phases (GPUs before -> after) and the restart after a wait."""
    handover = {}
    for a, b in zip(reference, reference[1:]):
        if not a.waits and not b.waits and a.key() != b.key():
            handover.setdefault(f"{a.used}->{b.used}", round(reconfiguration_s(n_params, hw, a, b), 2))
    runs = [c for c in reference if not c.waits]
    restart = reconfiguration_s(n_params, hw, runs[0], runs[-1], warm=False) if runs else 0.0
    return {
        "state_gb": round(n_params * STATE_BYTES_PER_PARAM / 1e9, 2),
        "shm_write_gbs_per_rank": hw.shm_write_gbs,
        "shm_read_gbs_per_rank": hw.shm_read_gbs,
        "inter_host_gbs": hw.inter_host_gbs,
        "handover_setup_s": hw.handover_setup_s,
        "handover_s": handover,
        "formula": "state / (old ranks x shm_write_gbs) + exchange / inter_host_gbs + state / (new ranks x "
        "shm_read_gbs) + handover_setup_s; exchange: the GB the busiest host receives or sends",
        "storage_gbs_per_host": hw.storage_gbs,
        "restart_s": hw.restart_s,
        "typical_restart_s": round(restart, 1),
        "restart_formula": "after a phase without GPUs: state / (old hosts x storage_gbs) + restart_s + "
        "state / (new hosts x storage_gbs)",
    }


def small_layout(small: JobSpec, choice: Choice) -> tuple[tuple[int, int, int], int]:
    """The degrees the small model runs a choice in (the target's) and its micro-batch: the target's
    accumulation where the small batch allows (the pipeline keeps its depth), else the nearest below."""
    c = choice.candidate
    model = small.model
    if model.n_heads % c.tp or c.pp > model.n_layers or small.global_batch % c.dp:
        raise ConfigError(
            f"the small model {model.name} (n_heads={model.n_heads}, n_layers={model.n_layers}, "
            f"global batch {small.global_batch}) cannot run dp{c.dp} tp{c.tp} pp{c.pp}; give "
            "[small] a model with more heads or layers, or a global batch dp divides"
        )
    share = small.global_batch // c.dp
    return c.degrees, share // math.gcd(c.num_microbatches, share)


def runtime_schedule(small: JobSpec, plan: PolicyPlan) -> list[Phase]:
    """The steps schedule the runtime trains the small model through: per phase its steps in the choice's
    degrees; a 0-GPU phase where the simulated job stops and starts again but the runtime would run through."""
    out: list[Phase] = []
    previous: Choice | None = None
    for choice, steps in zip(plan.choices, plan.timeline.phase_steps):
        if choice.waits or steps == 0:  # a choice that ran no step still ended what ran before it
            previous = None if choice.waits else choice
            continue
        degrees, micro = small_layout(small, choice)
        phase = Phase(choice.used, steps=steps, layout=degrees, micro_batch=micro)
        restarts = previous is None or previous.key() != choice.key()
        if out and restarts and same_run(out[-1], phase):
            out.append(Phase(0, steps=0))
        out.append(phase)
        previous = choice
    return out
