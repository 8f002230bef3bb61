"""Tensor parallelism with DTensor, Megatron style: each block's attention and MLP split column-wise on the
way in and row-wise on the way out, so a block costs one all-reduce in forward and one in backward.

The fused QKV projection orders its rows head by head (model/gpt.py), so its column-wise split gives each
rank whole heads. Embeddings, LayerNorms and the tied head stay replicated across tp: the residual stream
is replicated, so their gradients are identical on every tp rank without communication.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Each parallel layer declares its split: column-wise shards weight dim 0 (and the bias), row-wise dim 1.
BLOCK_PLAN = {
    "attn.qkv_proj": ColwiseParallel,
    "attn.o_proj": RowwiseParallel,
    "mlp.fc": ColwiseParallel,
    "mlp.proj": RowwiseParallel,
}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    heads = model.config.n_heads // tp_mesh.size()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {name: style() for name, style in BLOCK_PLAN.items()})
        block.attn.head_offset = tp_mesh.get_local_rank() * heads  # this rank's heads, for dropout masks
