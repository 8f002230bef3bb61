"""Candidates: every layout for N devices, each checked and given a predicted memory and step time.

A candidate is (dp, tp, pp) with dp * tp * pp = N, a micro-batch m and num_microbatches a with
dp * m * a = global batch, a data-parallel mode and recompute on or off. It is valid when tp divides
n_heads and every tp group stays within one host, pp <= n_layers (stages balanced by `stage_layers`),
dp divides the global batch and its peak memory fits (plan/memory.py); its step time comes from
plan/step_time.py. Invalid candidates keep the reason. Pure Python, cheap: N = 1024 takes well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_trainer.config import DP_MODES, DTYPES, ModelConfig, positive_int
from elastic_trainer.plan.hardware import GIB, Hardware
from elastic_trainer.plan.layout import Layout, LayoutError, divisors, factorizations, split_batch
from elastic_trainer.plan.memory import StageMemory, stage_memories
from elastic_trainer.plan.step_time import StepTime, step_time
from elastic_trainer.plan.topology import Topology


class PlanError(LayoutError):
    """No layout works; the message is one line saying why and what would."""


@dataclass(frozen=True)
class Request:
    """What to plan for: a model and a batch on N devices of one hardware profile."""

    model: ModelConfig
    world_size: int
    """GPUs (ranks) to lay the model out on."""
    global_batch: int
    """Samples per optimizer step, kept by every candidate."""
    seq_len: int
    hardware: Hardware
    gpus_per_host: int
    """Ranks per host: tp groups must stay within one; groups within a host use its faster links."""
    host_sizes: tuple[int, ...] | None = None
    """The ranks on each host when they are known (hosts may differ); overrides `gpus_per_host`."""
    dtype: str = "auto"
    """fp32, bf16 (mixed) or auto (the hardware's compute dtype)."""
    micro_batch: int | None = None
    """Only this micro-batch size (None: any divisor of the per-replica batch)."""
    dp_modes: tuple[str, ...] = DP_MODES
    """Data-parallel modes to consider."""
    recompute: tuple[bool, ...] = (False, True)
    """Recompute settings to consider."""
    compiled: bool = False
    """The blocks run compiled (--compile): their compute is the hardware's measured `compiled_speedup` faster."""
    measured: tuple = ()
    """plan/measured.py `Measurement`s (or (Layout, seconds) pairs): the steady step times and peak memory this
    job measured on these hosts."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        for key in ("world_size", "global_batch", "seq_len", "gpus_per_host"):
            positive_int(key, getattr(self, key), PlanError)
        if self.micro_batch is not None:
            positive_int("micro_batch", self.micro_batch, PlanError)
        if self.host_sizes is not None and sum(self.host_sizes) != self.world_size:
            raise PlanError(
                f"hosts with {'+'.join(map(str, self.host_sizes))} ranks do not hold world_size={self.world_size}"
            )
        if self.seq_len > self.model.context_length:
            raise PlanError(
                f"seq_len={self.seq_len} exceeds {self.model.name}'s context_length={self.model.context_length}"
            )

    @property
    def topology(self) -> Topology:
        if self.host_sizes is not None:
            return Topology(tuple(self.host_sizes))
        return Topology.uniform(self.world_size, self.gpus_per_host)

    @property
    def compute_dtype(self) -> str:
        return self.hardware.compute_dtype if self.dtype == "auto" else self.dtype

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Candidate:
    """One layout with its predicted memory and step time, or the reason it cannot run."""

    dp: int
    tp: int
    pp: int
    micro_batch: int | None = None
    """None when the degrees themselves are invalid."""
    num_microbatches: int | None = None
    dp_mode: str = "fsdp"
    recompute: bool = False
    memory: StageMemory | None = None
    time: StepTime | None = None
    reason: str | None = None
    """Why this candidate is invalid; None when it is valid."""
    measured_s: float | None = None
    """The step time this job measured for this layout on these hosts (plan/measured.py), which ranks it."""
    correction: float = 1.0
    """The measured / predicted ratio of this layout's family that its prediction is multiplied by."""
    measured_memory_gib: float | None = None
    """The largest peak memory of a rank this job measured in this layout on these hosts (plan/measured.py)."""
    memory_correction: float = 1.0
    """The measured / predicted memory ratio (above 1) of this layout's family that its fit was checked with."""

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.dp, self.tp, self.pp

    @property
    def layout(self) -> Layout:
        return Layout(
            self.dp,
            self.tp,
            self.pp,
            self.micro_batch,
            self.num_microbatches,
            dp_mode=self.dp_mode,
            recompute=self.recompute,
        )

    @property
    def memory_gb(self) -> float:
        return self.memory.total / GIB

    @property
    def step_time_s(self) -> float:
        """Measured where this job ran the layout, else predicted (and corrected by its family's ratio)."""
        return self.measured_s if self.measured_s is not None else self.time.total * self.correction

    @property
    def source(self) -> str:
        """Where step_time_s comes from: measured, corrected or predicted."""
        return "measured" if self.measured_s is not None else "corrected" if self.correction != 1.0 else "predicted"

    @property
    def memory_source(self) -> str:
        """Where the memory this candidate was admitted or rejected by comes from: measured, corrected or
        predicted."""
        return (
            "measured"
            if self.measured_memory_gib is not None
            else "corrected"
            if self.memory_correction != 1.0
            else "predicted"
        )

    def rank_key(self) -> tuple:
        """Fastest first; ties go to less memory, then fewer pipeline and tensor-parallel ranks, no recompute,
        then the data-parallel mode in DP_MODES' order (fsdp, ddp, zero1)."""
        return (
            round(self.step_time_s, 12),
            self.memory.total,
            self.pp,
            self.tp,
            self.recompute,
            DP_MODES.index(self.dp_mode),
        )


def degree_reason(req: Request, dp: int, tp: int, pp: int) -> str | None:
    """Why (dp, tp, pp) cannot run this model and batch, whatever the micro-batch; None when it can."""
    model = req.model
    if model.n_heads % tp:
        return f"tp={tp} does not divide n_heads={model.n_heads}"
    if not req.topology.within(tp):
        return f"tp={tp} groups would span hosts ({req.topology.describe()})"
    if pp > model.n_layers:
        return f"pp={pp} exceeds n_layers={model.n_layers}"
    if req.global_batch % dp:
        return f"dp={dp} does not divide the global batch {req.global_batch}"
    try:
        split_batch(req.global_batch, dp, req.micro_batch)
    except LayoutError as e:  # the micro-batch does not divide the per-replica batch
        return str(e)
    return None


def evaluate(req: Request, layout: Layout) -> Candidate:
    """Memory and step time of one layout, invalid (with the reason) when it does not fit."""
    dtype = req.compute_dtype
    hw = req.hardware
    stages = stage_memories(req.model, layout, req.seq_len, dtype)
    memory = max(stages, key=lambda m: m.total)
    time = step_time(
        req.model,
        layout,
        req.seq_len,
        dtype,
        hw,
        req.topology,
        block_speedup=hw.compiled_speedup if req.compiled else 1.0,
    )
    return Candidate(
        layout.dp,
        layout.tp,
        layout.pp,
        layout.micro_batch,
        layout.num_microbatches,
        layout.dp_mode,
        layout.recompute,
        memory,
        time,
        memory_reason(req, layout, stages),
    )


def memory_reason(
    req: Request, layout: Layout, stages: list[StageMemory], scale: float = 1.0, how: str = ""
) -> str | None:
    """Why `layout` does not fit when its stages take `scale` times the memory model's bytes (`how` says where
    the scale came from); None when it fits."""
    hw = req.hardware
    if hw.shared_host:  # the host's ranks share its memory: every stage's dp * tp ranks, on one host or spread,
        ranks = req.topology.largest  # each holding its base and the heap it keeps
        host = sum(hw.rank_bytes(m.total, layout) for m in stages) * layout.dp * layout.tp * ranks / layout.world_size
        return _over(scale * host, hw, "host", how)
    return _over(scale * max(m.total for m in stages), hw, "GPU", how)


def rank_peak_bytes(req: Request, c: Candidate) -> float:
    """The memory model's bytes for the largest rank of a sized candidate, as a start records its peak (on CPU
    ranks the heap it keeps, with its base)."""
    return req.hardware.rank_bytes(c.memory.total, c.layout)


def _over(need: float, hw: Hardware, per: str, how: str) -> str | None:
    if need > hw.usable_bytes:
        return f"needs {need / GIB:.1f} GiB per {per} > {hw.usable_bytes / GIB:.1f} GiB usable{how}"
    return None


def candidates_for(req: Request, dp: int, tp: int, pp: int) -> list[Candidate]:
    """Every micro-batch, mode and recompute setting of valid degrees (dp, tp, pp)."""
    share = req.global_batch // dp
    micros = [req.micro_batch] if req.micro_batch is not None else divisors(share)
    # with dp = 1 the model predicts fsdp and ddp alike and zero1 (its buffers) worse, so one stands in for all;
    # where the profile holds each mode's measured host time (a GPU) they differ: one H200 ran GPT-3 XL
    # fastest in zero1 at every micro-batch (benchmarks/gpu/results/NVIDIA-H200/), so every mode is a candidate
    if dp > 1 or req.hardware.host_measured:
        modes = req.dp_modes
    else:
        modes = [m for m in req.dp_modes if m != "zero1"][:1] or req.dp_modes[:1]
    return [
        evaluate(req, Layout(dp, tp, pp, m, share // m, dp_mode=mode, recompute=rc))
        for m in micros
        for mode in modes
        for rc in req.recompute
    ]


def enumerate_candidates(req: Request) -> list[Candidate]:
    """All candidates for the request, valid or not (degree-level rejections once per degrees)."""
    out: list[Candidate] = []
    for dp, tp, pp in factorizations(req.world_size):
        reason = degree_reason(req, dp, tp, pp)
        if reason is not None:
            out.append(Candidate(dp, tp, pp, reason=reason))
        else:
            out += candidates_for(req, dp, tp, pp)
    return out
