"""A DeepSpeed checkpoint -> one of ours: the settings it fixes, the checks that continuing it with ours stays on
its loss trajectory, and the write, through `checkpoint.train_state` (no Trainer, no process group).

The imported step is DeepSpeed's; our run continues at sample `step x global batch` of its own sample order
(DeepSpeed's sampler is the user's own and is not reproduced). Training then resumes from it in any layout.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.checkpoint.storage import complete_checkpoints
from elastic_trainer.checkpoint.train_state import ParamTrainState, TrainState, save_train_state
from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.interop.deepspeed.names import to_gpt
from elastic_trainer.interop.deepspeed.read import DeepSpeedState, ParamState, read_deepspeed


@dataclass
class ImportPlan:
    """What an import writes: the step, and the settings the DeepSpeed run fixed."""

    step: int
    global_batch: int
    grad_clip: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    last_lr: float | None


def settings_of(state: DeepSpeedState) -> ImportPlan:
    """The training settings a DeepSpeed checkpoint records (ds_config and the optimizer's groups)."""
    cfg = state.ds_config
    hypers = [p.hyper for p in state.params.values() if p.hyper]
    betas = hypers[0].get("betas", (0.9, 0.999)) if hypers else (0.9, 0.999)
    decays = sorted({float(h.get("weight_decay", 0.0)) for h in hypers})
    batch = cfg.get("train_batch_size")
    if batch is None and state.global_steps:
        batch = state.global_samples // state.global_steps
    return ImportPlan(
        step=state.global_steps,
        global_batch=int(batch or 0),
        grad_clip=float(cfg.get("gradient_clipping", 0.0) or 0.0),
        weight_decay=decays[-1] if decays else 0.0,
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(hypers[0].get("eps", 1e-8)) if hypers else 1e-8,
        last_lr=float(hypers[0]["lr"]) if hypers and "lr" in hypers[0] else None,
    )


def check_settings(state: DeepSpeedState, params: dict[str, ParamState], cfg: TrainConfig) -> None:
    """Refuse (one line) when continuing with `cfg` would not be the DeepSpeed run's trajectory."""
    plan = settings_of(state)
    if plan.step <= 0:
        raise ConfigError(
            "the DeepSpeed checkpoint is from before the first step (global_steps 0): there is "
            "nothing to import; start the run with elastic_trainer's own initialization"
        )
    problems = []
    if plan.global_batch and plan.global_batch != cfg.global_batch:
        problems.append(
            f"global batch {cfg.global_batch} (DeepSpeed's train_batch_size: {plan.global_batch}; pass --global-batch)"
        )
    if plan.grad_clip != cfg.grad_clip:
        problems.append(
            f"grad_clip {cfg.grad_clip} (DeepSpeed's gradient_clipping: {plan.grad_clip}; pass --grad-clip)"
        )
    for key, value in (("beta1", plan.beta1), ("beta2", plan.beta2), ("eps", plan.eps)):
        if not math.isclose(getattr(cfg, key), value, rel_tol=1e-12, abs_tol=0.0):
            problems.append(
                f"{key} {getattr(cfg, key)} (DeepSpeed's optimizer: {value}; set [train] {key} in a --config file)"
            )
    for name, p in params.items():
        want = cfg.weight_decay if p.weight.ndim >= 2 else 0.0
        got = float(p.hyper.get("weight_decay", want))
        if not math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0):
            problems.append(
                f"weight decay {want} on {name} (DeepSpeed's: {got}; elastic_trainer decays "
                "matrices and embeddings by --weight-decay and nothing else)"
            )
            break
    if problems:
        raise ConfigError(
            "continuing this DeepSpeed checkpoint with these settings would change its loss "
            "trajectory: " + "; ".join(problems)
        )


def import_deepspeed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    state: DeepSpeedState | None = None,
    tokens=None,
    log=print,
) -> Path:
    """Write the DeepSpeed checkpoint `src` (or its `state`, read already) as a checkpoint of ours under the root
    `out` (which must hold no checkpoint); training then resumes from it in any layout. `tokens`: the data's
    token stream when loaded already (else read from cfg.data). Returns the checkpoint folder."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{str(out)!r} is a file: give a new or empty folder for the imported checkpoint")
    existing = complete_checkpoints(out) if Path(out).is_dir() else []
    if existing:
        raise ConfigError(
            f"{str(out)!r} already holds checkpoints ({existing[0].name}, ...): import into a new or empty folder"
        )
    state = state or read_deepspeed(src)
    params = to_gpt(state, model_cfg)
    check_settings(state, params, cfg)
    if state.global_samples and state.global_samples != state.global_steps * cfg.global_batch:
        log(
            f"[import] note: DeepSpeed counted {state.global_samples} samples in {state.global_steps} steps; "
            f"elastic_trainer continues at sample {state.global_steps * cfg.global_batch} of its own order"
        )
    whole = {n: ParamTrainState(p.weight, p.exp_avg, p.exp_avg_sq, step=p.step) for n, p in params.items()}
    folder = save_train_state(out, TrainState(model_cfg, cfg, state.global_steps, whole, _num_samples(cfg, tokens)))
    n = sum(p.weight.numel() for p in params.values())
    log(
        f"[import] {state.form} checkpoint of DeepSpeed {state.ds_version} (dp {state.dp_world_size}), step "
        f"{state.global_steps}: {len(params)} tensors, {n / 1e6:.2f} M parameters with their Adam moments -> {folder}"
    )
    return folder


def _num_samples(cfg: TrainConfig, tokens) -> int:
    """Samples in the sample order a run of `cfg` reads (its data loaded as training loads it)."""
    from elastic_trainer.data import TokenSamples, load_tokens

    if tokens is None:
        tokens = load_tokens(cfg.data, cfg.data_cache, min_tokens=cfg.seq_len + 1, skip_bad=cfg.skip_bad_records)
    return len(TokenSamples(tokens, cfg.seq_len, cfg.seed))
