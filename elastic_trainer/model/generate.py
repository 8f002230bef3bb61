"""Text from a checkpoint: `elastic-trainer generate CHECKPOINT --prompt TEXT` (issue 34, item 4).

The checkpoint, saved in any layout, is read into one process (checkpoint/offline.py: the full weights through
DCP's resharding load), and tokens are drawn one at a time with a key/value cache: the prompt runs through the
model once, keeping every layer's keys and values; each new token then runs alone against the cache, so a
token costs one position's work, not the whole context's. `--temperature 0` is greedy (the most likely token,
as Hugging Face's `generate` without sampling); otherwise the logits are divided by the temperature, cut to the
`--top-k` most likely tokens when given, and sampled with a generator seeded by `--seed`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_trainer.config import ConfigError
from elastic_trainer.model.gpt import project_to_vocab


def check(
    prompt_tokens: int, max_new_tokens: int, temperature: float, top_k: int | None, context_length: int | None = None
) -> None:
    """One-line errors for what cannot be generated (against the model's context once it is known)."""
    if prompt_tokens == 0:
        raise ConfigError("--prompt is empty (valid: some text)")
    if context_length is not None and prompt_tokens + max_new_tokens > context_length:
        raise ConfigError(
            f"the prompt ({prompt_tokens} tokens) and --max-new-tokens {max_new_tokens} exceed the "
            f"model's context of {context_length} tokens (valid: at most {context_length} together)"
        )
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    if not temperature >= 0:
        raise ConfigError(f"--temperature {temperature} must be >= 0 (0: greedy)")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k} must be >= 1 (leave it out to sample from every token)")


def _forward(model, ids: torch.Tensor, start: int, cache: list) -> torch.Tensor:
    """The next token's logits after `ids` (1, T), which follow `start` cached positions; `cache` (one (k, v)
    per layer, or None) grows by T positions."""
    T = ids.shape[1]
    h = model.tok_emb(ids) + model.pos_emb(torch.arange(start, start + T, device=ids.device))
    for i, block in enumerate(model.layers.values()):
        attn = block.attn
        qkv = attn.qkv_proj(block.ln_1(h)).view(1, T, -1, 3, attn.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # (1, heads, T, head_dim)
        if cache[i] is not None:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        cache[i] = (k, v)
        # the prompt (start 0): causal among its own positions; one new token: it sees every cached one
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        h = h + attn.o_proj(y.transpose(1, 2).reshape(1, T, -1))
        h = h + block.mlp(block.ln_2(h))
    return project_to_vocab(model.ln_f(h[:, -1]), model.tok_emb.weight)[0]


@torch.no_grad()
def generate(
    model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None, seed: int = 0
) -> list[int]:
    """`max_new_tokens` token ids after `prompt` from `model` (our GPT, whole, in eval mode)."""
    cfg = model.config
    check(len(prompt), max_new_tokens, temperature, top_k, cfg.context_length)
    device = model.tok_emb.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache: list = [None] * len(model.layers)
    logits = _forward(model, torch.tensor([prompt], device=device), 0, cache)
    out: list[int] = []
    for n in range(max_new_tokens):
        if temperature == 0:
            token = int(logits.argmax())
        else:
            scaled = logits.float() / temperature
            if top_k is not None and top_k < scaled.numel():
                kth = torch.topk(scaled, top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
        out.append(token)
        if n + 1 < max_new_tokens:
            logits = _forward(model, torch.tensor([[token]], device=device), len(prompt) + n, cache)
    return out


def from_checkpoint(path: str):
    """Our GPT with the weights of the checkpoint at `path` (a checkpoint folder, or a root: its newest
    complete one), in eval mode, and the folder read."""
    from elastic_trainer.checkpoint.offline import load_model_weights, resolve
    from elastic_trainer.model import GPT

    folder, _ = resolve(path)
    cfg, weights = load_model_weights(folder)
    model = GPT(cfg).eval()
    model.load_state_dict(weights)
    return model, folder
