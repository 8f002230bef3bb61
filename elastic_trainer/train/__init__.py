"""Training: the trainer and its step, the job sequence (build -> load -> fit -> close), optimizer and
schedule, metrics."""

from elastic_trainer.train.job import Job, JobResult, run_job
from elastic_trainer.train.loop import Trainer
from elastic_trainer.train.metrics import MetricsLog
from elastic_trainer.train.optim import build_optimizer, lr_at

__all__ = ["Job", "JobResult", "run_job", "Trainer", "MetricsLog", "build_optimizer", "lr_at"]
