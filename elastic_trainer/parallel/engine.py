"""The parallel engine: one rank's part of a GPT laid out by a Layout, and the forward/backward of a step.

Build order (no rank ever holds the full model): GPT on the meta device -> keep this rank's pipeline stage
-> tensor parallel -> activation recompute -> torch.compile per block (`compile`, parallel/compile.py) -> data
parallel -> allocate on the device -> initialize from the seed (layout-independent, model/init.py) ->
pipeline schedule.

A step's loss is the token mean over the whole global batch: every micro-batch's summed cross-entropy is
divided by the global token count and gradients are summed over micro-batches and dp ranks. So the
gradient, the loss and the update are the same for every layout. The validation loss (`eval_loss`) is the
same token mean, forward only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from elastic_trainer.config import ModelConfig
from elastic_trainer.data.order import microbatch_slices
from elastic_trainer.model.gpt import GPT, lm_loss_sum
from elastic_trainer.model.init import materialize
from elastic_trainer.parallel.compile import compile_blocks
from elastic_trainer.parallel.data_parallel import apply_data_parallel, set_gradient_sync
from elastic_trainer.parallel.mesh import Coords
from elastic_trainer.parallel.pipeline import build_schedule, split_stage, tied_embedding_group
from elastic_trainer.parallel.tensor import apply_tensor_parallel
from elastic_trainer.parallel.zero import Zero1, local_tensor
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import CLIP_CHUNK

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sum_of_squares(t: torch.Tensor, chunk: int = CLIP_CHUNK) -> torch.Tensor:
    """fp32 sum of the squares of `t`, a chunk at a time: squaring a large gradient whole would allocate a
    temporary of its size, new pages every step on a CPU (gpt3-small's 154 MB embedding gradient), and the
    memory model's optimizer step would have to hold it."""
    flat = t.reshape(-1)
    if flat.numel() <= chunk:
        return flat.float().square().sum()
    return torch.stack([part.float().square().sum() for part in flat.split(chunk)]).sum()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 mixed precision on GPUs and fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class Engine:
    """This rank's stage of the model and the collectives around it."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
        *,
        seed: int,
        global_batch: int,
        seq_len: int,
        param_dtype: torch.dtype = torch.float32,
        initialize: bool = True,
        compile: bool = False,
    ):
        layout.validate(mesh.size(), model_cfg, global_batch)
        self.layout, self.mesh, self.device = layout, mesh, device
        self.coords = Coords.of(mesh)
        self.first = self.coords.pp == 0
        self.last = self.coords.pp == layout.pp - 1
        self.inv_tokens = 1.0 / (global_batch * seq_len)
        self.seed = seed
        self.zero: Zero1 | None = None
        """The gradient and master-weight buffers of dp_mode "zero1" (None in the other modes)."""
        self.model = self._build(model_cfg, param_dtype, initialize, compile)
        params = list(self.model.parameters())
        self._trained = list(zip(params, self.zero.masters if self.zero is not None else params))
        self.tied_group = tied_embedding_group(mesh, layout)
        self._groups: dict[int, list[nn.Parameter]] | None = None
        self.schedule = None
        if layout.pp > 1:
            self.schedule = build_schedule(
                self.model, self.coords.pp, layout, mesh.get_group("pp"), device, self.loss_fn
            )
        self._eval_schedule = None
        """The forward-only schedule of `eval_loss` (pp > 1), built at the first evaluation."""

    def _build(self, model_cfg: ModelConfig, param_dtype: torch.dtype, initialize: bool, compile: bool) -> nn.Module:
        layout = self.layout
        with torch.device("meta"):
            model = GPT(model_cfg)
        if layout.pp > 1:
            split_stage(model, layout.stages(model_cfg.n_layers)[self.coords.pp], self.first, self.last)
        if layout.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"])
        if layout.recompute:
            for block in model.layers.values():
                block.recompute = True
        if compile:
            compile_blocks(model)
        if layout.dp_mode == "zero1":
            materialize(model, self.device, self.seed, initialize)
            self.zero = Zero1(model, self.mesh, param_dtype)
            return model
        if layout.dp > 1 or param_dtype != torch.float32:
            # With pp > 1 every micro-batch runs forward then backward later: keep blocks gathered.
            apply_data_parallel(
                model, self.mesh["dp"], layout.dp_mode, param_dtype, reshard_after_forward=layout.pp == 1
            )
        return materialize(model, self.device, self.seed, initialize)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global-batch token mean."""
        return lm_loss_sum(logits, targets) * self.inv_tokens

    def forward_backward(self, tokens: torch.Tensor, dropout_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Run this rank's micro-batches of `tokens` (local_batch, seq_len + 1); gradients accumulate in
        .grad. `dropout_keys` (one per row, model/dropout.py) travel with their rows into every micro-batch
        and pipeline stage. Returns this rank's summed loss contribution (zero except on the last stage)."""
        tokens = tokens.to(self.device, non_blocking=True)
        kwargs = {} if dropout_keys is None else {"dropout_keys": dropout_keys.to(self.device)}
        if self.schedule is not None:
            total = self._pipelined(tokens, kwargs)
        else:
            total = self._sequential(tokens, kwargs)
        if self.zero is not None:
            with record_function("zero1 reduce-scatter"):
                self.zero.reduce()
        return total

    def _sequential(self, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        slices = microbatch_slices(tokens.shape[0], self.layout.micro_batch)
        for j, rows in enumerate(slices):
            if self.layout.dp_mode == "ddp":  # reduce once, after the last micro-batch
                set_gradient_sync(self.model, j == len(slices) - 1)
            mb = tokens[rows]
            with record_function(f"forward {j}"):
                loss = self.loss_fn(self.model(mb[:, :-1], **{k: v[rows] for k, v in kwargs.items()}), mb[:, 1:])
            with record_function(f"backward {j}"):
                loss.backward()
            total += loss.detach()
        return total

    def _pipelined(self, tokens: torch.Tensor, kwargs: dict, run=None) -> torch.Tensor:
        """Every stage gets the keyword inputs (the schedule splits them into micro-batches like the tokens).
        `run`: the schedule's method (default: the training schedule's step)."""
        run = run or self.schedule.step
        losses: list[torch.Tensor] = []
        if self.first:
            run(tokens[:, :-1], return_outputs=False, **kwargs)
        elif self.last:
            run(target=tokens[:, 1:], losses=losses, return_outputs=False, **kwargs)
        else:
            run(return_outputs=False, **kwargs)
        if losses:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), device=self.device)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Forward only, in eval mode (no dropout), over this rank's micro-batches of `tokens` (local_batch,
        seq_len + 1): this rank's contribution to the batch's token-mean loss, as `forward_backward` returns it
        (so `global_loss` of it is the batch mean on every rank). Gradients, the ZeRO-1 buffer and the
        optimizer are untouched, so the next training step is the one it would have been without it."""
        tokens = tokens.to(self.device, non_blocking=True)
        training = self.model.training
        self.model.eval()
        try:
            total = self._pipelined_eval(tokens) if self.schedule is not None else self._sequential_eval(tokens)
        finally:
            self.model.train(training)
            # FSDP keeps the root (and with pp > 1 every block) gathered after a forward, for the backward
            # that follows in training; there is none here, so free them as backward would
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return total

    def _sequential_eval(self, tokens: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for rows in microbatch_slices(tokens.shape[0], self.layout.micro_batch):
            mb = tokens[rows]
            total += self.loss_fn(self.model(mb[:, :-1]), mb[:, 1:])
        return total

    def _pipelined_eval(self, tokens: torch.Tensor) -> torch.Tensor:
        """Through a schedule of its own, built once: the training schedule would redo its shape inference
        (a real forward, and backward, of one micro-batch on every stage) at each switch between eval() and
        step(), twice per evaluation."""
        if self._eval_schedule is None:
            self._eval_schedule = build_schedule(
                self.model, self.coords.pp, self.layout, self.mesh.get_group("pp"), self.device, self.loss_fn
            )
        return self._pipelined(tokens, {}, self._eval_schedule.eval)

    # -- after backward -------------------------------------------------------------------------------

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding (None when one stage holds both uses)."""
        if self.layout.pp > 1 and self.last:
            return self.model.tok_emb.weight
        return None

    def trained_params(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter of the model, the tensor AdamW updates for it on this rank; its .grad is the gradient):
        the parameter itself, or in zero1 this rank's shard of its fp32 master copy."""
        return self._trained

    def sync_params(self) -> None:
        """After the optimizer step: in zero1, gather the updated shards into the whole parameters."""
        if self.zero is not None:
            self.zero.gather()

    @torch.no_grad()
    def reduce_tied_grads(self) -> None:
        """Sum the tied embedding's gradient between the first and the last stage."""
        if self.tied_group is None or not (self.first or self.last):
            return
        tied = dict(self.trained_params())[self.model.tok_emb.weight]  # zero1: the same shard on both stages
        dist.all_reduce(local_tensor(tied.grad), group=self.tied_group)

    def _replicas(self, param: torch.Tensor) -> int:
        """On how many ranks of one stage this rank's piece of `param` (and of its gradient) also lives."""
        layout = self.layout
        if not isinstance(param, DTensor):
            return layout.dp * layout.tp
        names = param.device_mesh.mesh_dim_names or ()
        n = 1
        for i, placement in enumerate(param.placements):
            if placement.is_replicate():
                n *= param.device_mesh.size(i)
        for dim in ("dp", "tp"):
            if dim not in names:
                n *= getattr(layout, dim)
        return n

    def _norm_groups(self) -> dict[int, list[nn.Parameter]]:
        """What AdamW updates, grouped by replica count, the tied copy left out (counted on the first stage).
        zero1's master shards are distinct over dp."""
        if self._groups is None:
            tied, groups = self.tied_copy, {}
            per_dp = self.layout.dp if self.zero is not None else 1
            for p, trained in self.trained_params():
                if p is not tied:
                    groups.setdefault(self._replicas(p) // per_dp, []).append(trained)
            self._groups = groups
        return self._groups

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The true global gradient norm over all unique parameters of all stages; clip to max_norm."""
        # Sums of squares, not torch's norm kernels: on CPU those accumulate in fp32 naively (6e-5 relative
        # error on a 3M-element embedding gradient), which would make the norm depend on the sharding.
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for replicas, params in self._norm_groups().items():
            squares = [sum_of_squares(local_tensor(p.grad)) for p in params if p.grad is not None]
            if squares:
                sq += torch.stack(squares).sum() / replicas
        dist.all_reduce(sq)
        norm = sq.sqrt()
        if max_norm > 0:
            grads = [local_tensor(t.grad) for _, t in self.trained_params() if t.grad is not None]
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm

    def global_loss(self, local: torch.Tensor) -> float:
        """Sum the last stage's per-dp-rank losses into the global-batch mean, on every rank."""
        contributes = self.last and self.coords.tp == 0
        value = local.detach().float() if contributes else torch.zeros((), device=self.device)
        value = value.clone()
        dist.all_reduce(value)
        return float(value)
