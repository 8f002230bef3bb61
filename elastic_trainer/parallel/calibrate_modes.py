"""`calibrate --model M`: what each data-parallel mode costs at the job's shapes, beyond the common figures.

Two things `calibrate`'s small shapes do not show (benchmarks/planner/README.md, gpt3-small on 4 ranks):
- **The optimizer step.** Clipping squares each gradient into a temporary of its size (gpt3-small's
  embedding is 154 MB), new pages every step for large tensors, and the modes clip and update different
  shares of the stage. (Before the trainer used torch's fused AdamW, its single-tensor AdamW made two more
  such temporaries: 9-13 ns per parameter at gpt3-small's shapes against `calibrate`'s 3.4.)
- **The modes' own work.** FSDP2 copies every unit's parameters into a buffer before its all-gather and out
  of it after, and its gradients in and out around the reduce-scatter; ddp (FSDP2's replicate) does the
  same around its all-reduce. The step-time model charges their collectives (and zero1's gradient adds
  into its flat buffer), not these copies.

So this trains the job's model, cut to `LAYERS` blocks (its width, heads, vocabulary and sequence length
kept: its embedding is the job's), for `STEPS` steps in every mode on `ranks` forked ranks with dp = ranks
and one micro-batch, and takes each phase's fastest time over the steps after the first (train/loop.py
`phases_s`). From them:
- `{mode}_optimizer_ns_per_param`: clip + optimizer phases per local parameter;
- `{mode}_hooks_ns_per_param`: the rest of the step (forward + backward, zero1's all-gather) minus what the
  step-time model predicts for it, less the same residual of the mode with the smallest one, per parameter of
  the stage and per data-parallel collective of the probe (plan/step_time.py `collectives`: fsdp 3, ddp 1,
  zero1 2). Both are divided by what the step-time model multiplies them by for the probe (its ranks sharing
  the host's cores), so the model predicts the probe's phases back. Taking the cheapest mode's residual off
  leaves out what the model gets wrong alike in every mode (its compute rate): what is charged is only the
  difference between the modes.
The ranks run together, as a job's do; with no more ranks than cores each has a core of its own, and the
step-time model slows both figures as a host's ranks share its cores.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from elastic_trainer.config import DP_MODES, ModelConfig, TrainConfig
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.parallel.zero import local_tensor
from elastic_trainer.plan.hardware import Hardware
from elastic_trainer.plan.layout import Layout

LAYERS = 2
STEPS = 6
"""Steps per mode; the first (which allocates AdamW's state) is left out."""


def _phases(rank: int, world: int, model: ModelConfig, mode: str, seq_len: int) -> tuple[dict, int]:
    """(each phase's fastest seconds over the steps after the first, this rank's trained parameters)."""
    from elastic_trainer.train.loop import Trainer

    cfg = TrainConfig(global_batch=world, seq_len=seq_len, steps=STEPS, seed=0, dtype="fp32", warmup_steps=1)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 4 * world * (seq_len + 1)).astype(np.int64)
    layout = probe_layout(world, mode)
    trainer = Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    steps = [trainer.train_step()["phases_s"] for _ in range(STEPS)][1:]
    local = sum(local_tensor(t).numel() for _, t in trainer.engine.trained_params())
    return {name: min(p[name] for p in steps) for name in steps[0]}, local


def probe_layout(ranks: int, mode: str) -> Layout:
    return Layout(ranks, 1, 1, 1, 1, dp_mode=mode)


def probe_model(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, n_layers=min(LAYERS, model.n_layers), name=f"{model.name}-probe")


def measure_modes(model: ModelConfig, seq_len: int, ranks: int = 2,
                  modes: tuple[str, ...] = DP_MODES) -> dict[str, tuple[dict, int]]:
    """{mode: (the slowest rank's fastest phases, its local parameters)} of the probe at `model`'s shapes (the
    rank whose phases add up to the most)."""
    out = {}
    for mode in modes:
        per_rank = run_ranks(_phases, ranks, probe_model(model), mode, seq_len, timeout=900)
        out[mode] = max(per_rank, key=lambda r: sum(r[0].values()))  # the slowest rank's phases, together
    return out


def fitted(hw: Hardware, model: ModelConfig, seq_len: int, measured: dict[str, tuple[dict, int]],
           ranks: int = 2) -> Hardware:
    """`hw` with each measured mode's optimizer and hooks figures (see the module's docstring)."""
    from elastic_trainer.plan.candidates import Request
    from elastic_trainer.plan.explain import by_phase
    from elastic_trainer.plan.step_time import step_time

    base = dataclasses.replace(hw, **{f"{m}_hooks_ns_per_param": 0.0 for m in DP_MODES})
    probe = probe_model(model)
    residual, fields = {}, {}
    for mode, (phases, _) in measured.items():
        layout = probe_layout(ranks, mode)
        one = dataclasses.replace(base, **{f"{mode}_optimizer_ns_per_param": 1.0, f"{mode}_hooks_ns_per_param": 1.0})
        per_ns = step_time(probe, layout, seq_len, "fp32", one, ranks)  # seconds each term takes per ns
        fields[f"{mode}_optimizer_ns_per_param"] = (phases["clip"] + phases["optimizer"]) / per_ns.optimizer
        predicted = by_phase(Request(probe, ranks, ranks, seq_len, base, ranks, dtype="fp32"), layout)
        residual[mode] = (phases["forward_backward"] + phases["sync"]
                          - predicted["forward_backward"] - predicted["sync"]), per_ns.hooks
    floor = min(r for r, _ in residual.values())
    for mode, (r, per_ns) in residual.items():
        fields[f"{mode}_hooks_ns_per_param"] = (r - floor) / per_ns
    return dataclasses.replace(hw, optimizer_shapes=f"{model.name}, seq_len {seq_len}", **fields)
