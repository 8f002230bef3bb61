"""How many of the GPUs a start holds it trains on, and in which layout: `plan_gpus(request, use)`.

Any GPU count runs. When no layout fits all N GPUs held (5 GPUs for a model of 4 heads and a global batch of
12), the job trains on the largest M < N some layout fits and leaves the rest idle. Whether to idle GPUs when
a smaller count is merely *predicted* faster is the job's `use_gpus` setting (`job_spec.USE_GPUS`), shared by
the launcher's plans, rank 0's plans (membership changes included) and the experiment's `ours` policy:

- all (the default): every GPU some layout can use. The step-time model picks gpt3-small's layout at 0.905 of
  the best measured one, so a predicted gain of a few percent from idling GPUs is inside its error, while
  GPUs left idle are a certain cost to whoever shares the cluster.
- fastest: the count with the best predicted step time (the experiment's `ours`: dp8 on 8 of 12 GPUs).

The GPUs used are always the first M ranks, hosts in rank order (`sized`): the ranks that train keep their
host's tp groups whole. Pure: no tensors, no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic_trainer.plan.candidates import PlanError, Request
from elastic_trainer.plan.planner import Plan, degrees_possible, plan, plan_or_none, usable_degrees


@dataclass(frozen=True)
class GpuPlan:
    held: int
    used: int
    plan: Plan
    why: str = ""
    """Why GPUs are idle ("" when none are)."""

    @property
    def idle(self) -> int:
        return self.held - self.used

    def note(self) -> str:
        """'' or one line saying how many GPUs are left idle and why."""
        if not self.idle:
            return ""
        return f"training on {self.used} of the {self.held} GPUs, {self.idle} idle: {self.why}"


def sized(req: Request, used: int) -> Request:
    """`req` for `used` of its GPUs (the first hosts' worth when the hosts are known)."""
    if used == req.world_size:
        return req
    if req.host_sizes is None:
        return replace(req, world_size=used)
    return replace(req, world_size=used, host_sizes=req.topology.first(used).sizes)


def largest_dp(limit: int, global_batch: int) -> int:
    """The largest data-parallel degree <= limit that splits the global batch (0 when limit is 0)."""
    return next((d for d in range(limit, 0, -1) if global_batch % d == 0), 0)


def smaller_counts(req: Request) -> list[int]:
    """Fewer GPUs than held that may be faster: the largest multiple of the host size, the largest power of
    two, the largest divisor of the global batch (at least half of what is held; few, so planning stays cheap)."""
    held, host = req.world_size, req.topology.largest
    options = {held // host * host, 1 << (held.bit_length() - 1), largest_dp(held, req.global_batch)}
    return sorted(n for n in options if held / 2 <= n < held)


def _largest_that_fits(req: Request, error: PlanError, tries: int = 64) -> GpuPlan:
    """The largest count below the held one with a valid layout: counts no degrees can reach are skipped
    without planning, and at most `tries` are planned in full (the held count's error otherwise)."""
    dp, tp, pp = usable_degrees(req)
    for used in range(min(req.world_size - 1, dp * tp * pp), 0, -1):
        other = sized(req, used)
        if not degrees_possible(other):
            continue
        found = plan_or_none(other)
        if found is not None:
            return GpuPlan(req.world_size, used, found, f"no layout of {req.world_size} GPUs is valid")
        tries -= 1
        if tries == 0:
            break
    raise error


def plan_gpus(req: Request, use: str = "all") -> GpuPlan:
    """The GPUs to train on of the `req.world_size` held, and their plan; PlanError (for all N) when no count
    up to N has a valid layout."""
    try:
        best = GpuPlan(req.world_size, req.world_size, plan(req))
    except PlanError as e:
        best = _largest_that_fits(req, e)
    if use == "fastest":
        for used in smaller_counts(req):
            other = plan_or_none(sized(req, used)) if used != best.used else None
            if other is not None and other.chosen.step_time_s < best.plan.chosen.step_time_s * (1 - 1e-9):
                best = GpuPlan(
                    req.world_size,
                    used,
                    other,
                    f"predicted faster than {best.used} "
                    f"({other.chosen.step_time_s:.3f} vs {best.plan.chosen.step_time_s:.3f} s/step)",
                )
    return best
