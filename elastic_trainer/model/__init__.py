"""The GPT definition (plain PyTorch) and its Hugging Face GPT-2 conversion."""

from elastic_trainer.model.gpt import GPT, lm_loss_sum
from elastic_trainer.model.init import init_weights, materialize

__all__ = ["GPT", "lm_loss_sum", "init_weights", "materialize"]
