"""AdamW with weight decay on matrices and embeddings only, and a warm-up + cosine learning rate that is a
pure function of the step (so resuming needs nothing but the step)."""

from __future__ import annotations

import math

import torch
from torch import nn

from elastic_trainer.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    trained: list[tuple[nn.Parameter, torch.Tensor]] | None = None) -> torch.optim.AdamW:
    """`trained`: (parameter, the tensor AdamW updates for it) pairs when that is not the parameter itself
    (zero1's master shards, parallel/zero.py); decay follows the parameter's dimensions."""
    decay, no_decay = [], []
    for p, t in trained if trained is not None else ((p, p) for p in model.parameters()):
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(t)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update made at 0-based step `step`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, cfg.schedule_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
