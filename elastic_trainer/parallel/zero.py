"""ZeRO-1 data parallelism (`dp_mode="zero1"`): whole parameters on every dp rank, sharded optimizer.

Every dp rank holds its stage's whole (tensor-parallel local) parameters in the compute dtype and runs
forward and backward with no data-parallel hooks in the compute. A post-accumulate-grad hook moves each
parameter's gradient into one fp32 buffer as soon as autograd produced it (added over the micro-batches of
a step, so bf16 gradients accumulate in fp32 and no full-size .grad stays alive). After the last
micro-batch the step communicates twice, each one collective over all parameters of the stage:

1. a reduce-scatter of the gradient buffer: dp rank r receives the sum over dp of its shard;
2. after AdamW updated this rank's fp32 master shard, an all-gather of the shards (in the compute dtype)
   back into the buffer, copied into the parameters.

Over gloo both are parallel/gloo_comms.py's (an all-reduce in place, a broadcast per rank): gloo's own copy the
whole buffer into a fresh temporary every call.

The buffer is laid out rank-major: rank r's part is, parameter after parameter, rows [r*c, (r+1)*c) of
each parameter with c = ceil(rows / dp) (torch.chunk's split along dim 0, zero-padded to c rows). That is
FSDP2's sharding, so the master weights and AdamW moments go to the checkpoint as DTensors sharded over dp
exactly as FSDP2's do, and a checkpoint of any dp mode loads into any other.

Against FSDP2 (`"fsdp"`) this trades memory (whole parameters and an fp32 gradient buffer per rank: 4 + e
bytes per parameter plus 16/dp, against 16/dp) for communication: two collectives per step instead of two
all-gathers and one reduce-scatter per block per micro-batch. Against `"ddp"` it holds and updates 1/dp of
the optimizer state. It is what DeepSpeed calls ZeRO stage 1 (with its gradient reduction bucketed into
one collective); the planner weighs the trade (plan/memory.py, plan/step_time.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from elastic_trainer.parallel import gloo_comms


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """The sum over `group` of `input`, this rank's chunk into `output` (`input` is overwritten on gloo)."""
    if gloo_comms.is_gloo(group):  # gloo's own copies the whole buffer every call
        return gloo_comms.reduce_scatter(output, input, group)
    # torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 and 2.12 have only the old ones
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(output, input, op=dist.ReduceOp.SUM, group=group)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    if gloo_comms.is_gloo(group):
        return gloo_comms.all_gather(output, input, group)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _Slot:
    """One parameter's place in the buffers."""

    def __init__(self, name: str, param: nn.Parameter, offset: int, dp: int, rank: int):
        local = local_tensor(param)
        self.name, self.param, self.offset = name, param, offset
        self.rows = local.shape[0]
        self.rest = tuple(local.shape[1:])
        self.row_numel = local[0].numel() if self.rows else 0
        self.chunk = -(-self.rows // dp)
        self.size = self.chunk * self.row_numel  # padded, per rank
        self.mine = self.rows_on(rank)

    def rows_on(self, rank: int) -> int:
        """How many real rows (not padding) of the parameter dp rank `rank` holds."""
        return max(0, min(self.chunk, self.rows - rank * self.chunk))

    def pieces(self, buffer: torch.Tensor, dp: int, shard: int):
        """(view into the rank-major `buffer`, rows of the whole parameter) for every rank's real rows."""
        out = []
        for r in range(dp):
            n = self.rows_on(r)
            if n:
                start = r * shard + self.offset
                out.append(
                    (
                        buffer[start : start + n * self.row_numel].view(n, *self.rest),
                        slice(r * self.chunk, r * self.chunk + n),
                    )
                )
        return out


class Zero1:
    """The buffers, hooks and collectives of one rank's stage in `dp_mode="zero1"`."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype):
        """`model`: this rank's materialized stage in fp32, after tensor parallelism; it is cast to
        `param_dtype` here, the fp32 values kept as the master."""
        dp_mesh = mesh["dp"]
        self.mesh, self.group = mesh, dp_mesh.get_group()
        self.dp, self.rank = dp_mesh.size(), dp_mesh.get_local_rank()
        self.tp = mesh.size(mesh.mesh_dim_names.index("tp"))
        self.slots: list[_Slot] = []
        offset = 0
        for name, p in model.named_parameters():
            slot = _Slot(name, p, offset, self.dp, self.rank)
            self.slots.append(slot)
            offset += slot.size
        self.shard = offset
        first = next(iter(model.parameters()))
        device = local_tensor(first).device
        f32 = dict(dtype=torch.float32, device=device)
        self.buffer = torch.zeros(self.dp * self.shard, **f32)
        """Gradients accumulated over the micro-batches (rank-major); then the gathered master weights."""
        self.master = torch.zeros(self.shard, **f32)
        """This rank's fp32 parameter shard (the padding stays zero)."""
        self.grad_shard = torch.zeros(self.shard, **f32)
        """This rank's shard of the dp-summed gradients."""
        self._whole = [s.pieces(self.buffer, self.dp, self.shard) for s in self.slots]
        self._whole_compute: list | None = None  # the same places in the buffer seen as the compute dtype
        self.masters = [self._mine(self.master, s) for s in self.slots]
        """Leaf views of this rank's real rows of every parameter: what AdamW updates."""
        self.grads = [self._mine(self.grad_shard, s) for s in self.slots]
        self._seen = [False] * len(self.slots)
        self.param_dtype = param_dtype
        self._take_master()
        if param_dtype != torch.float32:  # the compute copy (nn.Module.to swaps DTensor parameters' contents)
            model.to(param_dtype)
        # The hooks reach this object through a weak reference: autograd keeps a parameter's hooks in C++, where
        # Python's collector cannot see a cycle back to the parameter (param -> hook -> self -> slots -> param),
        # so a strong one kept every dropped zero1 stage alive with its buffers (GPT-3 XL: 16-18 GB of GPU
        # memory per trainer built and dropped in one process, benchmarks/gpu/results/NVIDIA-H200/).
        me = weakref.ref(self)
        for i, (slot, (_, p)) in enumerate(zip(self.slots, model.named_parameters())):
            slot.param = p
            p.register_post_accumulate_grad_hook(lambda p, i=i: me()._accumulate(i, p))

    def _mine(self, flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
        return flat[slot.offset : slot.offset + slot.mine * slot.row_numel].view(slot.mine, *slot.rest)

    # -- setup and checkpoints ------------------------------------------------------------------------

    @torch.no_grad()
    def _take_master(self) -> None:
        """The master shard from the (fp32, initialized) parameters."""
        for slot, master in zip(self.slots, self.masters):
            lo = self.rank * slot.chunk
            master.copy_(local_tensor(slot.param)[lo : lo + slot.mine])

    def _submesh(self, dims: tuple[str, ...]):
        """The mesh's sub-mesh of `dims`, made once (slicing a DeviceMesh is not free: ~1 ms a call)."""
        cache = self.__dict__.setdefault("_submeshes", {})
        if dims not in cache:
            cache[dims] = self.mesh[dims]
        return cache[dims]

    def dtensor(self, slot: _Slot, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows of `slot`'s parameter) as a DTensor of the parameter's global shape."""
        param = slot.param
        if isinstance(param, DTensor):
            tp_place = param.placements[0]
            dp_place = (
                _StridedShard(0, split_factor=self.tp)
                if isinstance(tp_place, Shard) and tp_place.dim == 0
                else Shard(0)
            )
            mesh, placements = self._submesh(("dp", "tp")), (dp_place, tp_place)
        else:
            mesh, placements = self._submesh(("dp",)), (Shard(0),)
        shape = param.shape
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    # -- a step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def _accumulate(self, i: int, param: torch.Tensor) -> None:
        grad = local_tensor(param.grad)
        first = not self._seen[i]
        for dst, rows in self._whole[i]:
            if first:
                dst.copy_(grad[rows])
            else:
                dst.add_(grad[rows])
        self._seen[i] = True
        param.grad = None

    @torch.no_grad()
    def reduce(self) -> None:
        """After the last micro-batch: sum the gradients over dp, this rank keeping its shard."""
        for i, seen in enumerate(self._seen):
            if not seen:  # no gradient this step (an unused parameter): contribute zeros
                for dst, _ in self._whole[i]:
                    dst.zero_()
        self._seen = [False] * len(self.slots)
        if self.dp > 1:
            _reduce_scatter(self.grad_shard, self.buffer, self.group)
        else:
            self.grad_shard.copy_(self.buffer)
        for master, grad in zip(self.masters, self.grads):
            master.grad = grad

    @torch.no_grad()
    def gather(self) -> None:
        """After the optimizer step: every rank's updated shard into every rank's whole parameters, gathered
        in the compute dtype (under bf16 half the bytes; the cast is the one the copy would make anyway)
        into the front of the gradient buffer, which is free until the next backward."""
        if self.param_dtype == torch.float32:
            shard, whole, pieces = self.master, self.buffer, self._whole
        else:
            shard = self.master.to(self.param_dtype)
            whole = self.buffer.view(self.param_dtype)[: self.buffer.numel()]
            if self._whole_compute is None:
                self._whole_compute = [s.pieces(whole, self.dp, self.shard) for s in self.slots]
            pieces = self._whole_compute
        if self.dp > 1:
            _all_gather(whole, shard, self.group)
        else:
            whole.copy_(shard)
        for slot, parts in zip(self.slots, pieces):
            local = local_tensor(slot.param)
            for src, rows in parts:
                local[rows].copy_(src)

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """{"model", "optim"} in the form get_state_dict gives for FSDP2 with a flattened optimizer state:
        fp32 master weights and AdamW moments as DTensors sharded over dp, keyed by global names. The
        tensors are this rank's own buffers, so a DCP load into them is a load into the trainer."""
        model, optim = {}, {}
        names = {id(m): s.name for s, m in zip(self.slots, self.masters)}
        for slot, master in zip(self.slots, self.masters):
            model[slot.name] = self.dtensor(slot, master)
            for key, value in optimizer.state[master].items():
                optim[f"state.{slot.name}.{key}"] = value if value.ndim == 0 else self.dtensor(slot, value)
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        optim[f"param_groups.{names[id(p)]}.{key}"] = value
        return {"model": model, "optim": optim}
