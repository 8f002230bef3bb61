"""Pipeline parallelism with torch.distributed.pipelining.

A stage is the GPT with the layers of other stages removed (names stay global: `layers.17` is `layers.17`
on whichever stage holds it), the input embedding only on the first stage and the final LayerNorm and
head only on the last. The head is tied to the token embedding, so the last stage keeps its own copy of
`tok_emb.weight`; after backward the two copies' gradients are summed between the first and last stage
(`tied_embedding_group`), so both take the identical optimizer step and stay equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from elastic_trainer.model.gpt import GPT
from elastic_trainer.plan.layout import Layout


def split_stage(model: GPT, layers: range, first: bool, last: bool) -> GPT:
    """Keep only what stage (layers, first, last) computes; call on the meta-device model."""
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if not first:
        model.pos_emb = None
    if not (first or last):
        model.tok_emb = None
    if not last:
        model.ln_f = None
    return model


def build_schedule(
    stage_module: torch.nn.Module,
    stage_index: int,
    layout: Layout,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable,
):
    """1F1B (at most pp micro-batches in flight) when there are enough micro-batches, else GPipe."""
    # imported here: it pulls in torch._dynamo (0.6 s per process), which a layout with pp = 1 never needs
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = _labelled(PipelineStage(stage_module, stage_index, layout.pp, device, group=pp_group))
    schedule_cls = Schedule1F1B if layout.num_microbatches >= layout.pp else ScheduleGPipe
    return schedule_cls(stage, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=False)


def _labelled(stage):
    """The stage, its forward and backward of each micro-batch labelled `forward M` / `backward M` for a
    profiler trace (train/profile.py), as the sequential path labels them: not every torch schedule does."""
    from torch.profiler import record_function

    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        with record_function(f"forward {fwd_chunk_id}"):
            return forward(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        with record_function(f"backward {bwd_chunk_id}"):
            return backward(bwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    return stage


def tied_embedding_group(mesh: DeviceMesh, layout: Layout) -> dist.ProcessGroup | None:
    """The group {first stage, last stage} of this rank's (dp, tp) coordinate; None when pp == 1.

    Every rank must call this (group creation is collective); ranks of middle stages get None.
    """
    if layout.pp == 1:
        return None
    if layout.pp == 2:
        return mesh.get_group("pp")
    ranks = mesh.mesh  # shape (pp, dp, tp)
    pairs = [[int(ranks[0, d, t]), int(ranks[-1, d, t])] for d in range(layout.dp) for t in range(layout.tp)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group
