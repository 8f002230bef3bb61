"""`calibrate --model M`: what each data-parallel mode costs at the job's shapes, beyond the common figures.

On a GPU (`measure_host`): the host's time to issue a block's forward and backward per micro-batch in each
mode, from the job's model trained in this process at a sequence so short that the device waits on the host.
The rest of this docstring is the CPU ranks' measurement.

Two things `calibrate`'s small shapes do not show (benchmarks/planner/README.md at commit 690c16d, gpt3-small
on 4 ranks):
- **The optimizer step.** Clipping squares each gradient into a temporary of its size (gpt3-small's
  embedding is 154 MB), new pages every step for large tensors, and the modes clip and update different
  shares of the stage. (Before the trainer used torch's fused AdamW, its single-tensor AdamW made two more
  such temporaries: 9-13 ns per parameter at gpt3-small's shapes against `calibrate`'s 3.4.)
- **The modes' own work.** FSDP2 copies every unit's parameters into a buffer before its all-gather and out
  of it after, and its gradients in and out around the reduce-scatter; ddp (FSDP2's replicate) does the
  same around its all-reduce. The step-time model charges their collectives, zero1's gradient adds into
  its flat buffer and, since 2026-11-29, these copies by their bytes (plan/traffic.py `wrapper_bytes`);
  not the rest of the hooks' work (allocations, Python, the waits between copies).

So this trains the job's model, cut to `LAYERS` blocks (its width, heads, vocabulary and sequence length
kept: its embedding is the job's), for `STEPS` steps in every mode on `ranks` forked ranks with dp = ranks
and one micro-batch, and takes each phase's fastest time over the steps after the first (train/loop.py
`phases_s`). From them:
- `{mode}_optimizer_ns_per_param`: clip + optimizer phases per local parameter;
- `{mode}_hooks_ns_per_param`: the rest of the step (forward + backward, zero1's all-gather) minus what the
  step-time model predicts for it (the counted copies included), less the same residual of the mode with the
  smallest one, per parameter of the stage and per data-parallel collective of the probe (plan/step_time.py
  `collectives`: fsdp 3, ddp 1, zero1 2). Both are divided by what the step-time model multiplies them by for
  the probe (its ranks sharing the host's cores), so the model predicts the probe's phases back. Taking the
  cheapest mode's residual off leaves out what the model gets wrong alike in every mode (its compute rate):
  what is charged is only the difference between the modes.
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


def probe_trainer(model: ModelConfig, layout: Layout, seq_len: int, device: torch.device, dtype: str, steps: int):
    """A `Trainer` of `model` under `layout` on random tokens (seed 0), for `steps` steps: what the probes here,
    benchmarks/gpu/sweep.py times. This rank must be in a process group of the layout's size."""
    from elastic_trainer.train.loop import Trainer

    cfg = TrainConfig(
        global_batch=layout.global_batch, seq_len=seq_len, steps=steps, seed=0, dtype=dtype, warmup_steps=1
    )
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 4 * cfg.global_batch * (seq_len + 1))
    return Trainer(model, cfg, layout, build_mesh(layout, device.type), device, tokens=tokens.astype(np.int64))


def _phases(rank: int, world: int, model: ModelConfig, mode: str, seq_len: int) -> tuple[dict, int]:
    """(each phase's fastest seconds over the steps after the first, this rank's trained parameters)."""
    trainer = probe_trainer(model, probe_layout(world, mode), seq_len, torch.device("cpu"), "fp32", STEPS)
    steps = [trainer.train_step()["phases_s"] for _ in range(STEPS)][1:]
    local = sum(local_tensor(t).numel() for _, t in trainer.engine.trained_params())
    return {name: min(p[name] for p in steps) for name in steps[0]}, local


def probe_layout(ranks: int, mode: str) -> Layout:
    return Layout(ranks, 1, 1, 1, 1, dp_mode=mode)


def probe_model(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, n_layers=min(LAYERS, model.n_layers), name=f"{model.name}-probe")


def measure_modes(
    model: ModelConfig, seq_len: int, ranks: int = 2, modes: tuple[str, ...] = DP_MODES
) -> dict[str, tuple[dict, int]]:
    """{mode: (the slowest rank's fastest phases, its local parameters)} of the probe at `model`'s shapes (the
    rank whose phases add up to the most)."""
    out = {}
    for mode in modes:
        per_rank = run_ranks(_phases, ranks, probe_model(model), mode, seq_len, timeout=900)
        out[mode] = max(per_rank, key=lambda r: sum(r[0].values()))  # the slowest rank's phases, together
    return out


