"""`Hardware`: what the memory and step-time models know about a machine, loaded from
`configs/hardware/NAME.toml` (written by hand from data sheets, or measured by `elastic-trainer calibrate`).

Units: memory in GiB (2**30 bytes), bandwidth in GB/s (1e9 bytes/s) as a collective's *bus* bandwidth
(the rate of the ring algorithm's per-link traffic, as nccl-tests reports it), throughput in TFLOP/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.config import (
    DP_MODES,
    ConfigError,
    check_field_types,
    configs_dir,
    from_dict,
    positive_int,
    read_toml,
)
from elastic_trainer.plan.layout import Layout

GIB = 2**30


CPU_KEPT_HEAP = {"kept_heap": 1.5, "kept_heap_unpipelined": 2.8, "rank_base_gb": 0.2}
"""The heap CPU ranks keep over their live peak and their base, measured by benchmarks/planner/heap.py on the
2-core reference machine (configs/hardware/cpu.toml says how): what `calibrate` gives a CPU profile whose base
has none."""


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the links between devices, within a host and across hosts."""

    name: str
    """Profile name (the TOML file's stem)."""
    device: str = "cuda"
    """torch device type: cuda or cpu."""
    device_names: tuple[str, ...] = ()
    """Substrings of torch.cuda.get_device_name() this profile is for (case-insensitive)."""
    compute_dtype: str = "bf16"
    """Precision of `dtype=auto` on this device: bf16 (mixed, fp32 master weights) or fp32."""
    memory_gb: float = 80.0
    """Memory per device in GiB; with `shared_host`, the host's memory shared by all its ranks."""
    reserved_gb: float = 3.0
    """Memory the planner never fills: runtime context, communication buffers, allocator slack."""
    kept_heap: float = 1.0
    """With `shared_host`: the memory a rank keeps over the live peak the memory model counts (plan/memory.py). CPU
    ranks keep what they free (launch/allocator.py), so a rank's heap grows to its live peak plus the allocator's
    fragmentation and gloo's buffers, and stays there (measured by benchmarks/planner/heap.py)."""
    kept_heap_unpipelined: float = 0.0
    """`kept_heap` of a rank that shares data parallelism without a pipeline (dp > 1, pp = 1): FSDP2 gathers and
    frees every unit's parameters each micro-batch and zero1 gathers whole parameters each step, which leaves
    more of the heap behind (measured for fsdp and zero1; ddp is charged the same, unmeasured); 0: `kept_heap`."""
    rank_base_gb: float = 0.0
    """With `shared_host`: the memory each rank holds before its model (the interpreter, torch), GiB."""
    gpus_per_host: int = 8
    """Devices per host (the default of --gpus-per-host)."""
    tflops: float = 400.0
    """Sustained matmul throughput of one rank on large GEMMs (TFLOP/s)."""
    head_tflops: float = 0.0
    """Throughput of the output head's GEMMs (narrow d_model x vocab); 0: the same as `tflops`."""
    half_rate_tokens: float = 0.0
    """Tokens per micro-batch at which a block's GEMMs run at half of `tflops` (0: no size effect)."""
    head_half_rate_tokens: float = 0.0
    """The same for the output head's GEMMs and `head_tflops` (0: no size effect)."""
    layer_overhead_ms: float = 0.0
    """Fixed time of one block's forward + backward (kernel launches, framework overhead)."""
    microbatch_ns_per_param: float = 0.0
    """Work per micro-batch and parameter of a rank's stage beyond its blocks' and head's compute (ns): what a
    job's ranks spend per micro-batch in proportion to the weights they hold, which the blocks timed alone do
    not show (0: not charged)."""
    activation_ns: float = 0.0
    """A block's memory-bound work beside its GEMMs (norms, activation functions, residual adds, the
    attention's layout changes), forward + backward, per token and per unit of width on one tp rank (ns):
    what makes narrow models run their FLOPs slower than wide ones at the same tokens (0: not charged)."""
    compiled_speedup: float = 1.0
    """How many times faster a block's forward + backward runs under torch.compile (--compile) than eager:
    measured by `calibrate --compile`; 1.0 (no gain assumed) where it was not measured."""
    memory_bandwidth_gbs: float = 2000.0
    """Device memory bandwidth (GB/s), for memory-bound work: embedding gradients, loss."""
    embedding_grad_ns: float = 0.0
    """The token embedding's backward per micro-batch (the table's zeroed gradient, the tokens' rows added in,
    then added into the parameter's gradient), per element of the table (ns): measured by `calibrate` on CPUs;
    0: two passes over the table at `memory_bandwidth_gbs`."""
    logit_ns: float = 0.0
    """Time of softmax cross-entropy forward + backward per logit (ns), beyond the head's GEMM."""
    optimizer_ns_per_param: float = 0.05
    """Gradient clipping + AdamW step per local parameter (ns)."""
    fsdp_optimizer_ns_per_param: float = 0.0
    """The same under fsdp, measured by `calibrate --model` at a job's shapes (0: `optimizer_ns_per_param`)."""
    ddp_optimizer_ns_per_param: float = 0.0
    """The same under ddp (0: `optimizer_ns_per_param`)."""
    zero1_optimizer_ns_per_param: float = 0.0
    """The same under zero1 (0: `optimizer_ns_per_param`)."""
    fsdp_hooks_ns_per_param: float = 0.0
    """What fsdp's step takes beyond the compute, collectives and copies the model charges (the copies into and
    out of FSDP2's per-unit buffers are counted in bytes: plan/traffic.py `wrapper_bytes`), per parameter of
    the stage and per data-parallel collective (`collectives`): the measured excess over the cheapest mode at a
    job's shapes (`calibrate --model`; 0: none charged)."""
    ddp_hooks_ns_per_param: float = 0.0
    """The same for ddp."""
    zero1_hooks_ns_per_param: float = 0.0
    """The same for zero1."""
    fsdp_host_block_ms: float = 0.0
    """On a GPU: the host's time to issue one block's forward and backward for one micro-batch under fsdp
    (Python, the modules' and FSDP2's hooks, kernel launches), measured at a job's model (`calibrate --model`
    on the GPU). The device runs behind the host, so a micro-batch takes the longer of the two (0: not
    measured; `layer_overhead_ms` is added to the device's time instead)."""
    ddp_host_block_ms: float = 0.0
    """The same under ddp."""
    zero1_host_block_ms: float = 0.0
    """The same under zero1."""
    optimizer_shapes: str = ""
    """The model whose shapes the per-mode figures were measured at (empty: none measured)."""
    intra_host_gbs: float = 300.0
    """Bus bandwidth of collectives within a host (GB/s)."""
    inter_host_gbs: float = 40.0
    """Bus bandwidth of collectives across hosts (GB/s)."""
    intra_host_latency_us: float = 10.0
    """Latency of one collective step within a host."""
    inter_host_latency_us: float = 20.0
    """Latency of one collective step across hosts."""
    ring_latency: bool = False
    """Collective latency grows with n - 1 steps (gloo's ring) rather than log2 n (NCCL's trees)."""
    all_gather_share: float = 0.5
    """Seconds of an all-gather into a tensor of B bytes over n ranks, as a share of an all-reduce of B bytes
    over the same ranks: 0.5 for a ring's (NCCL); on CPU ranks parallel/gloo_comms.py's, measured by
    `calibrate` (about 0.45 on the 2-core reference machine; gloo's own took 1.2-1.9)."""
    reduce_scatter_share: float = 0.5
    """The same for a reduce-scatter from B bytes (gloo_comms': about 1.0, an all-reduce; gloo's own about 2)."""
    overlap: float = 0.8
    """Fraction of compute time that can hide data-parallel communication (0: none)."""
    shared_host: bool = False
    """True when a host's ranks share its compute units and memory (CPU processes); False for GPUs."""
    compute_units: float = 0.0
    """With `shared_host`: how many ranks' worth of compute the host delivers at once (measured speed-up of
    ranks computing together; at most its cores)."""
    storage_gbs: float = 2.0
    """Read or write bandwidth of one host to the shared checkpoint storage (GB/s): the save and load of a
    restart through storage (the simulated clock's model of downtime after a phase without GPUs)."""
    restart_s: float = 30.0
    """Seconds from the old processes' exit to the new ones' first step, without the load: process start,
    rendezvous, communicator set-up, model build (the simulated clock's restart after a phase without GPUs)."""
    shm_write_gbs: float = 2.5
    """One rank's rate of writing its part of the training state into its host's shared memory (GB/s; on a
    GPU: device to host and the copy into /dev/shm); with `shared_host` the host's `compute_units` bound the
    ranks writing at once. The write of a planned hand-over (the simulated clock's model of downtime)."""
    shm_read_gbs: float = 3.0
    """One rank's rate of reading its part of the state from its host's shared memory into its model and
    optimizer (GB/s; on a GPU: /dev/shm to host to device): the read of a planned hand-over."""
    handover_setup_s: float = 3.0
    """Fixed seconds of a planned hand-over beyond its copies: the stop and hand-over signals, DCP's save and
    load planning and metadata, the first step after it that the warm-up did not make fast."""

    def __post_init__(self) -> None:
        check_field_types(self, f"hardware {self.name}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and value < 0:
                raise ConfigError(f"hardware {self.name}: {f.name}={value} must not be negative")
        if self.compiled_speedup <= 0:
            raise ConfigError(f"hardware {self.name}: compiled_speedup={self.compiled_speedup} must be positive")
        if self.reserved_gb >= self.memory_gb:
            raise ConfigError(
                f"hardware {self.name}: reserved_gb={self.reserved_gb} must be below memory_gb={self.memory_gb}"
            )
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"hardware {self.name}: device={self.device!r} is not one of cuda, cpu")
        if self.compute_dtype not in ("bf16", "fp32"):
            raise ConfigError(f"hardware {self.name}: compute_dtype={self.compute_dtype!r} is not one of bf16, fp32")
        for key in (
            "memory_gb",
            "tflops",
            "memory_bandwidth_gbs",
            "intra_host_gbs",
            "inter_host_gbs",
            "storage_gbs",
            "shm_write_gbs",
            "shm_read_gbs",
            "all_gather_share",
            "reduce_scatter_share",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"hardware {self.name}: {key}={getattr(self, key)} must be positive")
        positive_int(f"hardware {self.name}: gpus_per_host", self.gpus_per_host)
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"hardware {self.name}: overlap={self.overlap} must be in [0, 1]")
        if self.restart_s < 0:
            raise ConfigError(f"hardware {self.name}: restart_s={self.restart_s} must not be negative")
        if self.kept_heap < 1:
            raise ConfigError(
                f"hardware {self.name}: kept_heap={self.kept_heap} must be at least 1 (a rank keeps "
                "at least its live peak)"
            )
        if 0 < self.kept_heap_unpipelined < 1:
            raise ConfigError(
                f"hardware {self.name}: kept_heap_unpipelined={self.kept_heap_unpipelined} must be "
                "at least 1 (or 0: kept_heap) (a rank keeps at least its live peak)"
            )
        if self.shared_host and self.compute_units < 1:
            raise ConfigError(f"hardware {self.name}: shared_host needs compute_units >= 1, got {self.compute_units}")

    def optimizer_ns(self, dp_mode: str) -> float:
        """Clipping + AdamW per local parameter under `dp_mode` (ns): measured for the mode, else the common figure."""
        return getattr(self, f"{dp_mode}_optimizer_ns_per_param", 0.0) or self.optimizer_ns_per_param

    def hooks_ns(self, dp_mode: str) -> float:
        """The mode's measured excess per stage parameter (ns), 0 where none was measured."""
        return getattr(self, f"{dp_mode}_hooks_ns_per_param", 0.0)

    def host_block_ms(self, dp_mode: str) -> float:
        """The host's time per block and micro-batch under `dp_mode` on an asynchronous device (ms), 0 where
        none was measured (and always on `shared_host` CPU ranks, which compute as they issue)."""
        return 0.0 if self.shared_host else getattr(self, f"{dp_mode}_host_block_ms", 0.0)

    @property
    def host_measured(self) -> bool:
        """A GPU profile whose host times were measured (`calibrate --model` on the GPU): the step-time model
        then also charges FSDP2's copies in device memory (plan/traffic.py `wrapper_bytes`, as it does on
        `shared_host` CPU ranks), as the figures it was checked with did. A data-sheet profile's `tflops` lumps
        such work into its sustained rate."""
        return not self.shared_host and any(self.host_block_ms(m) for m in DP_MODES)

    @property
    def counts_copies(self) -> bool:
        """Whether the step-time model charges FSDP2's copies around its collectives by their bytes
        (plan/traffic.py `wrapper_bytes`): on CPU ranks and on GPUs whose host was measured."""
        return self.shared_host or self.host_measured

    def rank_bytes(self, live: float, layout: Layout) -> float:
        """The memory one rank of `layout` takes from its host when the memory model counts `live` bytes at its
        peak: on `shared_host` CPU ranks, its base and the heap it keeps; on a GPU, `live`."""
        if not self.shared_host:
            return live
        return self.rank_base_gb * GIB + self.kept_factor(layout) * live

    def kept_factor(self, layout: Layout) -> float:
        """The heap a CPU rank of `layout` keeps over its live peak: `kept_heap_unpipelined` for dp > 1 without a
        pipeline where the profile gives one, else `kept_heap`."""
        return (layout.dp > 1 and layout.pp == 1 and self.kept_heap_unpipelined) or self.kept_heap

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * GIB

    def to_toml(self) -> str:
        """The profile as TOML (flat keys), readable by `load_hardware`."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value)  # a TOML basic string: quotes and backslashes escaped
            elif isinstance(value, tuple):
                text = "[" + ", ".join(json.dumps(v) for v in value) + "]"
            elif isinstance(value, float):
                text = repr(float(f"{value:.6g}"))  # always has a '.' or an exponent: a TOML float
            else:
                text = str(value)
            lines.append(f"{f.name} = {text}")
        return "\n".join(lines) + "\n"


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "hardware").glob("*.toml"))


def load_hardware(name_or_path: str | os.PathLike) -> Hardware:
    """A profile by name (configs/hardware/NAME.toml) or a TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = configs_dir() / "hardware" / f"{name_or_path}.toml"
        if not path.exists():
            raise ConfigError(
                f"unknown hardware {str(name_or_path)!r} (valid: {', '.join(hardware_presets()) or 'none found'})"
            )
    table = dict(read_toml(path))
    table.setdefault("name", path.stem)
    legacy = table.pop("reduce_scatter_as_all_reduce", False)  # profiles written before 2026-11-28's shares
    if not isinstance(legacy, bool):
        raise ConfigError(
            f"hardware profile {str(path)!r}: reduce_scatter_as_all_reduce={legacy!r} must be true or "
            "false (or give reduce_scatter_share)"
        )
    if legacy:
        table.setdefault("reduce_scatter_share", 1.0)
    if isinstance(table.get("device_names"), list):
        table["device_names"] = tuple(table["device_names"])
    return from_dict(Hardware, table, f"hardware profile {str(path)!r}")


def hardware_for_device(device_type: str, device_name: str | None = None) -> Hardware:
    """The profile for this machine: `cpu` without a GPU, else the one whose device_names match."""
    if device_type == "cpu":
        return load_hardware("cpu")
    name = (device_name or "").lower()
    matches = []
    for preset in hardware_presets():
        hw = load_hardware(preset)
        hits = [len(s) for s in hw.device_names if s.lower() in name]
        if hw.device == device_type and hits:
            matches.append((max(hits), preset, hw))
    if not matches:
        raise ConfigError(
            f"no hardware profile matches GPU {device_name!r}: pass --hardware NAME "
            f"(valid: {', '.join(hardware_presets())}) or write one with `elastic-trainer calibrate`"
        )
    return max(matches, key=lambda m: (m[0], m[1]))[2]
