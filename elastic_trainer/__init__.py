"""elastic_trainer: an elastic data x tensor x pipeline parallel trainer for GPT models."""

__version__ = "0.1.0"
