"""What a checkpoint holds, and how it is taken from and put into a Trainer of any layout.

Tensors (model weights, AdamW moments and step counts) go through torch.distributed.checkpoint with
`get_state_dict`/`set_state_dict`: keys are global parameter names, shapes are global, and the optimizer
state is flattened per parameter, so loading into another (dp, tp, pp), micro-batch split or dp mode is
DCP's resharding at load time. Everything else is JSON in meta.json:
- step and consumed samples (the data position: the next step reads global samples [step*B, (step+1)*B));
- the model config, the trajectory-defining training config, the layout that saved it, time, versions;
- the RNG scheme: every step reseeds torch from (seed, step, stage, dp rank), so the step is the RNG state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import platform
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from elastic_trainer import __version__
from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig

FORMAT = 1
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Training settings that define the loss trajectory: a resumed run must use the checkpoint's values.
TRAJECTORY_FIELDS = (
    "global_batch",
    "seq_len",
    "seed",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "data",
    "val_fraction",
)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW's state (zeros) before its first step, as its own lazy initialization would.

    DCP's get_state_dict would do it by allocating a zero gradient for every parameter and stepping with
    lr=0: a transient copy of the whole model that a large model on a full device cannot afford.
    """
    if optimizer.state or not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if on_device
                else torch.tensor(0.0, dtype=torch.get_default_dtype())
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def keep_implementation(optimizer: torch.optim.Optimizer):
    """Loading a state dict inside this context may replace the groups' settings; the implementation the
    optimizer was built with (fused, foreach) is put back afterwards, so a checkpoint written by another
    implementation or another torch does not choose the one the resumed run uses."""
    kept = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, kept):
        group.update(settings)


