"""A GPT in plain PyTorch: learned positions, pre-LayerNorm blocks, causal attention through
`scaled_dot_product_attention`, GELU MLP of width 4*d_model, output head tied to the token embedding.

Nothing here knows about ranks. Two choices serve the parallel engine:
- blocks live in `layers`, a ModuleDict keyed by the *global* layer index, so a pipeline stage that keeps
  layers 12..23 still names them `layers.17...` and checkpoint keys never depend on the layout;
- the fused QKV projection orders its output rows head by head ([q_h, k_h, v_h] for h = 0..H-1), so a
  column-wise split into tp equal parts gives each rank whole heads. (HF GPT-2 orders them [q | k | v];
  `model/hf.py` converts.)
A stage is the same class with pieces removed: without `pos_emb` the input is a hidden state rather than
token ids; without `ln_f` the output is a hidden state rather than logits.

Dropout (model.dropout > 0) is layout-independent when the caller passes `dropout_keys`, one key per sample
(model/dropout.py): the masks are then a function of the sample, layer and site, not of the rank or the
micro-batch. Without keys the sites fall back to torch's RNG-driven dropout (a model used on its own).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from elastic_trainer.config import ModelConfig
from elastic_trainer.model import dropout as keyed

INIT_STD = 0.02

VOCAB_PAD_MULTIPLE = {"cuda": 64}
"""Per device type: the output head's GEMMs run on the weight padded with zero rows to a multiple of this
(absent: never). GPT-2's vocabulary, 50257, is odd, and cuBLAS then runs the head's three GEMMs in alignment-1
kernels: 126 TFLOP/s on an H200 against 762 at 50304 (benchmarks/gpu/results/NVIDIA-H200/README.md). The
parameter keeps its 50257 rows (checkpoints, Hugging Face import and export and resharding are unchanged); the
padded logits are sliced off before anything sees them, so the padded rows get no gradient. Not on the CPU,
where the sizes cost nothing and the fp32 trajectory stays the one the tests pin."""


def project_to_vocab(h: torch.Tensor, weight: torch.Tensor, multiple: int | None = None) -> torch.Tensor:
    """Logits of hidden states `h` against the (tied) embedding `weight`: `F.linear(h, weight)`, with the
    weight padded to a multiple of VOCAB_PAD_MULTIPLE[device type] rows (`multiple` overrides it)."""
    vocab = weight.shape[0]
    if multiple is None:
        multiple = VOCAB_PAD_MULTIPLE.get(weight.device.type, 1)
    pad = -vocab % multiple
    if pad == 0 or isinstance(weight, DTensor):  # a DTensor keeps torch's own dispatch
        return F.linear(h, weight)
    return F.linear(h, F.pad(weight, (0, 0, 0, pad)))[..., :vocab]


def _drop(
    x: torch.Tensor, p: float, keys: torch.Tensor | None, site: str, training: bool, offset: int = 0
) -> torch.Tensor:
    """Dropout at one site: keyed (layout-independent) when its layer's keys (dropout.layer_keys) are given,
    else torch's own."""
    if not training or p == 0.0:
        return x
    if keys is None:
        return F.dropout(x, p, training=True)
    return keyed.dropout(x, keyed.site_of(keys, site), p, offset)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.head_offset = 0
        """Global index of this module's first head (set by tensor parallelism), for the dropout masks."""
        self.qkv_proj = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj.init_std = INIT_STD / math.sqrt(2 * cfg.n_layers)  # GPT-2 residual scaling

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads are counted from the tensor, so the same code runs on a tensor-parallel shard.
        qkv = self.qkv_proj(x).view(B, T, -1, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        if self.training and self.dropout > 0 and keys is not None:
            y = self._attention_with_keyed_dropout(q, k, v, keys)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return _drop(self.o_proj(y), self.dropout, keys, "attn_out", self.training)

    def _attention_with_keyed_dropout(self, q, k, v, keys: torch.Tensor) -> torch.Tensor:
        """Causal attention with the probabilities materialized so that their dropout mask can be keyed by
        global head index (fused kernels draw their masks from the device RNG)."""
        T = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        probs = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(q.dtype)
        probs = _drop(probs, self.dropout, keys, "attn", True, self.head_offset * T * T)
        return probs @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.proj.init_std = INIT_STD / math.sqrt(2 * cfg.n_layers)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return _drop(y, self.dropout, keys, "mlp_out", self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.recompute = False
        """Recompute this block's activations in backward instead of storing them (saves memory)."""

    def _forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keys)
        return x + self.mlp(self.ln_2(x), keys)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """`keys`: this layer's dropout keys (dropout.layer_keys), so that every block runs the same code."""
        if self.recompute and torch.is_grad_enabled():  # keyed masks are recomputed identically
            return checkpoint(self._forward, x, keys, use_reentrant=False)
        return self._forward(x, keys)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        self.pos_emb.init_std = INIT_STD / 2  # GPT-2 initialises positions at 0.01
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    @property
    def has_input(self) -> bool:
        """True when this (stage of the) model takes token ids."""
        return self.pos_emb is not None

    @property
    def has_output(self) -> bool:
        """True when this (stage of the) model returns logits."""
        return self.ln_f is not None

    def forward(self, x: torch.Tensor, dropout_keys: torch.Tensor | None = None) -> torch.Tensor:
        """`dropout_keys`: one int64 key per sample (model/dropout.py.sample_keys) for layout-independent
        dropout; ignored when dropout is off or in eval mode."""
        if self.has_input:
            T = x.shape[1]
            if T > self.config.context_length:
                raise ValueError(f"sequence length {T} exceeds context_length={self.config.context_length}")
            pos = torch.arange(T, device=x.device)
            keys = None if dropout_keys is None else keyed.layer_keys(dropout_keys, -1)
            x = _drop(self.tok_emb(x) + self.pos_emb(pos), self.config.dropout, keys, "embed", self.training)
        for name, layer in self.layers.items():
            x = layer(x, None if dropout_keys is None else keyed.layer_keys(dropout_keys, int(name)))
        if self.has_output:
            x = project_to_vocab(self.ln_f(x), self.tok_emb.weight)
        return x


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, in fp32 whatever the logits' precision."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
