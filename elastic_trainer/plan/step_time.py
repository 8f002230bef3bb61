"""Predicted time of one optimizer step under a Layout, from FLOPs and bytes on a `Hardware` profile.

- **Compute**: a block's forward costs 24*t*d^2 + 2*t*s*d FLOPs for t tokens (its GEMMs, and causal
  attention), split over tp ranks; backward costs twice that, recomputation once more. The output head
  (2*t*d*vocab forward) runs on the last stage and is replicated across tp ranks, as in the engine. The
  rate is `tflops` scaled by t / (t + half_rate_tokens) (small GEMMs run slower; the head's `head_tflops`
  by t / (t + head_half_rate_tokens)), plus a fixed time per block and memory-bound work at
  `memory_bandwidth_gbs`: softmax cross-entropy per logit, the embedding gradient (on the first stage,
  `embedding_grad_ns` per table element where `calibrate` measured it: on the CPU, 2-3x two passes at the
  bandwidth), and the gradient summed over a step's micro-batches (`accumulation_bytes`: zero1's hooks
  copy then add every gradient into the fp32 buffer; fsdp and ddp without a reduction per micro-batch sum
  their full-size gradients as well, in FSDP2's fp32 accumulator or, in fp32, in place). Where the profile
  says (`activation_ns`), a block's memory-bound work per token and unit of width is added, and where it says
  (`microbatch_ns_per_param`), work per micro-batch and parameter of the stage: on the shared CPU host a
  job's pipeline stages spent 0.55-0.70 ns of CPU per parameter and micro-batch beyond what their blocks
  timed alone take (gpt3-small at 8 ranks, benchmarks/planner/README.md).
- **The host** (GPU profiles whose host was measured, `calibrate --model` on the GPU): the device runs
  behind the host that issues its kernels, so a micro-batch on a stage takes the longer of the device's
  time and the host's (`{mode}_host_block_ms` per block; FSDP2's hooks make fsdp's 2.5x zero1's on an H200),
  and the fixed time per block (`layer_overhead_ms`, the launches) is the host's and is not added. Such
  profiles also charge FSDP2's casts and copies around its collectives by bytes (`wrapper_bytes`, as CPU
  profiles do), which a data-sheet profile's sustained rate lumps in.
- **Tensor parallel**: 2 all-reduces of the (micro_batch, seq, d_model) activation per block in forward,
  2 in backward (2 more when recomputing), at intra-host bandwidth, not overlapped.
- **Pipeline**: stage i takes t_i per micro-batch (compute, tp all-reduces, point-to-point sends);
  a step takes sum_i t_i + (a - 1) * max_i t_i, whose idle share is the bubble (pp - 1) / (a + pp - 1) for
  equal stages.
- **Data parallel**: FSDP gathers the stage's parameters (compute dtype) and reduce-scatters fp32
  gradients, one collective per unit (each block, and the root): every micro-batch without a pipeline
  (gather in forward and again in backward), once per step with one (the schedule defers the reduction to
  the end); ddp all-reduces once per step. zero1 reduce-scatters its fp32 gradient buffer (the whole
  stage) once per step and all-gathers the updated master shards back (cast to the compute dtype) after
  the optimizer step, then copies them into the parameters (read e bytes, write e); none of it overlaps
  compute. An all-gather or reduce-scatter costs its profile's share of an all-reduce of the same bytes (a
  ring's 0.5; over gloo, parallel/gloo_comms.py's, measured by `calibrate`: about 0.45 and 1.0). Bandwidth is
  intra-host when each dp group fits within a host. Communication hides behind `overlap` of the compute it
  can run under; the rest adds to the step. The tied embedding's gradient is all-reduced between the first
  and last stage (1/dp of it under fsdp and zero1).
- **Optimizer**: `optimizer_ns_per_param` per local parameter (clipping + AdamW), or the mode's own figure
  where `calibrate --model` measured one at a job's shapes (`Hardware.optimizer_ns`): 1/dp of the stage
  under fsdp and zero1.
- **Hooks**: FSDP2's copies into and out of its per-unit buffers around each collective (fsdp, and ddp, which
  is FSDP2's `replicate`) are counted in bytes (`wrapper_bytes`) on CPU ranks and on GPUs whose host was
  measured, at the measured bandwidth. Where `calibrate --model` measured a mode's excess beyond them over the
  cheapest mode at a job's shapes (`Hardware.hooks_ns`: what the counted copies leave out, the allocations,
  the hooks' own work), it is charged per parameter of the stage and per data-parallel collective
  (`collectives`); on shared hosts both are slowed as the host's ranks share its cores.
- **Shared hosts** (CPU processes): ranks share `compute_units` cores. The pipeline's compute is then the
  schedule run with the cores shared among the ranks working at each moment (plan/shared_cores.py; without
  a pipeline, the host's whole compute divided by its cores), plus each micro-batch's tp all-reduces and
  sends; the tp and dp collectives (which need the CPU too) run ranks / compute_units times slower than
  `calibrate` measured them on idle ranks (tp slowed too since 2026-11-28: gpt3-medium at 4 ranks, its tp4
  layouts 25-40 % slower than predicted; re-predicted, Spearman 0.84 -> 0.94), the pipeline's sends not.
  With a pipeline, a stage's own data-parallel collectives before the optimizer step (fsdp's all-gather
  before its first forward, the gradient reductions after its last backward) are work in that schedule at
  their idle-link time, so that the stages which finish early reduce beside the others' backward
  (`scheduled_comm`; gpt3-small on 8 ranks, dp2 x pp4, zero1: measured 0.16 s of it left at the end of the
  step, where the whole reduction charged after the schedule was 0.97 s).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from elastic_trainer.config import ModelConfig
from elastic_trainer.plan.hardware import Hardware
from elastic_trainer.plan.layout import Layout, stage_layers
from elastic_trainer.plan.memory import DTYPE_BYTES, MASTER_BYTES, stage_elements, stage_numel
from elastic_trainer.plan.shared_cores import makespan
from elastic_trainer.plan.topology import Topology
from elastic_trainer.plan.traffic import accumulation_bytes, wrapper_bytes


@dataclass(frozen=True)
class Link:
    """The connection a group of ranks communicates over."""

    gbs: float
    """Bus bandwidth, GB/s."""
    latency_us: float
    """Latency of one algorithm step."""
    ring_latency: bool = False
    """Latency steps grow like the ring's n - 1 (gloo) instead of a tree's log2 n (NCCL)."""
    gather_share: float = 0.5
    """An all-gather's time as a share of an all-reduce's of the same bytes (Hardware.all_gather_share)."""
    scatter_share: float = 0.5
    """A reduce-scatter's (Hardware.reduce_scatter_share)."""

    def _steps(self, n: int) -> int:
        return n - 1 if self.ring_latency else math.ceil(math.log2(n))

    def all_reduce(self, nbytes: float, n: int) -> float:
        """Seconds of an all-reduce of an nbytes tensor over n ranks (ring bandwidth term)."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / (self.gbs * 1e9) + 2 * self._steps(n) * self.latency_us * 1e-6

    def gather(self, nbytes: float, n: int) -> float:
        """Seconds of an all-gather into an nbytes tensor over n ranks (a ring's: half an all-reduce's)."""
        return self.gather_share * self.all_reduce(nbytes, n)

    def reduce_scatter(self, nbytes: float, n: int) -> float:
        """Seconds of a reduce-scatter from an nbytes tensor over n ranks."""
        return self.scatter_share * self.all_reduce(nbytes, n)

    def send(self, nbytes: float) -> float:
        return nbytes / (self.gbs * 1e9) + self.latency_us * 1e-6

    def slowed(self, factor: float) -> Link:
        """This link `factor` times slower in bandwidth and latency."""
        return dataclasses.replace(self, gbs=self.gbs / factor, latency_us=self.latency_us * factor)


def sharing_slowdown(hw: Hardware, hosts: Topology) -> float:
    """How much slower than on idle ranks the work that needs the CPU besides compute (collectives, the modes'
    hooks) runs on a shared host: its ranks / compute_units; 1 elsewhere."""
    return max(1.0, hosts.largest / hw.compute_units) if hw.shared_host else 1.0


@dataclass(frozen=True)
class Links:
    """The link each kind of group uses: intra-host when every such group fits within a host."""

    tp: Link
    dp: Link
    pp: Link

    @classmethod
    def of(cls, layout: Layout, hw: Hardware, hosts: Topology, idle: bool = False) -> Links:
        """`idle`: as `calibrate` measured them, on ranks with a core each (not slowed for a shared host)."""
        shares = {"gather_share": hw.all_gather_share, "scatter_share": hw.reduce_scatter_share}
        intra = Link(hw.intra_host_gbs, hw.intra_host_latency_us, hw.ring_latency, **shares)
        inter = Link(hw.inter_host_gbs, hw.inter_host_latency_us, hw.ring_latency, **shares)
        dp = intra if hosts.within(layout.dp * layout.tp) else inter
        tp = intra if hosts.within(layout.tp) else inter
        slow = 1.0 if idle else sharing_slowdown(hw, hosts)  # collectives need the CPU too, which a shared
        # host's ranks share
        return cls(tp=tp.slowed(slow), dp=dp.slowed(slow), pp=intra if hosts.single else inter)


def block_flops(model: ModelConfig, tokens: int, seq_len: int, tp: int) -> float:
    """Forward FLOPs of one block on one tp rank for a micro-batch of `tokens` tokens."""
    d = model.d_model
    return (24 * tokens * d * d + 2 * tokens * seq_len * d) / tp


def head_flops(model: ModelConfig, tokens: int) -> float:
    """Forward FLOPs of the output head (replicated across tp ranks)."""
    return 2 * tokens * model.d_model * model.vocab_size


@dataclass(frozen=True)
class StageTime:
    """Seconds per micro-batch on one stage."""

    compute: float
    tp_comm: float
    p2p: float
    blocks: float = 0.0
    """The transformer blocks' part of `compute` (the rest: output head, embedding gradient, gradient sums)."""
    host_wait: float = 0.0
    """The part of `compute` the device waits on the host issuing its kernels (GPU profiles whose host was
    measured: what the host's time per micro-batch exceeds the device's by)."""
    weights: float = 0.0
    """The part of `compute` charged per parameter of the stage (Hardware.microbatch_ns_per_param)."""

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.p2p


