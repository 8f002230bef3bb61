"""Layout-independent weight initialization.

Each parameter's full value is drawn from its own CPU generator, seeded by (seed, global parameter name),
and each rank keeps only its slice. So the initial weights are the same function of the seed for every
(dp, tp, pp) layout, which is what makes training itself layout-independent. DTensor's own random ops do
not give this on CPU, and a rank-0 broadcast would need the full model on one rank.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from elastic_trainer.model.gpt import INIT_STD


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(module: nn.Module, pname: str, shape: torch.Size, seed: int, name: str) -> torch.Tensor:
    """The full, unsharded initial value of parameter `pname` of `module` (global name `name`)."""
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if pname == "weight" else torch.zeros(shape)
    if pname == "bias":
        return torch.zeros(shape)
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise TypeError(f"no initializer for {type(module).__name__}.{pname} ({name})")
    std = getattr(module, "init_std", INIT_STD)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's slice of `full` into `param`, a plain tensor or a DTensor of any placement."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own copy, no communication.
        local = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device, param.dtype))


def _shape(param: torch.Tensor) -> torch.Size:
    return param.shape  # a DTensor reports its global shape


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialize every parameter of `model` (a whole GPT or one parallelized stage of it)."""
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            copy_full_into(param, initial_value(module, pname, _shape(param), seed, name))


def materialize(model: nn.Module, device: torch.device | str, seed: int, initialize: bool = True) -> nn.Module:
    """Allocate a meta-device model (or stage) on `device` and initialize it; with initialize=False the
    values are left undefined for a checkpoint load to overwrite (a resume pays for the load only)."""
    model.to_empty(device=device)
    if initialize:
        init_weights(model, seed)
    return model
