"""The training loop: build -> steps; optimizer and schedule; metrics."""

from elastic_trainer.train.loop import Trainer
from elastic_trainer.train.metrics import MetricsLog
from elastic_trainer.train.optim import build_optimizer, lr_at

__all__ = ["Trainer", "MetricsLog", "build_optimizer", "lr_at"]