def stage_time(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    dtype: str,
    hw: Hardware,
    links: Links,
    stage: int,
    block_speedup: float = 1.0,
) -> StageTime:
    """Forward + backward of one micro-batch on `stage`; the blocks' compute `block_speedup` times faster
    (compiled)."""
    tokens = layout.micro_batch * seq_len
    rate = hw.tflops * 1e12 * tokens / (tokens + hw.half_rate_tokens)
    head_rate = (hw.head_tflops or hw.tflops) * 1e12 * tokens / (tokens + hw.head_half_rate_tokens)
    n_blocks = len(stage_layers(model.n_layers, layout.pp)[stage])
    passes = 4 if layout.recompute else 3  # forward, backward (2x), recomputed forward
    host = hw.host_block_ms(layout.dp_mode) * 1e-3 * passes / 3  # issuing a block (0: not measured)
    block = (
        passes * block_flops(model, tokens, seq_len, layout.tp) / rate
        + passes / 3 * tokens * model.d_model / layout.tp * hw.activation_ns * 1e-9
        + (0.0 if host else hw.layer_overhead_ms * 1e-3)
    )
    root, block_params, _ = stage_elements(model, layout, stage)
    params = root + block_params * n_blocks
    weights = params * hw.microbatch_ns_per_param * 1e-9
    compute = n_blocks * block / block_speedup + weights
    emb_grad = 2 * model.vocab_size * model.d_model * MASTER_BYTES / (hw.memory_bandwidth_gbs * 1e9)
    if stage == 0:  # the embedding's backward: measured (CPU profiles), else two passes over the table
        compute += (model.vocab_size * model.d_model * hw.embedding_grad_ns * 1e-9) or emb_grad
    compute += params * accumulation_bytes(layout, dtype) / (hw.memory_bandwidth_gbs * 1e9)
    if hw.counts_copies:  # FSDP2's casts and copies around its collectives (none in zero1)
        per_microbatch, _ = wrapper_bytes(layout, dtype, hw.shared_host, root / params)
        compute += params * per_microbatch / (hw.memory_bandwidth_gbs * 1e9)
    if stage == layout.pp - 1:
        logits = tokens * model.vocab_size
        compute += 3 * head_flops(model, tokens) / head_rate + logits * hw.logit_ns * 1e-9 + emb_grad
    host_wait = max(0.0, n_blocks * host - compute)  # the device runs behind the host: the longer of the two
    compute += host_wait
    hidden = tokens * model.d_model * DTYPE_BYTES[dtype]
    per_block = (6 if layout.recompute else 4) * links.tp.all_reduce(hidden, layout.tp)
    sends = (stage > 0) + (stage < layout.pp - 1)  # activation forward, its gradient backward
    p2p = sends * links.pp.send(hidden)
    return StageTime(compute, n_blocks * per_block, p2p, n_blocks * block / block_speedup, host_wait, weights)


