"""A DeepSpeed checkpoint's parameters under our GPT's names and shapes.

Three namings are recognized: our GPT's own (DeepSpeed trained `model.gpt.GPT` directly), Hugging Face GPT-2's
(`transformer.h.0.attn.c_attn.weight`; Conv1D weights transposed and the fused qkv reordered as `model.hf`
does, for the weights and both Adam moments alike), and the layers of the PipelineModule in
`elastic_trainer.interop.deepspeed.pipeline_gpt` (`tied_modules.embed.tok_emb.weight`, `4.ln_1.weight`).
"""

from __future__ import annotations

import re

import torch

from elastic_trainer.checkpoint.train_state import gpt_params
from elastic_trainer.config import ConfigError, ModelConfig
from elastic_trainer.interop.deepspeed.read import DeepSpeedState, ParamState

TIED_KEY = "embed"
"""The tied-module key of the token embedding in elastic_trainer.interop.deepspeed.pipeline_gpt's
PipelineModule."""
PIPELINE = "elastic_trainer.interop.deepspeed.pipeline_gpt"


def gpt_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our GPT's parameter names and shapes, in its order (built on the meta device: no memory)."""
    return {n: shape for n, (shape, _) in gpt_params(cfg).items()}


def pipeline_param_name(name: str, n_layers: int) -> str | None:
    """A PipelineModule parameter name ('tied_modules.embed.tok_emb.weight', '1.pos_emb.weight',
    '4.ln_1.weight') -> our GPT's ('tok_emb.weight', 'pos_emb.weight', 'layers.2.ln_1.weight'); None for a
    name that is not part of the layers above."""
    if name == f"tied_modules.{TIED_KEY}.tok_emb.weight":
        return "tok_emb.weight"
    index, _, rest = name.partition(".")
    if not index.isdigit():
        return None
    i = int(index)
    if i == 1 and rest == "pos_emb.weight":
        return rest
    if 2 <= i < n_layers + 2 and rest.split(".", 1)[0] in ("ln_1", "attn", "ln_2", "mlp"):
        return f"layers.{i - 2}.{rest}"
    if i == n_layers + 2 and rest in ("ln_f.weight", "ln_f.bias"):
        return rest
    return None


def to_gpt(state: DeepSpeedState, cfg: ModelConfig) -> dict[str, ParamState]:
    """The checkpoint's parameters under our GPT's names, shapes checked against `cfg`."""
    want = gpt_shapes(cfg)
    names = list(state.params)
    if not names:
        raise ConfigError("the DeepSpeed checkpoint lists no parameters (empty param_shapes)")
    if "tok_emb.weight" in names:
        out = _from_ours(state, cfg, want)
    elif any(n.startswith("tied_modules.") or n.split(".", 1)[0].isdigit() for n in names):
        out = _from_pipeline(state, cfg)
    elif any(n.startswith(("transformer.", "h.", "wte.")) for n in names):
        out = _from_hf(state, cfg)
    else:
        raise ConfigError(
            f"unrecognized parameter names (first: {names[0]!r}): import reads DeepSpeed checkpoints "
            "of elastic_trainer's GPT, of Hugging Face GPT-2, or of the PipelineModule in "
            f"{PIPELINE}"
        )
    missing = [n for n in want if n not in out]
    if missing:
        raise ConfigError(
            f"the checkpoint lacks {len(missing)} parameter(s) of a GPT with {cfg.n_layers} layers "
            f"(first: {missing[0]!r}); it has {_layer_count(list(out))} layers (check --model)"
        )
    wrong = [(n, tuple(out[n].weight.shape), s) for n, s in want.items() if tuple(out[n].weight.shape) != s]
    if wrong:
        n, got, s = wrong[0]
        raise ConfigError(
            f"parameter {n!r} is {got} in the checkpoint but {s} in the model given (check --model: "
            f"d_model, vocab_size, context_length)"
        )
    return out


