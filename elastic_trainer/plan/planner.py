"""`plan(request) -> Plan`: the valid candidates ranked by predicted step time, or one line saying why
none is valid and what would be (the nearest GPU count, global batch or memory that works)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from elastic_trainer.plan.candidates import (
    Candidate,
    PlanError,
    Request,
    degree_reason,
    enumerate_candidates,
    memory_reason,
    rank_peak_bytes,
)
from elastic_trainer.plan.hardware import GIB
from elastic_trainer.plan.layout import Layout, divisors, factorizations
from elastic_trainer.plan.measured import ADMIT_STEPS, Measurement, family
from elastic_trainer.plan.memory import stage_memories


@dataclass(frozen=True)
class Plan:
    """Valid candidates, best first, and the rejected ones with their reasons."""

    request: Request
    candidates: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    def best_for(self, dp: int, tp: int, pp: int) -> Candidate:
        """The fastest valid candidate with these degrees, or the reason none is valid."""
        for c in self.candidates:
            if c.degrees == (dp, tp, pp):
                return c
        if dp * tp * pp != self.request.world_size:
            raise PlanError(f"layout {dp},{tp},{pp} has {dp * tp * pp} GPUs, not {self.request.world_size}")
        rejected = [c for c in self.rejected if c.degrees == (dp, tp, pp)]
        fits = [c for c in rejected if c.memory is not None]
        if fits:
            smallest = min(fits, key=lambda c: c.memory.total)
            raise PlanError(f"layout {dp},{tp},{pp} does not fit: the smallest {smallest.reason}")
        raise PlanError(f"layout {dp},{tp},{pp} is invalid: {rejected[0].reason}")


def _ranked(req: Request) -> Plan:
    """Every candidate for `req`: the valid ones ranked (possibly none), the rejected ones."""
    everything = learned(req, list(enumerate_candidates(req)))
    valid = sorted((c for c in everything if c.valid), key=Candidate.rank_key)
    return Plan(req, tuple(valid), tuple(c for c in everything if not c.valid))


def learned(req: Request, candidates: list[Candidate]) -> list[Candidate]:
    """The candidates with what this job measured on these hosts (`req.measured`, plan/measured.py): memory
    first (`learned_memory`), then step times: a layout it ran takes its measured step time; the others of its
    family (the same degrees and data-parallel mode) their prediction times the family's median ratio of
    measured to predicted; the rest keep their predictions."""
    measured = [Measurement(*m) for m in req.measured]  # (layout, seconds) pairs are read as well
    if not measured:
        return candidates
    candidates = learned_memory(req, candidates, {m.layout: m for m in measured if m.memory_gib is not None})
    seconds = {m.layout: m.step_s for m in measured}
    ratios: dict[tuple, list[float]] = {}
    for c in candidates:
        if c.valid and c.layout in seconds:
            ratios.setdefault(family(c.layout), []).append(seconds[c.layout] / c.time.total)
    out = []
    for c in candidates:
        if c.valid and c.layout in seconds:
            c = replace(c, measured_s=seconds[c.layout])
        elif c.valid and family(c.layout) in ratios:
            c = replace(c, correction=statistics.median(ratios[family(c.layout)]))
        out.append(c)
    return out


def learned_memory(req: Request, candidates: list[Candidate], peaks: dict[Layout, Measurement]) -> list[Candidate]:
    """A layout this job ran is checked at the memory model's bytes times its own ratio of the peak it measured
    on these hosts to the planned peak of its largest rank (admitted where the model's envelope rejects it
    only after a start of ADMIT_STEPS); the other layouts of a family that took more than planned are charged
    the family's largest ratio and rejected if they then do not fit. A peak below the plan loosens nothing
    the job has not run."""
    ratios: dict[tuple, float] = {}
    own: dict[Layout, float] = {}
    for c in candidates:
        if c.memory is not None and c.layout in peaks:
            own[c.layout] = peaks[c.layout].memory_gib * GIB / rank_peak_bytes(req, c)
            ratios[family(c.layout)] = max(own[c.layout], ratios.get(family(c.layout), 0.0))
    out = []
    for c in candidates:
        if c.memory is None:
            pass  # invalid degrees (no layout to weigh)
        elif c.layout in own:
            c = _ran(req, c, peaks[c.layout], own[c.layout])
        elif c.valid and ratios.get(family(c.layout), 1.0) > 1.0:
            ratio = ratios[family(c.layout)]
            reason = memory_reason(
                req,
                c.layout,
                _stages(req, c.layout),
                ratio,
                f" (the model's bytes x{ratio:.2f}, as its family measured)",
            )
            c = replace(c, memory_correction=ratio, reason=reason)
        out.append(c)
    return out


def _ran(req: Request, c: Candidate, ran: Measurement, ratio: float) -> Candidate:
    """A layout this job ran, checked at its measured peak (see `learned_memory`)."""
    reason = memory_reason(req, c.layout, _stages(req, c.layout), ratio, " (as an earlier start measured)")
    if reason is None and not c.valid and ran.memory_steps < ADMIT_STEPS:
        reason = (
            f"{c.reason} (an earlier start ran it for {ran.memory_steps} steps: {ADMIT_STEPS} are needed "
            "to admit it on its measured peak)"
        )
    return replace(c, measured_memory_gib=ran.memory_gib, reason=reason)


def _stages(req: Request, layout: Layout):
    return stage_memories(req.model, layout, req.seq_len, req.compute_dtype)


def plan(req: Request) -> Plan:
    """Rank every candidate for `req`; raise PlanError (why, and what would work) when none is valid."""
    result = _ranked(req)
    if not result.candidates:
        raise PlanError(why_no_plan(req, result.rejected))
    return result


def plan_or_none(req: Request) -> Plan | None:
    result = _ranked(req)
    return result if result.candidates else None


def usable_degrees(req: Request) -> tuple[int, int, int]:
    """The largest dp, tp, pp any layout of this job can have: dp divides the global batch, tp divides
    n_heads and (across hosts) the host size, pp <= n_layers."""
    host = req.topology.common if req.host_sizes else req.gpus_per_host  # known hosts, or any count of hosts
    tps = [t for t in divisors(req.model.n_heads) if host % t == 0]
    return req.global_batch, max(tps), req.model.n_layers


def degrees_possible(req: Request) -> bool:
    return any(degree_reason(req, *d) is None for d in factorizations(req.world_size))


def first_world_with_plan(req: Request, counts, tries: int = 64) -> int | None:
    """The first GPU count of `counts` with a valid layout, planning at most `tries` of them in full."""
    for m in counts:
        other = replace(req, world_size=m, host_sizes=None)  # other counts: hosts of gpus_per_host
        if degrees_possible(other):
            if plan_or_none(other) is not None:
                return m
            tries -= 1
            if tries == 0:
                return None
    return None


def nearest_world(req: Request, limit: int) -> int | None:
    """The GPU count nearest to the request's (at most `limit`) for which some layout is valid."""
    b, micro = req.global_batch, req.micro_batch
    if micro is not None and all((b // dp) % micro for dp in divisors(b)):
        return None  # the fixed micro-batch splits no dp share of the global batch: no GPU count helps
    n = min(req.world_size, limit)
    return first_world_with_plan(
        req, (m for k in range(limit) for m in ((n,) if k == 0 else (n - k, n + k)) if 1 <= m <= limit)
    )


def nearest_batch(req: Request) -> int | None:
    """The global batch nearest to the request's that some valid layout of its GPU count can split."""
    options = []
    for dp, tp, pp in factorizations(req.world_size):
        batch = dp * max(1, round(req.global_batch / dp))
        if degree_reason(replace(req, global_batch=batch), dp, tp, pp) is None:
            options.append(batch)
    for batch in sorted(set(options), key=lambda b: (abs(b - req.global_batch), b)):
        if batch != req.global_batch and plan_or_none(replace(req, global_batch=batch)) is not None:
            return batch
    return None


def why_no_plan(req: Request, rejected: tuple[Candidate, ...]) -> str:
    """One line: why no layout works for `req`, and the nearest GPU count or global batch that does."""
    n, model = req.world_size, req.model
    dp, tp, pp = usable_degrees(req)
    limit = dp * tp * pp
    sized = [c for c in rejected if c.memory is not None]
    if sized:
        small = min(sized, key=lambda c: c.memory.total)
        why = (
            f"no layout of {n} GPU(s) fits in memory: the smallest (dp={small.dp} tp={small.tp} pp={small.pp} "
            f"micro_batch={small.micro_batch}{' recompute' if small.recompute else ''}) {small.reason}"
        )
        bigger = first_world_with_plan(req, range(n + 1, limit + 1))
        return why + (
            f"; {bigger} GPUs would work" if bigger else "; use devices with more memory or a shorter sequence"
        )
    if n > limit:
        why = (
            f"{n} GPUs are more than {model.name} with global batch {req.global_batch} can use: at most "
            f"dp={dp} x tp={tp} x pp={pp} = {limit} (dp divides the global batch, tp divides n_heads="
            f"{model.n_heads} and the hosts' sizes ({req.topology.describe()}), pp <= n_layers={model.n_layers})"
        )
    else:
        reasons = "; ".join(f"{c.dp},{c.tp},{c.pp}: {c.reason}" for c in rejected[:4])
        why = f"no DP,TP,PP of {n} GPUs is valid ({reasons}{'; ...' if len(rejected) > 4 else ''})"
    hints = []
    world = nearest_world(req, limit)
    if world is not None:
        hints.append(f"nearest GPU count that works: {world}")
    batch = nearest_batch(req)
    if batch is not None:
        hints.append(f"nearest global batch that works on {n} GPUs: {batch}")
    return why + ("; " + ", ".join(hints) if hints else "")
