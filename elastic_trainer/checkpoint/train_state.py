"""A whole training state saved as one of our checkpoints, without a Trainer and without a process group.

For importers of other trainers' checkpoints (`elastic_trainer.interop`): the caller gives every parameter's
weight, AdamW moments and AdamW step count, in global shapes under our GPT's parameter names, and the step the
run continues from. `save_train_state` writes what a Trainer of one rank holding the whole model (dp = tp =
pp = 1, fp32) would save with `Checkpointer.save`:
- the same DCP entries (`state.tensor_state`'s form: "model" by parameter name, "optim" flattened per
  parameter: `state.NAME.{step,exp_avg,exp_avg_sq}` and `param_groups.NAME.*`), in the same order;
- the same meta.json (`state.meta_of`): the step and data position, the model and training settings, the
  one-rank layout, the data's sample count and files, the RNG scheme (the step is the RNG state);
- the same commit (`storage`): checksums taken while writing, manifest, atomic rename, `latest`.
A run then resumes it in any layout, resharded at load like any other checkpoint.

The optimizer settings are those `train.optim.build_optimizer` gives our trainer: AdamW with `cfg.lr`, betas
and eps, weight decay `cfg.weight_decay` on tensors of two or more dimensions and none on the others (the
resumed run sets each step's learning rate from its schedule).
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import hashing, storage
from elastic_trainer.checkpoint import state as ckpt_state
from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.train.optim import implementation


@dataclass
class ParamTrainState:
    """One parameter's training state, in its global shape."""

    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float
    """AdamW's step count for this parameter."""


@dataclass
class TrainState:
    """Everything a run needs to continue, independent of any layout."""

    model_cfg: ModelConfig
    cfg: TrainConfig
    step: int
    """Optimizer steps done: the run continues with 0-based step `step`, at sample step * global_batch."""
    params: dict[str, ParamTrainState]
    """Every parameter of our GPT for `model_cfg`, by its name, and nothing else."""
    num_samples: int
    """Samples in the run's sample order (TokenSamples of the data for cfg.seq_len): meta.json's data record."""


def save_train_state(root: str | os.PathLike, state: TrainState) -> Path:
    """Commit `state` as a checkpoint under `root` (created if needed; it must hold no checkpoint yet).
    Returns the checkpoint's folder. ConfigError (one line) for a state that is not our GPT's."""
    root = Path(root)
    tensors = tensor_state_of(state)  # checked before anything is written
    existing = storage.complete_checkpoints(root)
    if existing:
        raise ConfigError(
            f"{str(root)!r} already holds checkpoints ({existing[0].name}, ...): a train state is "
            "saved into a new or empty folder"
        )
    meta = ckpt_state.meta_of(state.model_cfg, state.cfg, state.step, whole_layout(state.cfg), state.num_samples)
    root.mkdir(parents=True, exist_ok=True)
    storage.remove_abandoned(root)
    tmp = storage.new_tmp_dir(root, state.step)
    os.makedirs(tmp)
    try:
        writer = hashing.HashingWriter(str(tmp))
        with warnings.catch_warnings():  # that one process saves is the intent here, which DCP warns about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(tensors, storage_writer=writer, no_dist=True)
        data_files = sorted(p.name for p in tmp.glob("__0_*.distcp"))
        files = storage.describe_files(tmp, data_files, writer.digests)  # .metadata is hashed by the commit
        storage.write_json_atomic(tmp / storage.META, meta)
        return storage.commit(tmp, state.step, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once committed


def whole_layout(cfg: TrainConfig) -> dict:
    """The layout meta.json records for a whole state: one rank, the global batch in one micro-batch."""
    from elastic_trainer.plan.layout import Layout

    return Layout(1, 1, 1, cfg.global_batch, 1).to_dict()


def tensor_state_of(state: TrainState) -> dict:
    """{"model", "optim"} as `state.tensor_state` gives it for a one-rank trainer of the same values."""
    if state.step < 0:
        raise ConfigError(f"a train state's step must be 0 or more, not {state.step}")
    if state.cfg.seq_len > state.model_cfg.context_length:
        raise ConfigError(
            f"seq_len={state.cfg.seq_len} exceeds the model's context_length={state.model_cfg.context_length}"
        )
    specs = gpt_params(state.model_cfg)
    check_names(state.params, specs)
    model = {n: _global(state.params[n].weight, n, "weight", *specs[n]) for n in specs}
    groups = adamw_groups(state.cfg, specs)
    optim = {}
    for _, names in groups:
        for n in names:
            p = state.params[n]
            optim[f"state.{n}.step"] = torch.tensor(float(p.step), dtype=torch.get_default_dtype())
            optim[f"state.{n}.exp_avg"] = _global(p.exp_avg, n, "exp_avg", *specs[n])
            optim[f"state.{n}.exp_avg_sq"] = _global(p.exp_avg_sq, n, "exp_avg_sq", *specs[n])
    for settings, names in groups:
        for n in names:
            optim.update({f"param_groups.{n}.{key}": value for key, value in settings.items()})
    return {"model": model, "optim": optim}


def gpt_params(model_cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Our GPT's parameters in order: name -> (shape, dtype) (built on the meta device: no memory)."""
    from elastic_trainer.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(model_cfg)
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def check_names(params: dict, specs: dict) -> None:
    missing = [n for n in specs if n not in params]
    extra = [n for n in params if n not in specs]
    if missing or extra:
        first = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the GPT lacks"
        raise ConfigError(
            f"a train state must hold every parameter of the GPT and nothing else: it {first} "
            f"({len(missing)} missing, {len(extra)} extra)"
        )


def adamw_groups(cfg: TrainConfig, specs: dict) -> list[tuple[dict, list[str]]]:
    """(settings, parameter names) of our AdamW's groups: decayed tensors of 2+ dimensions, then the rest.
    The settings are this torch's AdamW group entries (lr, betas, eps, weight_decay, amsgrad, foreach...)."""
    decay = [n for n, (shape, _) in specs.items() if len(shape) >= 2]
    rest = [n for n, (shape, _) in specs.items() if len(shape) < 2]
    return [(_adamw_settings(cfg, cfg.weight_decay), decay), (_adamw_settings(cfg, 0.0), rest)]


def _adamw_settings(cfg: TrainConfig, weight_decay: float) -> dict:
    zero = torch.zeros(())
    probe = torch.optim.AdamW(
        [{"params": [zero], "weight_decay": weight_decay}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **implementation([zero]),
    )
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def _global(t: torch.Tensor, name: str, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not torch.is_tensor(t) or tuple(t.shape) != shape:
        got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
        raise ConfigError(f"a train state's {what} of {name!r} is {got}, but the GPT's parameter is {shape}")
    return t.detach().to(device="cpu", dtype=dtype).contiguous()