def _from_ours(state: DeepSpeedState, cfg: ModelConfig, want: dict) -> dict[str, ParamState]:
    names = list(state.params)
    extra = [n for n in names if n not in want]
    if extra:
        raise ConfigError(
            f"the checkpoint holds parameters a GPT with {cfg.n_layers} layers lacks (first: "
            f"{extra[0]!r}); it has {_layer_count(names)} layers (check --model)"
        )
    return {n: state.params[n] for n in want if n in state.params}


def _from_pipeline(state: DeepSpeedState, cfg: ModelConfig) -> dict[str, ParamState]:
    out = {}
    for n in state.params:
        ours = pipeline_param_name(n, cfg.n_layers)
        if ours is None:
            raise ConfigError(
                f"pipeline parameter {n!r} is not a layer of {PIPELINE}'s PipelineModule for a "
                f"{cfg.n_layers}-layer GPT (check --model)"
            )
        out.setdefault(ours, state.params[n])  # a tied parameter: its first stage's
    return out


def _from_hf(state: DeepSpeedState, cfg: ModelConfig) -> dict[str, ParamState]:
    names = list(state.params)
    source = _hf_names(cfg, names)
    absent = [theirs for theirs in source.values() if theirs not in state.params]
    if absent:
        raise ConfigError(
            f"the checkpoint's Hugging Face GPT-2 parameters lack {absent[0]!r} for a "
            f"{cfg.n_layers}-layer GPT; it has {_layer_count(names)} layers (check --model)"
        )
    extra = sorted(set(names) - set(source.values()))
    if extra:
        why = (
            "an untied output head is not supported"
            if extra[0].endswith("lm_head.weight")
            else f"it has {_layer_count(names)} layers (check --model)"
        )
        raise ConfigError(
            f"the checkpoint holds Hugging Face GPT-2 parameters a GPT with {cfg.n_layers} layers "
            f"lacks (first: {extra[0]!r}); {why}"
        )
    out = {}
    for ours, theirs in source.items():
        p = state.params[theirs]
        conv = {}
        for what in ("weight", "exp_avg", "exp_avg_sq"):
            try:
                conv[what] = _convert_hf_tensor(ours, getattr(p, what), cfg)
            except RuntimeError:
                raise ConfigError(
                    f"parameter {theirs!r} is {tuple(p.weight.shape)} in the checkpoint, which "
                    f"does not fit the model given (check --model)"
                ) from None
        out[ours] = ParamState(**conv, step=p.step, hyper=p.hyper)
    return out


def _hf_names(cfg: ModelConfig, names: list[str]) -> dict[str, str]:
    """our name -> the Hugging Face GPT-2 name (GPT2LMHeadModel's `transformer.` prefix or GPT2Model's none),
    from model.hf's tables."""
    from elastic_trainer.model import hf

    prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    out = {ours: prefix + theirs.removeprefix("transformer.") for ours, theirs in hf._TOP.items()}
    for i in range(cfg.n_layers):
        block = {
            **hf._BLOCK_RENAMES,
            **hf._BLOCK_TRANSPOSED,
            "attn.qkv_proj.weight": "attn.c_attn.weight",
            "attn.qkv_proj.bias": "attn.c_attn.bias",
        }
        out.update({f"layers.{i}.{ours}": f"{prefix}h.{i}.{theirs}" for ours, theirs in block.items()})
    return out


def _layer_count(names: list[str]) -> int:
    """Transformer blocks in a set of our (or Hugging Face) parameter names."""
    found = {m.group(1) for n in names if (m := re.match(r"^(?:transformer\.)?(?:layers|h)\.(\d+)\.", n))}
    return len(found)


def _convert_hf_tensor(ours: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """One HF GPT-2 tensor (weight or moment) as our parameter `ours`, by model.hf's element moves."""
    from elastic_trainer.model import hf

    if ours.endswith("attn.qkv_proj.weight"):
        return hf._qkv_from_hf(t.t(), cfg).contiguous()
    if ours.endswith("attn.qkv_proj.bias"):
        return hf._qkv_from_hf(t, cfg).contiguous()
    if any(ours.endswith(k) for k in hf._BLOCK_TRANSPOSED):
        return t.t().contiguous()
    return t.contiguous()
