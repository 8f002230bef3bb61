"""Checkpoints: DCP save/load of the whole training state with resharding at load time, atomic commit,
integrity checks, retention, asynchronous saving, and safe (allowlisted) loading; `train_state` saves a whole
state without a Trainer or a process group (for importers of other formats, `elastic_trainer.interop`)."""

from elastic_trainer.checkpoint.manager import Checkpointer, LoadStats, SaveStats
from elastic_trainer.checkpoint.storage import complete_checkpoints
from elastic_trainer.config import CheckpointConfig, CheckpointError

__all__ = ["CheckpointConfig", "Checkpointer", "LoadStats", "SaveStats", "CheckpointError", "complete_checkpoints"]
