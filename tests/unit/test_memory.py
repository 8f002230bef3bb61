"""The memory model against independent references: the GPT's own parameters, hand-computed FSDP shards,
and the bytes autograd really saves for backward (counted with saved-tensor hooks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from elastic_trainer.config import ModelConfig, load_model_config
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.model.gpt import GPT, Block, lm_loss_sum
from elastic_trainer.parallel.pipeline import split_stage
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import (
    StateBytes,
    block_activation_bytes,
    head_activation_bytes,
    in_flight,
    optimizer_step_bytes,
    shard_state,
    stage_memory,
    stage_shapes,
    state_bytes,
    working_bytes,
)

TINY = load_model_config("gpt-tiny")
XL = load_model_config("gpt3-xl")


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_shapes_are_the_stage_modules_parameters(pp):
    layout = Layout(1, 1, pp, 1, 1)
    for stage, layers in enumerate(layout.stages(TINY.n_layers)):
        with torch.device("meta"):
            model = split_stage(GPT(TINY), layers, stage == 0, stage == pp - 1)
        expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert dict(stage_shapes(TINY, layout, stage)) == expected


def test_tensor_parallel_shapes_split_heads_and_mlp_columns():
    shapes = dict(stage_shapes(XL, Layout(1, 4, 1, 1, 1), 0))
    assert shapes["layers.0.attn.qkv_proj.weight"] == (1536, 2048)  # 3 * 2048 / 4 rows
    assert shapes["layers.0.attn.o_proj.weight"] == (2048, 512)
    assert shapes["layers.0.mlp.fc.bias"] == (2048,)
    assert shapes["layers.0.mlp.proj.bias"] == (2048,)  # row-parallel bias: replicated
    assert shapes["tok_emb.weight"] == (50257, 2048)  # embeddings: replicated


def test_whole_model_state_is_16_bytes_per_parameter_plus_steps():
    n_tensors = len(stage_shapes(XL, Layout(1, 1, 1, 1, 1), 0))
    state = state_bytes(XL, Layout(1, 1, 1, 1, 1), 0)
    assert state == StateBytes(4 * XL.num_params(), 4 * XL.num_params(), 8 * XL.num_params() + 4 * n_tensors)


def test_shards_follow_torch_chunk_with_padding():
    # 10 rows over 4 ranks: chunks of 3, 3, 3, 1; FSDP2 pads every rank's parameter and gradient to 3 rows
    shapes = [("w", (10, 5))]
    for rank, rows in enumerate([3, 3, 3, 1]):
        assert shard_state(shapes, 4, rank) == StateBytes(3 * 5 * 4, 3 * 5 * 4, 2 * rows * 5 * 4 + 4)
    # 2 rows over 4 ranks: the last two ranks hold empty slices but still padded storage
    assert shard_state([("b", (2,))], 4, 3) == StateBytes(4, 4, 4)


def test_ddp_replicates_and_pipeline_duplicates_the_tied_embedding():
    fsdp = state_bytes(TINY, Layout(4, 1, 1, 1, 1), 0)
    ddp = state_bytes(TINY, Layout(4, 1, 1, 1, 1, dp_mode="ddp"), 0)
    assert ddp == state_bytes(TINY, Layout(1, 1, 1, 1, 1), 0) and fsdp.params < ddp.params / 3.9
    pipe = Layout(1, 1, 2, 1, 2)
    both = sum(state_bytes(TINY, pipe, s).params for s in range(2))
    assert both == 4 * (TINY.num_params() + TINY.vocab_size * TINY.d_model)


def _saved_bytes(fn, *args) -> tuple[int, set]:
    """Bytes of the distinct storages autograd saves while running fn(*args)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return storages