def _exposed(comm: float, window: float, overlap: float) -> float:
    return max(0.0, comm - overlap * window)


def _per_unit(collective, root: int, block: int, n: int, nbytes: int) -> float:
    """One collective per data-parallel unit: every block is its own, the root (if it holds any) another."""
    return (collective(root * nbytes) if root else 0.0) + n * collective(block * nbytes)


def zero1_comm(
    model: ModelConfig, layout: Layout, dtype: str, hw: Hardware, links: Links, stage: int
) -> tuple[float, float]:
    """zero1's per-step seconds on one stage: (the gradient reduce-scatter at the end of backward, the
    all-gather of the updated weights after the optimizer step with their copy into the parameters): one
    collective each way over the whole stage, none of it overlapping compute."""
    root, block, n = stage_elements(model, layout, stage)
    whole, e = root + block * n, DTYPE_BYTES[dtype]
    copy = whole * 2 * e / (hw.memory_bandwidth_gbs * 1e9)  # gathered in the compute dtype
    return links.dp.reduce_scatter(whole * MASTER_BYTES, layout.dp), links.dp.gather(whole * e, layout.dp) + copy


def dp_comm_time(
    model: ModelConfig, layout: Layout, dtype: str, hw: Hardware, links: Links, stage: int, t_mb: float
) -> float:
    """Exposed data-parallel communication of one stage per step; t_mb is its time per micro-batch."""
    root, block, n = stage_elements(model, layout, stage)
    a, dp, e = layout.num_microbatches, layout.dp, DTYPE_BYTES[dtype]
    if layout.dp_mode == "zero1":
        return sum(zero1_comm(model, layout, dtype, hw, links, stage))
    if dp == 1:
        return 0.0
    if layout.dp_mode == "ddp":
        comm = _per_unit(lambda b: links.dp.all_reduce(b, dp), root, block, n, 4)
        return _exposed(comm, 2 / 3 * t_mb if layout.pp == 1 else 0.0, hw.overlap)
    gather = _per_unit(lambda b: links.dp.gather(b, dp), root, block, n, e)
    scatter = _per_unit(lambda b: links.dp.reduce_scatter(b, dp), root, block, n, 4)
    if layout.pp == 1:  # blocks are gathered again for backward; the root stays gathered
        regather = _per_unit(lambda b: links.dp.gather(b, dp), 0, block, n, e)
        return a * _exposed(gather + regather + scatter, t_mb, hw.overlap)
    return _exposed(gather, t_mb / 3, hw.overlap) + scatter


