"""One rank's trainer: the engine and optimizer, the training step and the validation loss. Step s consumes
global samples [s * B, (s + 1) * B) of the fixed order; this rank takes its dp share. Validation batch b is
samples [b * B, (b + 1) * B) of the validation stream in order, split over dp the same way. The loop around
it, with checkpoints, stop requests, evaluations and events, is `train.job`."""

from __future__ import annotations

import functools
import hashlib
import math
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.data import TokenSamples, samples_for
from elastic_trainer.data.corpus import eval_batch_count
from elastic_trainer.data.corpus import load as load_corpus
from elastic_trainer.data.order import sample_rows
from elastic_trainer.launch.allocator import kept_bytes
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.parallel.compile import compiler_problem, use_cache
from elastic_trainer.parallel.engine import Engine, resolve_dtype
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.optim import build_optimizer, lr_at, set_lr

PHASES = ("batch", "forward_backward", "clip", "optimizer", "sync")
"""A step's phases as this rank timed them (`phases_s` of its record, what `plan --explain` sets beside its
terms): reading the batch; forward and backward of every micro-batch, with the tensor-, pipeline- and
data-parallel communication inside them (zero1's gradient reduce-scatter too); the tied embedding's gradient
all-reduce, gradient clipping and the loss all-reduce; the optimizer step; zero1's all-gather of the updated
weights and their copy into the parameters."""


def phases(*marks: float) -> dict[str, float]:
    """{phase: seconds} between consecutive perf_counter marks."""
    return {name: round(b - a, 6) for name, a, b in zip(PHASES, marks, marks[1:])}


class Diverged(ConfigError):
    """A step's loss or gradient norm is not finite: the step is not applied and the run stops without saving.
    Divergence is bad input (a learning rate too high, bad data, an unstable model), reported in one line."""

    def __init__(self, step: int, loss: float, grad_norm: float, newest: str | None = None):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        kept = f"the newest checkpoint is still {newest}" if newest else "no checkpoint was saved"
        super().__init__(
            f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; the step was not "
            f"applied and {kept} (lower --lr, check the data, or resume from an earlier checkpoint)"
        )


