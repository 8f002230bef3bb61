"""Reduce-scatter and all-gather for gloo (CPU ranks), built from the collectives gloo runs in place.

gloo's own, as torch 2.13 calls them, copy the whole buffer into a fresh temporary on every call: one minor
page fault per 4 KiB of it (32,768 for 128 MB), which keeping freed memory (launch/allocator.py) does not
save: torch allocates with posix_memalign, and glibc's memalign does not reuse a freed chunk of exactly the
size it asks for again. Measured on the 2-core
reference machine (2026-11-28, 310 MB buffers, seconds of the slowest rank, median of 3 calls):

| ranks on the host, group size | all-reduce | reduce-scatter: gloo's / here | all-gather: gloo's / here |
|---|---|---|---|
| 2, 2 | 0.16 | 0.33 / 0.22 | 0.25 / 0.08 |
| 8, 4 (two groups at once) | 0.73 | 1.19-1.36 / 0.70-0.82 | 0.98 / 0.31 |
| 8, 2 (four groups at once) | 0.57 | 1.07-1.49 / 0.58 | 1.00 / 0.22 |

So here a reduce-scatter is an all-reduce of the input in place, of which this rank keeps its chunk, and an
all-gather is one broadcast per rank of its chunk, straight into the output: no temporary, no faults. The
step-time model charges them so on CPU profiles (`Hardware.all_gather_share`, `reduce_scatter_share`, which
`calibrate` measures through these functions). zero1 calls them for its two collectives (parallel/zero.py);
FSDP2 takes them through `set_custom_all_gather` / `set_custom_reduce_scatter` (`GlooAllGather`,
`GlooReduceScatter`, parallel/data_parallel.py). NCCL's own are used as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:  # FSDP2's interface for custom collectives, where this torch has it
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2 keeps its own collectives
    AllGather = ReduceScatter = object


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _chunk(flat: torch.Tensor, index: int, n: int) -> torch.Tensor:
    return flat[index * n : (index + 1) * n]


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
) -> None:
    """`output` (contiguous, 1/size of `input`) = this rank's chunk of `input` reduced over `group`. `input`
    is overwritten with the whole reduction."""
    flat = input.view(-1)
    dist.all_reduce(flat, op=op, group=group)
    output.view(-1).copy_(_chunk(flat, dist.get_rank(group), output.numel()))


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """`output` (contiguous, `group`'s size times `input`) = every rank's `input`, in rank order."""
    flat, n = output.view(-1), input.numel()
    _chunk(flat, dist.get_rank(group), n).copy_(input.reshape(-1))
    for k in range(dist.get_world_size(group)):
        dist.broadcast(_chunk(flat, k, n), src=dist.get_global_rank(group, k) if group is not None else k, group=group)


class _Allocate:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class GlooAllGather(_Allocate, AllGather):
    """FSDP2's all-gather as `all_gather` (synchronous: returns no work to wait for)."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        all_gather(output_tensor, input_tensor, group)


class GlooReduceScatter(_Allocate, ReduceScatter):
    """FSDP2's reduce-scatter as `reduce_scatter` (its input is a temporary FSDP2 drops afterwards)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> None:
        reduce_scatter(output_tensor, input_tensor, group, op)


def use_in_fsdp(model: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """Give every FSDP2 module in `model` (fully_shard over `group`) these collectives where `group` is gloo
    of 2 ranks or more and this torch takes custom ones; whether it did."""
    from torch.distributed.fsdp import FSDPModule

    if AllGather is object or not is_gloo(group) or dist.get_world_size(group) < 2:
        return False
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not all(hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter") for m in modules):
        return False
    for m in modules:
        m.set_custom_all_gather(GlooAllGather())
        m.set_custom_reduce_scatter(GlooReduceScatter())
    return True