@pytest.mark.parametrize(
    "micro_batch, seq_len, recompute, dropout",
    [(2, 32, False, 0.0), (3, 16, False, 0.0), (2, 32, True, 0.0), (2, 32, False, 0.1), (3, 16, True, 0.1)],
)
def test_block_activations_equal_saved_tensors(micro_batch, seq_len, recompute, dropout):
    model = dataclasses.replace(TINY, dropout=dropout)
    block = Block(model)
    block.recompute = recompute
    x = torch.randn(micro_batch, seq_len, TINY.d_model, requires_grad=True)
    keys = sample_keys(0, torch.arange(micro_batch)) if dropout else None
    saved = _saved_bytes(block, x, keys)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    if keys is not None:  # recompute keeps the per-sample keys (8 bytes a sample) as an input: not modelled
        params.add(keys.untyped_storage().data_ptr())
    causal = seq_len * seq_len if dropout and not recompute else 0  # the (T, T) causal mask, shared by samples
    activations = sum(n for ptr, n in saved.items() if ptr not in params) - causal
    assert activations == block_activation_bytes(model, micro_batch, seq_len, 1, "fp32", recompute)


def test_head_activations_equal_saved_tensors():
    model = GPT(TINY)
    x = torch.randn(2, 16, TINY.d_model, requires_grad=True)
    targets = torch.randint(0, TINY.vocab_size, (2, 16))
    saved = _saved_bytes(lambda: lm_loss_sum(F.linear(model.ln_f(x), model.tok_emb.weight), targets))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    assert activations - 4 == head_activation_bytes(TINY, 2, 16, "fp32", pipelined=False)  # 4: nll_loss total weight