class Trainer:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainConfig,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
        *,
        tokens: np.ndarray | None = None,
        val_tokens=None,
        initialize: bool = True,
    ):
        """initialize=False leaves the weights undefined, for a checkpoint load to fill. `val_tokens` (a token
        stream like `tokens`, or None: no validation) is checked here, before anything is built."""
        if cfg.seq_len > model_cfg.context_length:
            raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's context_length={model_cfg.context_length}")
        if tokens is None:  # the configured data (a job's ranks are handed theirs by data.corpus)
            corpus = load_corpus(cfg, quiet=True)
            tokens, val_tokens = corpus.train, corpus.val if val_tokens is None else val_tokens
        self.val_tokens = val_tokens
        self.val_batches = 0 if val_tokens is None else eval_batch_count(len(val_tokens), cfg)
        """Validation batches of global_batch samples per evaluation (0: no validation data)."""
        self.model_cfg, self.cfg, self.layout, self.device = model_cfg, cfg, layout, device
        if cfg.compile:
            problem = compiler_problem(device.type)
            if problem:
                raise ConfigError(problem)
            use_cache(cfg.compile_cache)
        self.engine = Engine(
            model_cfg,
            layout,
            mesh,
            device,
            seed=cfg.seed,
            global_batch=cfg.global_batch,
            seq_len=cfg.seq_len,
            param_dtype=resolve_dtype(cfg.dtype, device),
            initialize=initialize,
            compile=cfg.compile,
        )
        self.optimizer = build_optimizer(self.engine.model, cfg, self.engine.trained_params())
        self.samples = TokenSamples(tokens, cfg.seq_len, cfg.seed)
        self.step = 0
        """Optimizer steps completed; the next step has 0-based index `step`."""
        self.last_sample_ids: np.ndarray | None = None
        """Sample ids of this rank's share in the last step."""

    @functools.cached_property
    def data_files_id(self) -> str | None:
        """checkpoint.state.data_files_id of the configured data, resolved once (~70 ms a time)."""
        from elastic_trainer.checkpoint.state import data_files_id

        return data_files_id(self.cfg)

    @property
    def consumed_samples(self) -> int:
        return self.step * self.cfg.global_batch

    def restore(self, step: int, cfg: TrainConfig) -> None:
        """After loading a checkpoint: continue at `step` (the data position follows from it)."""
        self.step, self.cfg = step, cfg

    def _reseed(self) -> None:
        """The RNG state is a function of (seed, step, stage, dp rank), so resuming needs only the step.
        tp ranks share it: their replicated computations must draw the same numbers."""
        c = self.engine.coords
        key = f"{self.cfg.seed}:{self.step}:{c.pp}:{c.dp}".encode()
        torch.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1))

    def warm_up(self) -> None:
        """A whole training step of the first batch and a copy of the trainer's state onto itself, both to be
        overwritten by the state loaded next (a trainer that gets none must be built again): a world started
        ahead of its turn pays here, not in its first real steps, for the first use of every connection, the
        pipeline's set-up, the optimizer's first step, the allocator's first blocks and DTensor's caches of the
        load's copies (measured: the first step after a hand-over took 2x a steady one with a forward and
        backward pass alone)."""
        from elastic_trainer.checkpoint.state import apply_tensor_state, tensor_state

        self.train_step()
        apply_tensor_state(self, tensor_state(self))

    def train_step(self) -> dict:
        cfg, engine = self.cfg, self.engine
        t0 = time.perf_counter()
        self._reseed()
        positions = samples_for(self.step, cfg.global_batch, engine.coords.dp, self.layout.dp)
        self.last_sample_ids, tokens = self.samples.batch(positions)
        keys = None
        if self.model_cfg.dropout > 0:  # masks keyed by (seed, global sample position): any split draws them
            keys = sample_keys(cfg.seed, torch.arange(positions.start, positions.stop, dtype=torch.int64))
        self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        local_loss = engine.forward_backward(tokens, keys)
        t2 = time.perf_counter()
        with record_function("clip grad norm"):  # labels for a profiler trace (train/profile.py)
            engine.reduce_tied_grads()
            grad_norm = float(engine.clip_grad_norm_(cfg.grad_clip))  # global: the same on every rank
        with record_function("loss all-reduce"):
            loss = engine.global_loss(local_loss)  # a collective: every rank has finished its backward
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise Diverged(self.step + 1, loss, grad_norm)  # on every rank alike, before the update
        lr = lr_at(self.step, cfg)
        set_lr(self.optimizer, lr)
        t3 = time.perf_counter()
        with record_function("optimizer"):
            self.optimizer.step()
        t4 = time.perf_counter()
        with record_function("sync params"):
            engine.sync_params()
        self.step += 1
        t5 = time.perf_counter()
        dt = t5 - t0
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": dt,
            "phases_s": phases(t0, t1, t2, t3, t4, t5),
            "tokens_per_s": cfg.global_batch * cfg.seq_len / dt,
            "samples": [self.consumed_samples - cfg.global_batch, self.consumed_samples],
            "world_size": self.layout.world_size,
            "layout": self.layout.to_dict(),
            "time": time.time(),
        }
        if self.device.type == "cuda":
            record["max_memory_gib"] = self._peak_memory_gib()
        elif (kept := self._kept_memory_gib()) is not None:
            record["kept_memory_gib"] = kept
        return record

    def _peak_memory_gib(self) -> float:
        """The largest peak of device memory any rank's tensors took so far (torch.cuda.max_memory_allocated),
        in GiB: what the planner's memory model predicts (plan/memory.py)."""
        peak = torch.tensor([float(torch.cuda.max_memory_allocated(self.device))], device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item() / 2**30

    def _kept_memory_gib(self) -> float | None:
        """CPU ranks: the largest anonymous resident memory of any rank (GiB), the heap each keeps at its peak
        (launch/allocator.py) with its base: what the planner's `kept_heap` figures stand for. None off Linux."""
        mine = kept_bytes()
        kept = torch.tensor([float(mine if mine is not None else -1)])
        if dist.is_initialized():
            dist.all_reduce(kept, op=dist.ReduceOp.MAX)
        return kept.item() / 2**30 if kept.item() >= 0 else None

    @property
    def val_samples(self) -> int:
        """Validation samples per evaluation (0 without validation data)."""
        return self.val_batches * self.cfg.global_batch

    def evaluate(self) -> float:
        """The validation loss: the token mean over the first `val_samples` samples of the validation stream,
        taken in order and split over dp like a training batch, so every layout and every rank gets the same
        number. Forward only: gradients, optimizer state and the RNG a later step uses are unchanged (each
        step reseeds from its own index, and evaluation runs without dropout)."""
        if not self.val_batches:
            raise ValueError("evaluate() needs validation data (Trainer(val_tokens=...))")
        cfg, engine = self.cfg, self.engine
        local = torch.zeros((), device=self.device)
        for b in range(self.val_batches):
            ids = samples_for(b, cfg.global_batch, engine.coords.dp, self.layout.dp)
            local += engine.eval_loss(sample_rows(self.val_tokens, cfg.seq_len, ids))
        # every batch is global_batch * seq_len tokens: the mean of the batch means is the mean over all tokens
        return engine.global_loss(local) / self.val_batches