def scheduled_comm(
    model: ModelConfig, layout: Layout, dtype: str, hw: Hardware, idle: Links, stage: int
) -> tuple[float, float]:
    """On a shared host, a pipelined stage's data-parallel collectives that run within its schedule, in seconds
    on idle links (`shared_cores.makespan` shares the cores among them and the other stages' compute): (before
    its first forward: fsdp's all-gather; after its last backward: fsdp's and zero1's reduce-scatter, ddp's
    all-reduce). zero1's all-gather follows the optimizer step, after every stage's backward: not here."""
    root, block, n = stage_elements(model, layout, stage)
    dp, e = layout.dp, DTYPE_BYTES[dtype]
    if dp == 1:
        return 0.0, 0.0
    if layout.dp_mode == "zero1":
        return 0.0, zero1_comm(model, layout, dtype, hw, idle, stage)[0]
    if layout.dp_mode == "ddp":
        return 0.0, _per_unit(lambda b: idle.dp.all_reduce(b, dp), root, block, n, 4)
    return (
        _per_unit(lambda b: idle.dp.gather(b, dp), root, block, n, e),
        _per_unit(lambda b: idle.dp.reduce_scatter(b, dp), root, block, n, 4),
    )


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step and where they go."""

    pipeline: float
    """Forward/backward of all micro-batches through all stages (with tp all-reduces and p2p sends)."""
    dp_comm: float
    """Data-parallel and tied-embedding communication not hidden behind compute (zero1: with the copy of the
    gathered weights into the parameters)."""
    optimizer: float
    bubble: float
    """Idle share of the pipeline, (pp - 1) / (num_microbatches + pp - 1)."""
    stages: tuple[StageTime, ...] = ()
    """Each stage's time per micro-batch (what `plan/explain.py` splits the pipeline term by)."""
    shared_cores: float = 0.0
    """Of `pipeline`: what ranks sharing a host's cores add (shared_host profiles)."""
    tied: float = 0.0
    """Of `dp_comm`: the tied embedding's gradient all-reduce between the first and last stage."""
    after_step: float = 0.0
    """Of `dp_comm`: what runs after the optimizer step (zero1's all-gather and copy of the weights)."""
    hooks: float = 0.0
    """The data-parallel mode's measured excess (Hardware.hooks_ns), in forward and backward."""

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_comm + self.optimizer + self.hooks