def test_tensor_parallel_shrinks_only_the_split_activations():
    full = block_activation_bytes(XL, 1, 1024, 1, "bf16")
    tp8 = block_activation_bytes(XL, 1, 1024, 8, "bf16")
    d = XL.d_model
    assert full - tp8 == 1024 * 12 * (d - d // 8) * 2 + 1024 * (16 - 2) * 4  # 12 d/tp columns, heads' lse


def test_in_flight_micro_batches():
    assert in_flight(Layout(1, 1, 1, 1, 8), 0) == 1
    assert [in_flight(Layout(1, 1, 4, 1, 8), s) for s in range(4)] == [4, 3, 2, 1]  # 1F1B
    assert [in_flight(Layout(1, 1, 4, 1, 2), s) for s in range(4)] == [2, 2, 2, 2]  # GPipe: all of them


def test_recompute_and_smaller_micro_batches_save_memory():
    base = Layout(1, 1, 1, 8, 1)
    big = stage_memory(XL, base, 1024, "bf16", 0)
    assert stage_memory(XL, dataclasses.replace(base, recompute=True), 1024, "bf16", 0).total < big.total
    assert stage_memory(XL, Layout(1, 1, 1, 1, 8), 1024, "bf16", 0).total < big.total
    # the logits dominate the last stage: 8 x 1024 x 50257 fp32 log-probabilities
    assert big.activations > 8 * 1024 * XL.vocab_size * 4


# A model small enough to count by hand: 1 block, d=4, 1 head, vocab 5, 3 positions (284 parameters).
SMALL = ModelConfig(n_layers=1, d_model=4, n_heads=1, vocab_size=5, context_length=3)


def test_optimizer_step_temporaries_by_hand():
    """The clipping's square of the largest local gradient (fused AdamW allocates none)."""
    assert SMALL.num_params() == 284
    # replicated: the largest tensors are fc's and fc2's weights, 16 x 4 elements
    assert optimizer_step_bytes(SMALL, Layout(8, 1, 1, 1, 1, dp_mode="ddp"), 0) == 4 * 64
    # FSDP over 8, rank 0: one row of every tensor (two of qkv's 12 and fc's 16 rows); the largest slice is
    # fc2's row of 16
    assert optimizer_step_bytes(SMALL, Layout(8, 1, 1, 1, 1), 0, dp_rank=0) == 4 * 16
    # rank 7: only fc's weight (2 rows x 4) and bias (2) reach it; every other slice is empty
    assert optimizer_step_bytes(SMALL, Layout(8, 1, 1, 1, 1), 0, dp_rank=7) == 4 * 8


def test_working_buffers_by_hand():
    assert working_bytes(SMALL, Layout(1, 1, 1, 1, 1), 0, "fp32") == 0  # no wrapper at all
    whole = 284
    assert working_bytes(SMALL, Layout(2, 1, 1, 1, 1, dp_mode="ddp"), 0, "fp32") == whole * 4 + whole * 4
    # fsdp, pp = 1 (bf16 on one rank): gathered bf16 copies, and bf16 + fp32 gradient buffers of root + block
    assert working_bytes(SMALL, Layout(1, 1, 1, 1, 1), 0, "bf16") == whole * 2 + whole * (2 + 4)
    # fsdp with pp = 2: the whole stage stays gathered (stage 0: embeddings and the block, no final LayerNorm)
    two = ModelConfig(n_layers=2, d_model=4, n_heads=1, vocab_size=5, context_length=3)
    stage0 = 20 + 12 + 244
    assert working_bytes(two, Layout(2, 1, 2, 1, 2), 0, "bf16") == stage0 * 2 + stage0 * 4


def test_zero1_state_by_hand():
    """dp = 2 over SMALL's 16 tensors: torch.chunk's halves; only tok_emb (5 rows: 3 + 2) and pos_emb (3 rows:
    2 + 1) are odd, so each rank's padded shard is 12 + 8 + 2 + 2 root + 244 / 2 block = 146 elements, of which
    rank 1 really holds 8 + 4 + 2 + 2 + 122 = 138."""
    zero1 = Layout(2, 1, 1, 1, 1, dp_mode="zero1")
    # whole bf16 parameters and the fp32 master shard; the fp32 buffer of both shards and the reduced shard
    assert state_bytes(SMALL, zero1, 0, dp_rank=1, dtype="bf16") == StateBytes(
        284 * 2 + 146 * 4, (2 + 1) * 146 * 4, 2 * 138 * 4 + 16 * 4
    )
    assert state_bytes(SMALL, zero1, 0, dp_rank=0, dtype="fp32") == StateBytes(
        284 * 4 + 146 * 4, (2 + 1) * 146 * 4, 2 * 146 * 4 + 16 * 4
    )
    # on one rank the engine still keeps the master, buffer and reduced copies: four fp32 copies and AdamW's
    assert state_bytes(SMALL, Layout(1, 1, 1, 1, 1, dp_mode="zero1"), 0) == StateBytes(
        2 * 284 * 4, 2 * 284 * 4, 2 * 284 * 4 + 16 * 4
    )
    # against FSDP: the same AdamW state, e + 4 bytes more per parameter (the buffer padded like the shards)
    fsdp = state_bytes(SMALL, Layout(2, 1, 1, 1, 1), 0, dp_rank=1)
    assert state_bytes(SMALL, zero1, 0, dp_rank=1, dtype="bf16").total - fsdp.total == 284 * 2 + 2 * 146 * 4


def test_zero1_working_memory_end_of_backward_and_optimizer_step_by_hand():
    zero1 = Layout(2, 1, 1, 1, 1, dp_mode="zero1")
    # autograd's gradient of one parameter before the hook moves it, the largest: fc's or proj's 64 elements
    assert working_bytes(SMALL, zero1, 0, "bf16") == 64 * 2
    assert working_bytes(SMALL, Layout(1, 1, 1, 1, 1, dp_mode="zero1"), 0, "fp32") == 64 * 4  # even on one rank
    # without a pipeline, the tied embedding's (5 x 4) head and embedding gradients and their sum end backward
    m = stage_memory(SMALL, zero1, 3, "bf16", 0)
    assert m.end_of_backward == 3 * 20 * 2
    assert m.total == m.state.total + max(m.working + m.activations + m.transient, m.optimizer_step, 3 * 20 * 2)
    two = ModelConfig(n_layers=2, d_model=4, n_heads=1, vocab_size=5, context_length=3)
    assert [
        stage_memory(two, Layout(2, 1, 2, 1, 2, dp_mode="zero1"), 3, "bf16", s).end_of_backward for s in range(2)
    ] == [0, 0]  # a pipeline splits the two uses: each is a single gradient
    assert stage_memory(SMALL, Layout(2, 1, 1, 1, 1), 3, "bf16", 0).end_of_backward == 0  # fsdp
    # AdamW runs on the rank's real rows, as under FSDP (rank 7 of 8: only fc's weight and bias reach it)
    assert optimizer_step_bytes(SMALL, Layout(8, 1, 1, 1, 1, dp_mode="zero1"), 0, dp_rank=7) == 4 * 8


def test_two_stage_pipeline_keeps_two_micro_batches_on_its_first_stage():
    assert [in_flight(Layout(1, 1, 2, 1, 4), s) for s in range(2)] == [2, 1]


def test_first_pipeline_stage_activations_by_hand():
    """Stage 0 of 2 (one block, fp32, 1 x 3 tokens, 2 micro-batches in flight): per micro-batch the block's
    3 x (4d + 12d) x 4 bytes + LayerNorm statistics 2 x 2 x 3 x 4 + log-sum-exp 3 x 1 x 4, the int64 token
    ids 3 x 8 and the stage output the schedule caches, 3 x 4 x 4."""
    two = ModelConfig(n_layers=2, d_model=4, n_heads=1, vocab_size=5, context_length=3)
    per_micro_batch = 3 * 64 * 4 + 48 + 12 + 24 + 48
    assert stage_memory(two, Layout(1, 1, 2, 1, 2), 3, "fp32", 0).activations == 2 * per_micro_batch


@pytest.mark.parametrize(
    "layout, dropout, heads, activations, transient",
    [
        # one stage, fp32, 1 x 3 tokens. A block keeps 3 x (4d + 12d) x 4 + LayerNorm statistics 2 x 2 x 3 x 4 +
        # log-sum-exp 3 x 4 = 828 bytes; the only stage also keeps the token ids (3 x 8) and the head's
        # 2 x 3 x 4 x 4 + 2 x 3 x 4 + 3 x 5 x 4 + 3 x 8 = 204. The transient is one block's backward (828) and the
        # loss gradient in fp32 with its cast back, 3 x 5 x (8 + 4) = 180.
        (Layout(1, 1, 1, 1, 1), 0.0, 1, 828 + 24 + 204, 828 + 180),
        # recompute: the block keeps only its input (3 x 4 x 4), and its backward runs it twice
        (Layout(1, 1, 1, 1, 1, recompute=True), 0.0, 1, 48 + 24 + 204, 2 * 828 + 180),
        # dropout: no log-sum-exp, the 1 x 1 x 3 x 3 probabilities in fp32, their keep mask and the dropped copy
        # (9 x 9) and the two residual masks (2 x 3 x 4): 816 + 81 + 24 = 921; the attention mask's hash keeps
        # five int64 temporaries per probability (5 x 8 x 9 = 360) for a moment
        (Layout(1, 1, 1, 1, 1), 0.1, 1, 921 + 24 + 204, 921 + 360 + 180),
        # two heads: 2 x 9 probabilities (2 x 81 bytes kept, 2 x 360 of hash temporaries)
        (Layout(1, 1, 1, 1, 1), 0.1, 2, 1002 + 24 + 204, 1002 + 720 + 180),
    ],
)
def test_one_stage_activations_and_transients_by_hand(layout, dropout, heads, activations, transient):
    model = dataclasses.replace(SMALL, dropout=dropout, n_heads=heads)
    got = stage_memory(model, layout, 3, "fp32", 0)
    assert (got.stage, got.activations, got.transient) == (0, activations, transient)


def test_last_pipeline_stage_by_hand():
    """Stage 1 of 2: one block (828), the head (204) and its logits cached by the schedule until their
    backward (3 x 5 x 4 = 60), one micro-batch in flight; the transient adds the loss gradient (180) and the
    receive buffers for activations and their gradients (2 x 3 x 4 x 4). Stage 0 keeps the same receive
    buffers, no loss gradient."""
    two = ModelConfig(n_layers=2, d_model=4, n_heads=1, vocab_size=5, context_length=3)
    last = stage_memory(two, Layout(1, 1, 2, 1, 2), 3, "fp32", 1)
    assert (last.stage, last.activations, last.transient) == (1, 828 + 204 + 60, 828 + 180 + 96)
    assert stage_memory(two, Layout(1, 1, 2, 1, 2), 3, "fp32", 0).transient == 828 + 96
