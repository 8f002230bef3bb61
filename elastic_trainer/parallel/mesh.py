"""The ("pp", "dp", "tp") device mesh of a Layout, and the rank coordinates in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic_trainer.plan.layout import Layout

MESH_DIMS = ("pp", "dp", "tp")


def default_device(local_rank: int = 0) -> torch.device:
    """cuda:`local_rank` (torchrun's LOCAL_RANK) when GPUs are present, else cpu."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def accelerator() -> tuple[str, str | None]:
    """("cuda", device name) when GPUs are present, else ("cpu", None): what picks a hardware profile."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    return "cpu", None


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """tp innermost (neighbouring ranks, one host), then dp, then pp outermost."""
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class Coords:
    """This rank's position in the mesh."""

    pp: int
    dp: int
    tp: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> Coords:
        return cls(*(mesh.get_local_rank(d) for d in MESH_DIMS))


def backend_for(device: torch.device) -> str:
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, distributed: bool) -> None:
    """Join the job's process group: torchrun's (env://) when `distributed` (RANK and WORLD_SIZE are set),
    else a group of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend_for(device)
    if distributed:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