def step_time(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    dtype: str,
    hw: Hardware,
    hosts: Topology | int,
    block_speedup: float = 1.0,
) -> StepTime:
    """`hosts`: the ranks on each host, or a number of ranks per host that they fill in turn; `block_speedup`:
    the blocks' compute is that many times faster (compiled, Hardware.compiled_speedup)."""
    if not isinstance(hosts, Topology):
        hosts = Topology.uniform(layout.world_size, hosts)
    links = Links.of(layout, hw, hosts)
    stages = [stage_time(model, layout, seq_len, dtype, hw, links, s, block_speedup) for s in range(layout.pp)]
    a = layout.num_microbatches
    pipeline = sum(t.total for t in stages) + (a - 1) * max(t.total for t in stages)
    dp, slowest = max((dp_comm_time(model, layout, dtype, hw, links, s, t.total), s) for s, t in enumerate(stages))
    after = zero1_comm(model, layout, dtype, hw, links, slowest)[1] if layout.dp_mode == "zero1" else 0.0
    shard = layout.dp if layout.dp_mode in ("fsdp", "zero1") else 1
    tied = links.pp.all_reduce(model.vocab_size * model.d_model * MASTER_BYTES / shard, 2) if layout.pp > 1 else 0.0
    dp += tied
    local = [stage_numel(model, layout, s) / shard for s in range(layout.pp)]
    optimizer = max(local) * hw.optimizer_ns(layout.dp_mode) * 1e-9
    alone = pipeline
    if hw.shared_host:
        # ranks of a host share its cores: the host's whole work, spread over its cores, bounds the step
        ranks = hosts.largest
        cores = min(hw.compute_units, ranks)
        copies = layout.dp * layout.tp * ranks / layout.world_size  # ranks per stage on this host
        passes = 4 if layout.recompute else 3
        heads = tails = ()
        if layout.pp > 1 and layout.dp > 1:  # each stage's collectives beside the other stages' compute
            idle = Links.of(layout, hw, hosts, idle=True)
            heads, tails = zip(*(scheduled_comm(model, layout, dtype, hw, idle, s) for s in range(layout.pp)))
            dp = tied + after
        shared = makespan(tuple(t.compute for t in stages), a, copies, cores, 1 / passes, heads, tails)
        pipeline = max(pipeline, shared + a * max(t.tp_comm + t.p2p for t in stages))
        optimizer = sum(local) * copies * hw.optimizer_ns(layout.dp_mode) * 1e-9 / cores
    return StepTime(
        pipeline,
        dp,
        optimizer,
        (layout.pp - 1) / (a + layout.pp - 1),
        tuple(stages),
        pipeline - alone,
        tied,
        after,
        hooks_time(model, layout, hw, hosts, dtype),
    )


def collectives(layout: Layout) -> int:
    """Data-parallel collectives per unit and step: without a pipeline fsdp gathers in forward, again in
    backward and reduce-scatters, every micro-batch (the engine turns gradient sync off between micro-batches
    for ddp only); with one it gathers once per step (keeping the gathered parameters for backward) and
    reduce-scatters once; ddp all-reduces once; zero1 reduce-scatters and all-gathers once."""
    if layout.dp_mode == "fsdp":
        return 3 * layout.num_microbatches if layout.pp == 1 else 2
    return 1 if layout.dp_mode == "ddp" else 2


def hooks_time(model: ModelConfig, layout: Layout, hw: Hardware, hosts: Topology, dtype: str = "bf16") -> float:
    """The mode's own work per step beyond its collectives, on the largest stage: the per-step part of
    `wrapper_bytes` on a GPU whose host was measured and on CPU ranks; on these also the excess `calibrate`
    measured beyond those copies (Hardware.hooks_ns) per parameter and collective, both slowed as the host's
    ranks share its cores."""
    whole = max(stage_numel(model, layout, s) for s in range(layout.pp))  # tp-local, before dp sharding
    if hw.host_measured:
        return whole * wrapper_bytes(layout, dtype)[1] / (hw.memory_bandwidth_gbs * 1e9)
    copies = whole * wrapper_bytes(layout, dtype, True)[1] / (hw.memory_bandwidth_gbs * 1e9) if hw.shared_host else 0.0
    excess = hw.hooks_ns(layout.dp_mode) * 1e-9 * whole * collectives(layout) if layout.dp > 1 else 0.0
    return (copies + excess) * sharing_slowdown(hw, hosts)
