"""The launcher's side of a warm start: whether the next phase's world may start beside the current one, and
when (train.job and checkpoint.memory do the hand-over itself; elastic.handover is the channel).

A warm start is taken at every boundary the launcher knows before it comes: the end of a steps phase (as
soon as the current world's first step is done) and the end of a time phase (WARM_LEAD_S before it). It is
refused, in one line, when the next phase holds no GPUs, or when the host memory the two worlds and the state
in memory need together would not fit: then the next world starts after the current one exits, as always.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_trainer.checkpoint.host_folders import available_bytes
from elastic_trainer.config import ModelConfig
from elastic_trainer.plan.hardware import Hardware, load_hardware
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.measured import measured_file_exists

WARM_LEAD_S = 60.0
"""A time phase's next world starts this long before the phase's end (a start takes 3-10 s here, 30-90 s for
GPT-3 XL on a cluster; starting earlier costs only the CPU the waiting ranks used to start)."""
READY_WAIT_S = 120.0
"""How long a time phase's end waits for its next world to be ready before it stops anyway (the next world
then loads when it is)."""
PROCESS_BYTES = 400 << 20
"""Host memory of one rank beyond its model state: the interpreter, torch, our stack and the process
group's buffers (measured: 300-350 MiB resident per gloo rank of gpt-tiny on this machine, rounded up)."""
STATE_BYTES_PER_PARAM = 12
"""A checkpoint holds fp32 weights and AdamW's two fp32 moments."""


@dataclass(frozen=True)
class MemoryNeed:
    current: int
    following: int
    state: int
    available: int
    shm_free: int
    """Free space of the shared-memory folder the state goes to."""
    staging: int = 0
    """GPU ranks first copy their state into pinned host memory, then write it (checkpoint/staging.py)."""

    @property
    def total(self) -> int:
        return self.current + self.following + self.state + self.staging

    @property
    def fits(self) -> bool:
        return self.total <= self.available and self.state <= self.shm_free


def world_bytes(
    model: ModelConfig, layout: Layout | None, ranks: int, seq_len: int, on_cpu: bool, hardware: Hardware | None = None
) -> int:
    """Host memory of a world's ranks on one host: the processes, and on CPU their model state and
    activations as the planner's memory model counts them (the largest stage, for every rank) times the heap
    a CPU rank keeps over that (`hardware`'s `kept_heap` figures; the `cpu` profile's by default)."""
    per_rank = PROCESS_BYTES
    if on_cpu:
        hw = hardware if hardware is not None and hardware.shared_host else load_hardware("cpu")
        if layout is None:  # planned by rank 0 at start: a full replica per rank bounds it
            per_rank += int(hw.kept_heap * model.num_params() * 16)
        else:
            from elastic_trainer.plan.memory import stage_memories

            peak = max(m.total for m in stage_memories(model, layout, seq_len, "fp32"))
            per_rank += int(hw.kept_factor(layout) * peak)
    return ranks * per_rank


def memory_need(
    model: ModelConfig,
    current: tuple[Layout | None, int],
    following: tuple[Layout | None, int],
    seq_len: int,
    on_cpu: bool,
    hardware: Hardware | None = None,
) -> MemoryNeed:
    """What the busiest host needs while both worlds live: (layout, ranks on that host) of each."""
    state = model.num_params() * STATE_BYTES_PER_PARAM
    return MemoryNeed(
        world_bytes(model, current[0], current[1], seq_len, on_cpu, hardware),
        world_bytes(model, following[0], following[1], seq_len, on_cpu, hardware),
        state,
        *available_bytes(),
        staging=0 if on_cpu else state,
    )


def device_fits(
    model: ModelConfig, current: Layout | None, following: Layout | None, seq_len: int, dtype: str, usable_bytes: float
) -> bool:
    """Whether a GPU holds the busiest rank of both worlds at once (the planner's memory model): if not, the
    next world waits for the state before it allocates its model (it starts, connects and plans early, and
    builds after the old world has released the device)."""
    if current is None or following is None:
        return False  # planned by rank 0 at start: not known here, so the safe way
    from elastic_trainer.plan.memory import stage_memories

    def peak(layout: Layout) -> int:
        return max(m.total for m in stage_memories(model, layout, seq_len, dtype))

    return peak(current) + peak(following) <= usable_bytes


def refusal(need: MemoryNeed, phase: int, host: str) -> str:
    gib = 1 << 30
    return (
        f"phase {phase + 1}: no warm start: the current world (~{need.current / gib:.1f} GiB), the next one "
        f"(~{need.following / gib:.1f} GiB) and the state in memory (~{need.state / gib:.1f} GiB"
        f"{', twice while it is staged from the GPUs' if need.staging else ''}) need "
        f"~{need.total / gib:.1f} GiB on {host}, which has {need.available / gib:.1f} GiB available "
        f"({need.shm_free / gib:.1f} GiB in its shared-memory folder); the "
        "next world starts after the current one has saved and exited"
    )


def warm_refusal(job, current: int, following: int) -> str | None:
    """The line refusing to start phase `following`'s world beside `current`'s (`job`: the launcher's
    JobSetup) for lack of host memory on its busiest host, or None."""

    def busiest(index: int) -> tuple:
        placements = job.placements(job.phases[index])
        top = max(placements, key=lambda p: p.nproc)
        return job.plans[index][0].layout, top.nproc, top.host.name

    (old, old_ranks, host), (new, new_ranks, _) = busiest(current), busiest(following)
    on_cpu = job.spec.hardware is None or job.spec.hardware.device == "cpu"
    need = memory_need(job.model, (old, old_ranks), (new, new_ranks), job.train.seq_len, on_cpu, job.spec.hardware)
    return None if need.fits else refusal(need, following, host)


def builds_early(job, current: int, following: int) -> bool:
    """Whether phase `following`'s warm world builds its model before the hand-over: on CPU hosts, and on
    GPUs whose memory holds the old and the new rank's model together."""
    hardware = job.spec.hardware
    if hardware is None or hardware.device == "cpu":
        return True
    if measured_file_exists(job.train.metrics_file):
        return False  # rank 0 re-plans with the job's measurements: not necessarily the layouts checked here
    return device_fits(
        job.model,
        job.plans[current][0].layout,
        job.plans[following][0].layout,
        job.train.seq_len,
        hardware.compute_dtype,
        hardware.usable_bytes,
    )