HOST_PROBE_SEQ = 64
"""Sequence length of the host probe: the device has almost nothing to do, so a step takes what the host
needs to issue it."""
HOST_PROBE_MICROBATCHES = 8


def timed_steps(
    model: ModelConfig, layout: Layout, seq_len: int, device: torch.device, dtype: str, steps: int = 3, warmup: int = 2
) -> dict:
    """The trainer's own steps of `model` under `layout` in this process (a process group of one, made here
    if there is none): {"step_s": median seconds, each step ended by a device synchronization, "phases_s":
    the median of each phase as the host timed it, "build_s", "parameters", "loss", and on a GPU
    "max_memory_gib"}. The trainer is dropped (and the device's cache emptied) before it returns."""
    import gc
    import statistics
    import time

    from elastic_trainer.parallel.mesh import init_process_group

    init_process_group(device, distributed=False)
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = probe_trainer(model, layout, seq_len, device, dtype, warmup + steps)
    sync()
    out = {
        "build_s": time.perf_counter() - t0,
        "parameters": sum(local_tensor(t).numel() for _, t in trainer.engine.trained_params()),
    }
    times, phases = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()  # the device is idle: synchronized after the build and after every step
        record = trainer.train_step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            phases.append(record["phases_s"])
    out.update(
        step_s=statistics.median(times),
        steps_s=times,
        loss=record["loss"],
        phases_s={k: statistics.median(p[k] for p in phases) for k in phases[0]},
    )
    if gpu:
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, record
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return out


def host_probe_model(model: ModelConfig, free_bytes: float | None) -> ModelConfig:
    """`model` with as many of its blocks as fit in half of `free_bytes` with their fp32 weights, gradients
    and AdamW moments (all of them when `free_bytes` is None), at least one."""
    if free_bytes is None:
        return model
    per_block = 12 * model.d_model**2 * 18  # weights, fp32 gradient and moments, bf16 copy
    head = model.vocab_size * model.d_model * 18
    fits = int(max(0.0, free_bytes / 2 - head) // per_block)
    layers = max(1, min(model.n_layers, fits))
    return (
        model
        if layers == model.n_layers
        else dataclasses.replace(model, n_layers=layers, name=f"{model.name}-host-probe")
    )


def measure_host(
    model: ModelConfig, device: torch.device, modes: tuple[str, ...] = DP_MODES, steps: int = 3, warmup: int = 2
) -> dict[str, float]:
    """{mode: milliseconds the host takes to issue one block's forward and backward for one micro-batch}: the
    job's model (cut to what fits the device) trained in this process at sequence HOST_PROBE_SEQ, micro-batch 1
    x HOST_PROBE_MICROBATCHES, in each mode on a group of one; the host's forward-and-backward phase per
    micro-batch and block (the embedding's, head's and loss's share included, as a job of this model pays it)."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    probe = host_probe_model(model, free)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    out = {}
    for mode in modes:
        layout = Layout(1, 1, 1, 1, HOST_PROBE_MICROBATCHES, dp_mode=mode)
        phases = timed_steps(probe, layout, HOST_PROBE_SEQ, device, dtype, steps, warmup)["phases_s"]
        out[mode] = host_block_ms(phases, probe)
    return out


def host_block_ms(phases: dict[str, float], probe: ModelConfig) -> float:
    """The host's milliseconds per block and micro-batch from a host probe's phases (train/loop.py PHASES)."""
    return phases["forward_backward"] / HOST_PROBE_MICROBATCHES / probe.n_layers * 1e3


def fitted(
    hw: Hardware, model: ModelConfig, seq_len: int, measured: dict[str, tuple[dict, int]], ranks: int = 2
) -> Hardware:
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
        copies = step_time(probe, layout, seq_len, "fp32", base, ranks).hooks  # the counted copies, per step
        fields[f"{mode}_optimizer_ns_per_param"] = (phases["clip"] + phases["optimizer"]) / per_ns.optimizer
        predicted = by_phase(Request(probe, ranks, ranks, seq_len, base, ranks, dtype="fp32"), layout)
        residual[mode] = (
            (phases["forward_backward"] + phases["sync"] - predicted["forward_backward"] - predicted["sync"]),
            per_ns.hooks - copies,
        )
    floor = min(r for r, _ in residual.values())
    for mode, (r, per_ns) in residual.items():
        fields[f"{mode}_hooks_ns_per_param"] = (r - floor) / per_ns
    return dataclasses.replace(hw, optimizer_shapes=f"{model.name}, seq_len {seq_len}", **fields)
