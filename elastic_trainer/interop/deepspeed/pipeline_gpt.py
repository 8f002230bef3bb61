"""Our GPT as DeepSpeed trains it: the whole module under ZeRO, or as `PipelineModule` layers.

`elastic-trainer checkpoint import-deepspeed` reads checkpoints of either. The pipeline's layers are, in order:
the token embedding (tied with the output projection), the position embedding, one layer per transformer
block, the final LayerNorm, and the output projection through the tied token embedding. Only the token
embedding is tied: a tied module is copied onto every stage that uses it, and a parameter of it that one
stage never uses would drift there (its copy gets no gradient but still weight decay), which DeepSpeed's
universal conversion may then keep. Parameter names inside each layer are the GPT's own (`tok_emb.weight`,
`pos_emb.weight`, `ln_1.weight`, `ln_f.bias`...), so a layer maps back by position
(`names.pipeline_param_name`). DeepSpeed is imported only when a pipeline is built. Used by DeepSpeed's side
of tests/distributed/test_deepspeed_import.py and benchmarks/vs_deepspeed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic_trainer.config import ModelConfig
from elastic_trainer.interop.deepspeed.names import TIED_KEY, pipeline_param_name
from elastic_trainer.model.gpt import GPT, Block


class Embed(nn.Module):
    """The token embedding (the pipeline's first layer, tied with its last)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(tokens)


class Positions(nn.Module):
    """Adds the learned position embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos_emb(torch.arange(x.shape[1], device=x.device))


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class PipeBlock(Block):
    """A transformer block taking and returning one tensor, as pipeline layers do (no dropout keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


def _project(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embed.tok_emb.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, the loss our trainer reports."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def copy_weights_into_pipeline(gpt: GPT, pipe: nn.Module) -> None:
    """Give a PipelineModule's layers (on this stage) the weights of a whole GPT."""
    sd = gpt.state_dict()
    for name, tensor in pipe.state_dict().items():
        ours = pipeline_param_name(name, gpt.config.n_layers)
        if ours is not None:
            tensor.copy_(sd[ours])


def pipeline_module(cfg: ModelConfig, num_stages: int, loss_fn=lm_loss, **kwargs):
    """DeepSpeed's PipelineModule of our GPT (partitioned by parameter count unless `partition_method` says)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [TiedLayerSpec(TIED_KEY, Embed, cfg, tied_weight_attr=["tok_emb.weight"]), LayerSpec(Positions, cfg)]
    layers += [LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layers)]
    layers += [
        LayerSpec(FinalNorm, cfg),
        TiedLayerSpec(TIED_KEY, Embed, cfg, forward_fn=_project, tied_weight_attr=["tok_emb.weight"]),
    ]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn, **kwargs)
