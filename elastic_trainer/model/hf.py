"""Import from and export to Hugging Face `GPT2LMHeadModel` (weights and config).

The conversion is pure tensor reshuffling, so it needs neither transformers nor a network:
- HF's Conv1D stores weights as (in, out); ours are nn.Linear (out, in).
- HF's fused c_attn orders outputs [q | k | v]; ours interleaves them head by head (see model/gpt.py).
- HF ties lm_head.weight to transformer.wte.weight; we keep only the embedding.
A folder written by `save_hf_folder` loads with `GPT2LMHeadModel.from_pretrained(folder)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from elastic_trainer.config import ConfigError, ModelConfig

_BLOCK_RENAMES = {  # ours -> HF, inside one block
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "attn.o_proj.bias": "attn.c_proj.bias",
    "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.bias": "mlp.c_proj.bias",
}
_BLOCK_TRANSPOSED = {  # ours -> HF Conv1D weights, stored transposed
    "attn.o_proj.weight": "attn.c_proj.weight",
    "mlp.fc.weight": "mlp.c_fc.weight",
    "mlp.proj.weight": "mlp.c_proj.weight",
}
_TOP = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
}


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from a GPT-2 config.json dict; rejects variants our GPT does not implement."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"model_type={hf.get('model_type')!r} is not supported (valid: gpt2)")
    d = hf["n_embd"]
    checks = {
        "activation_function": (hf.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (hf.get("n_inner"), (None, 4 * d)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "reorder_and_upcast_attn": (hf.get("reorder_and_upcast_attn", False), (False,)),
    }
    for key, (value, valid) in checks.items():
        if value not in valid:
            raise ConfigError(f"GPT-2 config {key}={value!r} is not supported (valid: {valid})")
    dropouts = {hf.get(k, 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    return ModelConfig(
        n_layers=hf["n_layer"],
        d_model=d,
        n_heads=hf["n_head"],
        vocab_size=hf["vocab_size"],
        context_length=hf["n_positions"],
        dropout=max(dropouts),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        name=hf.get("_name_or_path") or "gpt2-import",
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context_length,
        "n_ctx": cfg.context_length,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": "float32",
    }


def _qkv_from_hf(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[q | k | v] (3d, ...) -> head-interleaved [q_0 k_0 v_0 q_1 ...]."""
    rest = w.shape[1:]
    return w.reshape(3, cfg.n_heads, cfg.head_dim, *rest).transpose(0, 1).reshape(3 * cfg.d_model, *rest)


def _qkv_to_hf(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(cfg.n_heads, 3, cfg.head_dim, *rest).transpose(0, 1).reshape(3 * cfg.d_model, *rest)


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept both GPT2LMHeadModel keys (transformer.h.0...) and GPT2Model keys (h.0...)."""
    if any(k.startswith("transformer.") for k in sd):
        return sd
    return {(k if k.startswith("lm_head.") else f"transformer.{k}"): v for k, v in sd.items()}


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf_sd = _strip_prefix(hf_sd)
    out = {ours: hf_sd[theirs] for ours, theirs in _TOP.items()}
    for i in range(cfg.n_layers):
        h = f"transformer.h.{i}."
        for ours, theirs in _BLOCK_RENAMES.items():
            out[f"layers.{i}.{ours}"] = hf_sd[h + theirs]
        for ours, theirs in _BLOCK_TRANSPOSED.items():
            out[f"layers.{i}.{ours}"] = hf_sd[h + theirs].t()
        out[f"layers.{i}.attn.qkv_proj.weight"] = _qkv_from_hf(hf_sd[h + "attn.c_attn.weight"].t(), cfg)
        out[f"layers.{i}.attn.qkv_proj.bias"] = _qkv_from_hf(hf_sd[h + "attn.c_attn.bias"], cfg)
    if "lm_head.weight" in hf_sd and not torch.equal(hf_sd["lm_head.weight"], out["tok_emb.weight"]):
        raise ConfigError("lm_head.weight differs from transformer.wte.weight: untied heads are not supported")
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: sd[ours] for ours, theirs in _TOP.items()}
    for i in range(cfg.n_layers):
        h = f"transformer.h.{i}."
        for ours, theirs in _BLOCK_RENAMES.items():
            out[h + theirs] = sd[f"layers.{i}.{ours}"]
        for ours, theirs in _BLOCK_TRANSPOSED.items():
            out[h + theirs] = sd[f"layers.{i}.{ours}"].t()
        out[h + "attn.c_attn.weight"] = _qkv_to_hf(sd[f"layers.{i}.attn.qkv_proj.weight"], cfg).t()
        out[h + "attn.c_attn.bias"] = _qkv_to_hf(sd[f"layers.{i}.attn.qkv_proj.bias"], cfg)
    return {k: v.contiguous() for k, v in out.items()}


def save_hf_folder(folder: str | Path, cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> Path:
    """Write config.json + model.safetensors that GPT2LMHeadModel.from_pretrained loads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", torch.float32) for k, v in state_dict_to_hf(sd, cfg).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GPT-2 folder (config.json + model.safetensors or pytorch_model.bin) from disk."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"{str(folder)!r} has no config.json: not a Hugging Face model folder")
    cfg = config_from_hf(json.loads(cfg_path.read_text()))
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        hf_sd = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").exists():
        hf_sd = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{str(folder)!r} has neither model.safetensors nor pytorch_model.bin")
    return cfg, state_dict_from_hf(hf_sd, cfg)
