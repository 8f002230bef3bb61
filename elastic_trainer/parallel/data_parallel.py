"""Data parallelism: FSDP2 (`fully_shard`, parameters/gradients/optimizer state sharded over dp) or a
replicated, DDP-like mode (`replicate`, the same FSDP2 machinery without sharding). The third mode, ZeRO-1
(replicated parameters, sharded optimizer state), is parallel/zero.py.

Each block is its own unit (its all-gather overlaps the previous block's compute), the root holds the
embeddings and the final LayerNorm. Gradients are *summed* across dp, not averaged: the loss is already
divided by the number of tokens in the whole global batch, so the sum is the exact global gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from elastic_trainer.parallel.gloo_comms import use_in_fsdp


def apply_data_parallel(
    model: nn.Module, dp_mesh: DeviceMesh, mode: str, param_dtype: torch.dtype, reshard_after_forward: bool
) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if mode == "fsdp":

        def wrap(module: nn.Module, reshard: bool) -> None:
            fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    elif mode == "ddp":

        def wrap(module: nn.Module, reshard: bool) -> None:
            replicate(module, mesh=dp_mesh, mp_policy=mp)
    else:
        raise ValueError(f"unknown data-parallel mode {mode!r} (valid: fsdp, ddp)")
    for block in model.layers.values():
        wrap(block, reshard_after_forward)
    wrap(model, False)  # the root's parameters are needed again right at the start of backward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    if mode == "fsdp":  # gloo's reduce-scatter and all-gather copy the whole buffer every call (gloo_comms.py)
        use_in_fsdp(model, dp_mesh.get_group())


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the dp gradient reduction in the next backward, for accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
