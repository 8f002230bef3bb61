"""Bytes the data-parallel modes move in memory per parameter of a stage beyond the compute: the gradient summed
over a step's micro-batches (`accumulation_bytes`) and FSDP2's copies around its collectives (`wrapper_bytes`).
plan/step_time.py charges them at the profile's memory bandwidth."""

from __future__ import annotations

from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import DTYPE_BYTES, MASTER_BYTES


def accumulation_bytes(layout: Layout, dtype: str) -> float:
    """Bytes per parameter of the stage moved per micro-batch (the step's mean) keeping the gradient summed over
    the step's micro-batches until its one reduction. zero1's hooks copy the first micro-batch's gradient into
    the fp32 buffer (read e, write 4) and add each later one into it (read e + 4, write 4). fsdp and ddp
    reduce once per step (pipelined, and ddp always; fsdp without a pipeline reduces every micro-batch, which
    wrapper_bytes charges) and sum the full-size gradients in between: FSDP2 casts the first into its fp32
    accumulator and adds the later ones into it, the same bytes as zero1's; in fp32 autograd keeps the first
    as it is and adds each later one in place (read 8, write 4)."""
    e, a = DTYPE_BYTES[dtype], layout.num_microbatches
    if layout.dp_mode == "fsdp" and layout.pp == 1:
        return 0.0
    first = 0 if layout.dp_mode != "zero1" and e == MASTER_BYTES else e + MASTER_BYTES
    return (first + (a - 1) * (e + 2 * MASTER_BYTES)) / a


def wrapper_bytes(layout: Layout, dtype: str, cpu_ranks: bool = False, root_share: float = 0.0) -> tuple[float, float]:
    """(per micro-batch, per step) bytes that fsdp and ddp (FSDP2, mixed precision) move in memory per parameter
    of the stage around their collectives (zero1's are charged apart). On a GPU: an unshard casts the fp32
    shard into the all-gather's input (read 4, write e per shard element), gathers it (the collective writes e)
    and copies it out into the parameters (read e, write e); a gradient reduction casts the gradient to fp32
    into the reduce-scatter's input (read e, write 4), which writes the fp32 shard, added into the sharded
    gradient (read 4 + 4, write 4). fsdp without a pipeline unshards in forward and again in backward and
    reduces every micro-batch, with one it does each once per step; ddp unshards every micro-batch and reduces
    once per step. Byte counts from FSDP2's path, not measured one by one; the sum was checked against one GPU
    (benchmarks/gpu/results/NVIDIA-H200/README.md).

    `cpu_ranks` (gloo ranks sharing a host, whose collectives `calibrate` timed with their own writes), as torch
    2.13 runs the engine's units (parallel/data_parallel.py), counted per unshard and reduction
    (tests/unit/test_fsdp_copies.py counts them in a real step):
    - fsdp: an unshard copies the shard into the all-gather's input (read 4, write e per shard element) and
      the gathered buffer out into the parameters (read e, write e); a reduction copies the gradient into the
      reduce-scatter's input (read e, write 4) and, from a step's second reduction on, adds the reduced shard
      into the sharded gradient (read 8, write 4; the first is kept as it is). Without a pipeline the blocks
      reshard after forward and unshard again in backward, the root's units (`root_share` of the stage's
      parameters) stay unsharded, and every micro-batch reduces; under a pipeline each unit unshards and
      reduces once per step.
    - ddp, FSDP2's `replicate`: a group of one that gathers nothing but copies the parameters into place at
      each unshard (read 4, write e; cast first in a lower precision: 4 + 3e), once per micro-batch (it keeps
      them through backward) or under a pipeline once per step, and reduces once per step: the gradient
      copied in (read e, write 4), divided into a new buffer and copied into the output (read 4, write 4,
      twice), then all-reduced in place.
    Nothing where the engine wraps nothing (fp32 at dp 1)."""
    e, dp, a = DTYPE_BYTES[dtype], layout.dp, layout.num_microbatches
    if not cpu_ranks:
        unshard, reduce = (MASTER_BYTES + e) / dp + 4 * e, e + MASTER_BYTES + 4 * MASTER_BYTES / dp
        if layout.dp_mode == "fsdp":
            return (2 * unshard + reduce, 0.0) if layout.pp == 1 else (0.0, unshard + reduce)
        return (unshard, reduce) if layout.dp_mode == "ddp" else (0.0, 0.0)
    if layout.dp_mode == "zero1" or (layout.dp == 1 and e == MASTER_BYTES):
        return 0.0, 0.0
    if layout.dp_mode == "ddp":
        unshard = MASTER_BYTES + e + (0 if e == MASTER_BYTES else 2 * e)
        reduce = e + MASTER_BYTES + 4 * MASTER_BYTES
        return (unshard, reduce) if layout.pp == 1 else (0.0, unshard + reduce)
    unshard, reduce = (MASTER_BYTES + e) / dp + 2 * e, e + MASTER_BYTES
    if layout.pp > 1:
        return 0.0, unshard + reduce
    return (2 - root_share) * unshard + reduce + 3 * MASTER_BYTES / dp * (a - 1) / a, 0.0