def tensor_state(trainer) -> dict:
    """{"model": ..., "optim": ...} of DTensors/tensors, keyed by global names."""
    init_optimizer_state(trainer.optimizer)
    if trainer.engine.zero is not None:
        return trainer.engine.zero.state_dict(trainer.optimizer)
    model_sd, optim_sd = get_state_dict(trainer.engine.model, trainer.optimizer, options=OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def apply_tensor_state(trainer, state: dict) -> None:
    if trainer.engine.zero is not None:
        # the load wrote into zero1's own buffers: gather the weights into the parameters; the learning rate
        # and the other group settings come from the config, checked at resume
        trainer.engine.sync_params()
        return
    with keep_implementation(trainer.optimizer):
        set_state_dict(
            trainer.engine.model,
            trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=OPTIONS,
        )


def train_dict(cfg: TrainConfig) -> dict:
    """The training config as meta.json stores it (JSON types, and the schedule length it resolves to)."""
    return {
        **dataclasses.asdict(cfg),
        "data": list(cfg.data),
        "val_data": list(cfg.val_data),
        "schedule_steps": cfg.schedule_steps,
    }


def data_id_of(trainer) -> str | None:
    """The content digest of the trainer's training tokens (set by data.corpus; None for a plain array)."""
    return getattr(getattr(trainer.samples, "tokens", None), "data_id", None)


def build_meta(trainer) -> dict:
    return meta_of(
        trainer.model_cfg,
        trainer.cfg,
        trainer.step,
        trainer.layout.to_dict(),
        len(trainer.samples),
        data_id_of(trainer),
        getattr(trainer, "data_files_id", None),
    )


def meta_of(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    step: int,
    layout: dict,
    num_samples: int,
    data_id: str | None = None,
    files_id: str | None = None,
) -> dict:
    """meta.json of a checkpoint after `step` steps, saved by `layout` (Layout.to_dict()) from a sample order
    of `num_samples` samples of the data whose content digest is `data_id` (`files_id`: data_files_id(cfg),
    taken here when not given)."""
    return {
        "format": FORMAT,
        "step": step,
        "consumed_samples": step * cfg.global_batch,
        "model": dataclasses.asdict(model_cfg),
        "train": train_dict(cfg),
        "layout": layout,
        "world_size": layout["dp"] * layout["tp"] * layout["pp"],
        "data": {
            "num_samples": num_samples,
            "seq_len": cfg.seq_len,
            "files_id": files_id or data_files_id(cfg),
            "id": data_id,
        },
        "rng": {"scheme": "reseed every step from (seed, step, stage, dp rank)", "seed": cfg.seed},
        "time": time.time(),
        "saved_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "versions": {"elastic_trainer": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def data_files_id(cfg: TrainConfig) -> str | None:
    """A digest of the files the data sources name, resolved (None when they are gone): the same files are
    the same data whichever working folder or spelling named them."""
    from elastic_trainer.data.corpus import resolve_files

    try:
        files = resolve_files(cfg.data)
    except ConfigError:
        return None
    return hashlib.sha256("\0".join(str(p) for p in files).encode()).hexdigest()[:20]


def check_compatible(
    meta: dict, model_cfg: ModelConfig, cfg: TrainConfig, where: str, data_id: str | None = None
) -> None:
    """Raise ConfigError (one line) if resuming `meta` with these configs would change the trajectory. With
    `data_id` (the content digest of this run's data) the data is compared by content: the same tokens under
    another path resume, changed tokens under the same path do not."""
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{where}: checkpoint format {meta.get('format')!r} is not supported (valid: {FORMAT})")
    saved_model = ModelConfig(**meta["model"])
    ours = dataclasses.asdict(model_cfg)
    differ = [k for k, v in dataclasses.asdict(saved_model).items() if k != "name" and ours[k] != v]
    if differ:
        detail = ", ".join(f"{k}={ours[k]!r} (checkpoint: {meta['model'][k]!r})" for k in differ)
        raise ConfigError(f"{where} holds a different model: {detail}")
    saved, current = meta["train"], train_dict(cfg)
    defaults = train_dict(TrainConfig())  # fields newer than the checkpoint have their default there
    differ = [
        (k, current[k], saved.get(k, defaults[k])) for k in TRAJECTORY_FIELDS if current[k] != saved.get(k, defaults[k])
    ]
    saved_data = meta["data"] if isinstance(meta.get("data"), dict) else {}
    saved_id, files_id = saved_data.get("id"), saved_data.get("files_id")
    if saved_id and data_id:  # by content: the same tokens under another path resume
        differ = [d for d in differ if d[0] != "data"]
        if saved_id.split(":")[0] != data_id.split(":")[0]:  # (a held-out fraction differs: val_fraction says so)
            raise ConfigError(
                f"{where} was trained on other data: the content digest of --data "
                f"{' '.join(cfg.data)} is {data_id[:12]}, the checkpoint's {saved_id[:12]}; resuming "
                "would change the loss trajectory (use the checkpoint's data or another "
                "--checkpoint-dir)"
            )
    elif files_id and any(k == "data" for k, _, _ in differ) and data_files_id(cfg) == files_id:
        differ = [d for d in differ if d[0] != "data"]  # the same files, named from another folder
    if cfg.decay_steps is not None and cfg.schedule_steps != saved.get("schedule_steps"):
        differ.append(("decay_steps", cfg.decay_steps, saved.get("schedule_steps")))
    if differ:
        detail = ", ".join(f"{k}={ours!r} (checkpoint: {theirs!r})" for k, ours, theirs in differ)
        raise ConfigError(
            f"{where} was trained with other settings: {detail}; resuming would change the "
            "loss trajectory (use the checkpoint's values or another --checkpoint-dir)"
        )


def resumed_config(meta: dict, cfg: TrainConfig) -> TrainConfig:
    """The schedule length is part of the trajectory: a resumed run keeps the checkpoint's unless set."""
    if cfg.decay_steps is None:
        return dataclasses.replace(cfg, decay_steps=meta["train"]["schedule_steps"])
    return cfg
