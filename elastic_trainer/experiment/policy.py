"""Elasticity policies: what a job runs on when it is given N GPUs, every answer from the same planner.

- **ours**: re-plan every dimension (`plan(request).chosen`), and leave GPUs idle when a smaller count is
  faster (12 GPUs and a global batch of 128: dp8 on 8 of them beats every layout of all 12).
- **tenplex-table**: a hand-written table of degrees per GPU count (Tenplex's, by default); the planner picks
  the micro-batch and mode for those degrees. Counts the table does not list are skipped: the job waits.
- **dp-only**: tensor and pipeline degrees frozen (tp2 x pp4, as Tenplex-DP); data parallelism takes as many
  whole replicas as the GPUs hold, and with fewer GPUs than one replica the job waits.
- **fsdp-only**: tp = pp = 1, sharded data parallelism over every GPU, when it fits in memory.
- **static**: the layout planned for the smallest allocation of the run, kept for the whole run on that many
  of the GPUs held.

Pure Python, no torch: the experiment's simulated clock and the launcher use the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from elastic_trainer.plan.candidates import Candidate, PlanError, Request
from elastic_trainer.plan.planner import plan
from elastic_trainer.plan.use_gpus import largest_dp, plan_gpus, sized

POLICIES = ("ours", "tenplex-table", "dp-only", "fsdp-only", "static")
TENPLEX_TABLE = {16: (2, 2, 4), 8: (1, 2, 4), 4: (1, 2, 2)}
"""Tenplex's layouts for GPT-3 XL (GPUs -> dp, tp, pp): 16 -> dp2 pp4 tp2, 8 -> dp1 pp4 tp2, 4 -> dp1 pp2 tp2."""
DP_ONLY_FROZEN = (2, 4)
"""(tp, pp) that dp-only keeps whatever the GPU count (Tenplex-DP)."""


@dataclass(frozen=True)
class Choice:
    """What a policy runs on `held` GPUs: `used` of them in `candidate`'s layout, or nothing (it waits)."""

    held: int
    used: int
    candidate: Candidate | None
    note: str = ""
    """Why the policy waits, or what it gave up (GPUs left idle)."""

    @property
    def waits(self) -> bool:
        return self.candidate is None

    @property
    def step_time_s(self) -> float:
        return self.candidate.step_time_s

    def key(self) -> tuple:
        """Equal keys: the same job start can run both (no reconfiguration between them)."""
        return (self.used, self.candidate.layout) if self.candidate else ()

    def describe(self) -> str:
        if self.candidate is None:
            return f"waits ({self.note})"
        c = self.candidate
        text = (
            f"dp{c.dp} tp{c.tp} pp{c.pp} micro {c.micro_batch} x {c.num_microbatches} {c.dp_mode}"
            f"{' recompute' if c.recompute else ''}: {c.step_time_s:.3f} s/step"
        )
        return text + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Policy:
    name: str
    table: dict[int, tuple[int, int, int]] = field(default_factory=lambda: dict(TENPLEX_TABLE))
    frozen: tuple[int, int] = DP_ONLY_FROZEN
    static_gpus: int | None = None
    """The static policy's GPU count (the run's smallest allocation)."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise PlanError(f"unknown policy {self.name!r} (valid: {', '.join(POLICIES)})")
        if self.name == "static" and not self.static_gpus:
            raise PlanError("the static policy needs static_gpus (the smallest allocation of the run)")

    def choose(self, req: Request) -> Choice:
        """The policy's layout for `req.world_size` held GPUs (`req` fixes the model, batch and hardware)."""
        held = req.world_size
        try:
            return getattr(self, "_" + self.name.replace("-", "_"))(req)
        except PlanError as e:
            return Choice(held, 0, None, str(e))

    def _ours(self, req: Request) -> Choice:
        chosen = plan_gpus(req, "fastest")  # the job's use_gpus=fastest: what a real start of it runs
        return _on(req, chosen.used, chosen.plan.chosen)

    def _tenplex_table(self, req: Request) -> Choice:
        degrees = self.table.get(req.world_size)
        if degrees is None:
            listed = ", ".join(map(str, sorted(self.table)))
            return Choice(req.world_size, 0, None, f"{req.world_size} GPUs are not in the table ({listed}): skipped")
        return Choice(req.world_size, req.world_size, plan(req).best_for(*degrees))

    def _dp_only(self, req: Request) -> Choice:
        tp, pp = self.frozen
        dp = largest_dp(req.world_size // (tp * pp), req.global_batch)
        if dp == 0:
            return Choice(req.world_size, 0, None, f"fewer than one tp{tp} x pp{pp} replica ({tp * pp} GPUs)")
        return _on(req, dp * tp * pp, plan(sized(req, dp * tp * pp)).best_for(dp, tp, pp))

    def _fsdp_only(self, req: Request) -> Choice:
        dp = largest_dp(req.world_size, req.global_batch)
        sharded = replace(sized(req, dp), dp_modes=("fsdp",))
        return _on(req, dp, plan(sharded).best_for(dp, 1, 1))

    def _static(self, req: Request) -> Choice:
        if req.world_size < self.static_gpus:
            return Choice(req.world_size, 0, None, f"fewer than its {self.static_gpus} GPUs")
        return _on(req, self.static_gpus, plan(sized(req, self.static_gpus)).chosen)


def _on(req: Request, used: int, candidate: Candidate) -> Choice:
    idle = req.world_size - used
    return Choice(req.world_size, used, candidate, f"{idle} GPU(s) idle" if idle else "")


def choices(policy: Policy, req: Request, gpus: list[int]) -> list[Choice]:
    """The policy's choice for each allocation in `gpus` (one planning per distinct count)."""
    memo: dict[int, Choice] = {}
    for n in gpus:
        if n not in memo:
            memo[n] = policy.choose(_sized_held(req, n)) if n else Choice(0, 0, None, "no GPUs")
    return [memo[n] for n in gpus]


def _sized_held(req: Request, held: int) -> Request:
    return replace(req, world_size=held, host_sizes=None)
