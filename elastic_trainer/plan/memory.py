"""Memory of one rank under a Layout: parameters, gradients, AdamW state, working copies, activations.

Pure arithmetic that mirrors what the engine allocates (parallel/engine.py):

- **State** (exact; tests/distributed/test_memory_model.py counts the bytes on forked ranks): every
  parameter of the rank's pipeline stage, in its tensor-parallel local shape, is kept in fp32 (the master
  copy, also under bf16 mixed precision). With FSDP (`dp_mode="fsdp"`) each one is split along dim 0 like
  `torch.chunk` into ceil(n / dp) rows per rank; FSDP2 pads every rank's parameter and gradient storage to
  that size, while AdamW's exp_avg and exp_avg_sq take the rank's real, possibly shorter, slice, plus a
  4-byte `step` per parameter. Replicated data parallelism (`"ddp"`) keeps everything whole. ZeRO-1
  (`"zero1"`, parallel/zero.py) keeps the parameters whole in the compute dtype (e bytes each) and shards
  the rest as FSDP2 does: the padded fp32 master shard, the padded shard of the dp-summed gradients and
  AdamW's state of the real rows, plus an fp32 gradient buffer of all dp padded shards: e + 4 bytes per
  parameter more than FSDP.
- **Working memory** (modeled): the compute-dtype copies FSDP2 gathers and the gradient buffers it reduces.
  zero1's buffers are state; autograd's compute-dtype gradient of a parameter lives until the hook moves
  it into the buffer, the largest parameter's at most (without a pipeline the tied embedding's: its head
  gradient waits through the whole backward for the embedding's, and at the end of backward, activations
  freed, the two and their sum are live: `end_of_backward`, measured in test_memory_peak.py):

  | case                       | parameter copies          | gradient buffers                  |
  |----------------------------|---------------------------|-----------------------------------|
  | no wrapper (dp=1, fp32)    | none                      | none                              |
  | fsdp, pp=1                 | root + 2 blocks (e)       | root + 2 blocks (e + 4 fp32)      |
  | fsdp, pp>1 (no resharding) | whole stage (e)           | whole stage (4, accumulated)      |
  | ddp                        | whole stage (e)           | whole stage (4, accumulated)      |
  | zero1                      | none (whole, in state)    | largest parameter (e)             |

  where e is the compute dtype's size and the root is the embeddings and final LayerNorm.
- **Activations** (checked against autograd's saved tensors in tests/unit/test_memory.py): a block keeps
  b*s*d*(4 + 12/tp) elements (its input, both LayerNorm inputs and outputs, fused QKV, attention output,
  MLP hidden before and after GELU) plus LayerNorm statistics and the attention log-sum-exp; with
  recompute only its input. With dropout the attention probabilities are materialized (fp32 softmax
  output, keep mask, dropped copy) instead of the log-sum-exp, and both residual branches keep a mask.
  The last stage keeps the fp32 log-softmax of b*s*vocab logits (and, in a pipeline, the logits
  themselves); a first stage without the head makes the embedding's dense gradient (vocab x d) at the end
  of its backward, a transient. A stage holds that for every micro-batch in flight: 1 without a
  pipeline, pp - stage under 1F1B, all of them under GPipe (num_microbatches < pp).
- **Accumulation** (measured in tests/distributed/test_memory_peak.py): ddp over several micro-batches sums a
  parameter's new gradient into the kept one out of place: the largest parameter's sum, fp32, in the transient.
- **Optimizer step** (measured on forked ranks in tests/distributed/test_memory_peak.py): after backward has
  freed the activations and working buffers, the clipping squares one gradient, or `CLIP_CHUNK` elements
  of it, at a time (a temporary of 4 bytes per element) and torch's fused AdamW (train/optim.py, on CPUs and
  GPUs) updates in place: the step's temporaries are the square of the rank's largest local parameter or
  chunk, over its real rows under fsdp and zero1 (whose AdamW updates the master shard). The peak is the
  state plus the largest of the backward's (working + activations + transient), zero1's end of backward
  and this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_trainer.config import ModelConfig
from elastic_trainer.plan.layout import Layout, stage_layers

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
MASTER_BYTES = 4  # parameters, gradients and AdamW state stay fp32 under mixed precision
INDEX_BYTES = 8  # int64 token ids and targets
CLIP_CHUNK = 1 << 20
"""Elements the gradient clipping squares at once (parallel/engine.py `sum_of_squares`)."""

Shape = tuple[int, ...]


def block_shapes(model: ModelConfig, layer: int, tp: int) -> list[tuple[str, Shape]]:
    """(name, tensor-parallel local shape) of block `layer`'s parameters on one tp rank."""
    d = model.d_model
    p = f"layers.{layer}."
    return [
        (p + "ln_1.weight", (d,)),
        (p + "ln_1.bias", (d,)),
        (p + "attn.qkv_proj.weight", (3 * d // tp, d)),
        (p + "attn.qkv_proj.bias", (3 * d // tp,)),
        (p + "attn.o_proj.weight", (d, d // tp)),
        (p + "attn.o_proj.bias", (d,)),
        (p + "ln_2.weight", (d,)),
        (p + "ln_2.bias", (d,)),
        (p + "mlp.fc.weight", (4 * d // tp, d)),
        (p + "mlp.fc.bias", (4 * d // tp,)),
        (p + "mlp.proj.weight", (d, 4 * d // tp)),
        (p + "mlp.proj.bias", (d,)),
    ]


def root_shapes(model: ModelConfig, first: bool, last: bool) -> list[tuple[str, Shape]]:
    """Parameters outside the blocks: embeddings on the first stage, final LayerNorm and the tied head's
    copy of the token embedding on the last (one shared tensor when a stage is both)."""
    shapes = []
    if first or last:
        shapes.append(("tok_emb.weight", (model.vocab_size, model.d_model)))
    if first:
        shapes.append(("pos_emb.weight", (model.context_length, model.d_model)))
    if last:
        shapes += [("ln_f.weight", (model.d_model,)), ("ln_f.bias", (model.d_model,))]
    return shapes


def stage_shapes(model: ModelConfig, layout: Layout, stage: int) -> list[tuple[str, Shape]]:
    """Every parameter held by one rank of pipeline stage `stage`, with its tensor-parallel local shape."""
    shapes = root_shapes(model, stage == 0, stage == layout.pp - 1)
    for layer in stage_layers(model.n_layers, layout.pp)[stage]:
        shapes += block_shapes(model, layer, layout.tp)
    return shapes


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the persistent training state on one rank."""

    params: int
    grads: int
    optimizer: int
    """AdamW exp_avg + exp_avg_sq + one 4-byte step per parameter."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer)

    def __mul__(self, k: int) -> StateBytes:
        return StateBytes(self.params * k, self.grads * k, self.optimizer * k)


def shard_state(shapes: list[tuple[str, Shape]], shards: int, rank: int) -> StateBytes:
    """State bytes of `shapes` split along dim 0 over `shards` ranks the way FSDP2 does, on `rank`."""
    params = optimizer = 0
    for _, shape in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        chunk = -(-rows // shards)
        mine = max(0, min(chunk, rows - rank * chunk))
        params += chunk * rest * MASTER_BYTES
        optimizer += 2 * mine * rest * MASTER_BYTES + 4
    return StateBytes(params, params, optimizer)


def zero1_state(shapes: list[tuple[str, Shape]], dp: int, rank: int, dtype: str) -> StateBytes:
    """State bytes of `shapes` under zero1 on dp rank `rank`: the whole compute-dtype parameters and the padded
    fp32 master shard; the gradient buffer (dp padded shards) and the reduced shard; AdamW as FSDP2's."""
    sharded = shard_state(shapes, dp, rank)
    whole = sum(math.prod(shape) for _, shape in shapes)
    return StateBytes(whole * DTYPE_BYTES[dtype] + sharded.params, (dp + 1) * sharded.grads, sharded.optimizer)


def state_bytes(model: ModelConfig, layout: Layout, stage: int, dp_rank: int = 0, dtype: str = "fp32") -> StateBytes:
    """Parameter, gradient and AdamW bytes held by data-parallel rank `dp_rank` of `stage` (any tp rank);
    `dtype`, the compute dtype, matters only to zero1's whole parameters."""

    def state(shapes: list[tuple[str, Shape]]) -> StateBytes:
        if layout.dp_mode == "zero1":
            return zero1_state(shapes, layout.dp, dp_rank, dtype)
        return shard_state(shapes, layout.dp, dp_rank) if layout.dp_mode == "fsdp" else shard_state(shapes, 1, 0)

    layers = stage_layers(model.n_layers, layout.pp)[stage]
    root = state(root_shapes(model, stage == 0, stage == layout.pp - 1))
    if not layers:
        return root
    return root + state(block_shapes(model, layers[0], layout.tp)) * len(layers)


def stage_elements(model: ModelConfig, layout: Layout, stage: int) -> tuple[int, int, int]:
    """(root elements, elements of one block, number of blocks) of a stage on one tp rank, unsharded."""
    root = sum(math.prod(s) for _, s in root_shapes(model, stage == 0, stage == layout.pp - 1))
    block = sum(math.prod(s) for _, s in block_shapes(model, 0, layout.tp))
    return root, block, len(stage_layers(model.n_layers, layout.pp)[stage])


def stage_numel(model: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameter elements of a stage on one tp rank, before data-parallel sharding."""
    root, block, n = stage_elements(model, layout, stage)
    return root + block * n


def working_bytes(model: ModelConfig, layout: Layout, stage: int, dtype: str) -> int:
    """Peak bytes of data-parallel working buffers: gathered compute copies and gradient buffers."""
    e = DTYPE_BYTES[dtype]
    if layout.dp_mode == "zero1":  # autograd's gradient of one parameter, until the hook moves it
        return e * max(math.prod(shape) for _, shape in stage_shapes(model, layout, stage))
    if layout.dp == 1 and dtype == "fp32":
        return 0  # the engine applies no data-parallel wrapper
    root, block, n = stage_elements(model, layout, stage)
    whole = root + block * n
    if layout.dp_mode == "fsdp" and layout.pp == 1:
        live = root + min(n, 2) * block
        return live * e + live * (e + 4)
    return whole * e + whole * 4


def optimizer_step_bytes(model: ModelConfig, layout: Layout, stage: int, dp_rank: int = 0) -> int:
    """Peak temporaries of the clipping + AdamW step on one rank: the square of the largest local gradient, or
    of a chunk of it (fused AdamW allocates none; see the module docstring)."""
    shards, rank = (layout.dp, dp_rank) if layout.dp_mode in ("fsdp", "zero1") else (1, 0)

    def local(shape: Shape) -> int:  # the rank's real slice, as the master shard holds it
        rows, rest = shape[0], math.prod(shape[1:])
        chunk = -(-rows // shards)
        return max(0, min(chunk, rows - rank * chunk)) * rest

    root = [local(s) for _, s in root_shapes(model, stage == 0, stage == layout.pp - 1)]
    n = len(stage_layers(model.n_layers, layout.pp)[stage])
    block = [local(s) for _, s in block_shapes(model, 0, layout.tp)] if n else []
    return MASTER_BYTES * min(CLIP_CHUNK, max(root + block, default=0))


def accumulation_bytes(model: ModelConfig, layout: Layout, stage: int) -> int:
    """ddp accumulating over micro-batches: autograd adds a parameter's new gradient to the one kept from the
    earlier micro-batches out of place, so the sum of the largest parameter is live beside both (fp32; measured
    in tests/distributed/test_memory_peak.py). FSDP2's sharded accumulation and zero1's buffer add in place."""
    if layout.dp_mode != "ddp" or layout.num_microbatches == 1:
        return 0
    return MASTER_BYTES * max(math.prod(shape) for _, shape in stage_shapes(model, layout, stage))


def end_of_backward_bytes(model: ModelConfig, layout: Layout, dtype: str) -> int:
    """zero1 without a pipeline: the tied embedding's head and embedding gradients and their sum (compute
    dtype), live together at the end of backward until the hook moves the sum into the buffer."""
    if layout.dp_mode != "zero1" or layout.pp > 1:
        return 0
    return 3 * model.vocab_size * model.d_model * DTYPE_BYTES[dtype]


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once."""
    if layout.pp == 1:
        return 1
    if layout.num_microbatches >= layout.pp:  # 1F1B
        return min(layout.num_microbatches, layout.pp - stage)
    return layout.num_microbatches  # GPipe: every forward before any backward


def block_activation_bytes(
    model: ModelConfig, micro_batch: int, seq_len: int, tp: int, dtype: str, recompute: bool = False
) -> int:
    """Bytes one block keeps for backward per micro-batch (compute dtype; statistics in fp32)."""
    e = DTYPE_BYTES[dtype]
    tokens = micro_batch * seq_len
    if recompute:
        return tokens * model.d_model * e
    d, heads = model.d_model, model.n_heads // tp
    kept = (
        tokens * (4 * d + 12 * (d // tp)) * e  # tp divides n_heads, hence d
        + 2 * 2 * tokens * 4
    )  # two LayerNorms' mean and rstd
    if model.dropout > 0:  # keyed dropout materializes the attention probabilities (model/dropout.py)
        probs = micro_batch * heads * seq_len * seq_len
        return kept + probs * (4 + 1 + e) + 2 * tokens * d  # fp32 softmax, keep mask, dropped copy; 2 masks
    return kept + tokens * heads * 4  # the fused kernel's log-sum-exp


def head_activation_bytes(model: ModelConfig, micro_batch: int, seq_len: int, dtype: str, pipelined: bool) -> int:
    """Bytes the last stage keeps per micro-batch for the final LayerNorm, head and loss."""
    e = DTYPE_BYTES[dtype]
    tokens = micro_batch * seq_len
    kept = 2 * tokens * model.d_model * e + 2 * tokens * 4 + tokens * model.vocab_size * 4 + tokens * INDEX_BYTES
    if pipelined:  # the schedule caches the stage output (the logits) until its backward
        kept += tokens * model.vocab_size * e
    return kept


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one rank of one pipeline stage."""

    stage: int
    state: StateBytes
    working: int
    """Data-parallel working buffers (gathered parameters, gradient reduction)."""
    activations: int
    """Saved activations of all micro-batches in flight."""
    transient: int
    """Short-lived peaks: one block's backward (and recomputation), the loss gradient, pipeline buffers, ddp's
    accumulation."""
    optimizer_step: int = 0
    """AdamW's temporaries, allocated after backward freed the working buffers and activations."""
    end_of_backward: int = 0
    """zero1's tied-embedding gradients at the end of backward, after the activations were freed."""

    @property
    def total(self) -> int:
        backward = self.working + self.activations + self.transient
        return self.state.total + max(backward, self.optimizer_step, self.end_of_backward)


def stage_memory(model: ModelConfig, layout: Layout, seq_len: int, dtype: str, stage: int) -> StageMemory:
    b, e = layout.micro_batch, DTYPE_BYTES[dtype]
    first, last = stage == 0, stage == layout.pp - 1
    n_blocks = len(stage_layers(model.n_layers, layout.pp)[stage])
    per_mb = n_blocks * block_activation_bytes(model, b, seq_len, layout.tp, dtype, layout.recompute)
    hidden = b * seq_len * model.d_model * e
    if first:
        per_mb += b * seq_len * INDEX_BYTES
    if last:
        per_mb += head_activation_bytes(model, b, seq_len, dtype, pipelined=layout.pp > 1)
    elif layout.pp > 1:
        per_mb += hidden  # the stage output cached by the schedule
    full_block = block_activation_bytes(model, b, seq_len, layout.tp, dtype) if n_blocks else 0
    transient = full_block * (2 if layout.recompute else 1)
    if model.dropout > 0 and n_blocks:  # one sample's int64 hash temporaries for the attention mask
        transient += 5 * 8 * (model.n_heads // layout.tp) * seq_len * seq_len
    if last:
        transient += b * seq_len * model.vocab_size * (8 + e)  # fp32 loss gradients and the cast back
    if first and not last:  # the embedding's backward makes a dense gradient of the whole table, after the
        transient = max(transient, model.vocab_size * model.d_model * e)  # blocks' temporaries are freed
    if layout.pp > 1:
        transient += 2 * hidden  # receive buffers for activations and their gradients
    transient += accumulation_bytes(model, layout, stage)
    return StageMemory(
        stage,
        state_bytes(model, layout, stage, dtype=dtype),
        working_bytes(model, layout, stage, dtype),
        in_flight(layout, stage) * per_mb,
        transient,
        optimizer_step_bytes(model, layout, stage),
        end_of_backward_bytes(model, layout, dtype),
    )


def stage_memories(model: ModelConfig, layout: Layout, seq_len: int, dtype: str) -> list[StageMemory]:
    """Peak memory of a rank of every stage (dp rank 0, which holds the largest FSDP shards)."""
    return [stage_memory(model, layout, seq_len, dtype, s) for s in range(layout.pp)]
