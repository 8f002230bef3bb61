"""Our GPT against Hugging Face GPT2LMHeadModel, the independent reference implementation."""

import dataclasses

import pytest
import torch

from elastic_trainer.config import ConfigError, load_model_config
from elastic_trainer.model import GPT, materialize
from elastic_trainer.model.hf import (
    config_from_hf,
    config_to_hf,
    load_hf_folder,
    save_hf_folder,
    state_dict_from_hf,
    state_dict_to_hf,
)

transformers = pytest.importorskip("transformers")
CFG = dataclasses.replace(load_model_config("gpt-tiny"), n_layers=2)


def ours(seed=0):
    with torch.device("meta"):
        model = GPT(CFG)
    return materialize(model, "cpu", seed).eval()


def hf_model():
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in config_to_hf(CFG).items() if k != "architectures"})
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(hf_cfg).eval()


def tokens():
    return torch.randint(0, CFG.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_hf_weights_imported_give_hf_logits():
    hf = hf_model()  # HF's own initialization, not ours
    model = ours()
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), CFG))
    x = tokens()
    assert (model(x) - hf(x).logits).abs().max().item() <= 1e-5


@torch.no_grad()
def test_our_weights_exported_give_our_logits():
    model, hf = ours(seed=3), hf_model()
    missing, unexpected = hf.load_state_dict(state_dict_to_hf(model.state_dict(), CFG), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied: HF re-ties it to wte
    hf.tie_weights()
    x = tokens()
    assert (model(x) - hf(x).logits).abs().max().item() <= 1e-5


def test_import_export_round_trip_is_exact():
    hf_sd = {k: v for k, v in hf_model().state_dict().items() if k != "lm_head.weight"}
    back = state_dict_to_hf(state_dict_from_hf(hf_sd, CFG), CFG)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    sd = ours().state_dict()
    again = state_dict_from_hf(state_dict_to_hf(sd, CFG), CFG)
    assert set(again) == set(sd) and all(torch.equal(again[k], v) for k, v in sd.items())


@torch.no_grad()
def test_hf_folder_round_trip(tmp_path):
    model = ours(seed=5)
    save_hf_folder(tmp_path, CFG, model.state_dict())
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    x = tokens()
    assert (model(x) - hf(x).logits).abs().max().item() <= 1e-5
    cfg, sd = load_hf_folder(tmp_path)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size) == (
        CFG.n_layers,
        CFG.d_model,
        CFG.n_heads,
        CFG.vocab_size,
    )
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_unsupported_hf_variants_rejected():
    base = config_to_hf(CFG)
    with pytest.raises(ConfigError, match="activation_function='relu' is not supported"):
        config_from_hf({**base, "activation_function": "relu"})
    with pytest.raises(ConfigError, match="model_type='llama'"):
        config_from_hf({**base, "model_type": "llama"})


def test_missing_hf_folder_files(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf_folder(tmp_path)


def test_model_is_built_without_memory_on_meta():
    with torch.device("meta"):
        model = GPT(load_model_config("gpt3-xl"))
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == load_model_config("gpt3-xl").num_params()
    assert "layers.23.attn.qkv_proj.weight" in dict(model.named_parameters())


def test_sequence_longer_than_context_rejected():
    model = ours()
    with pytest.raises(ValueError, match="exceeds context_length=256"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_recompute_gives_same_gradients():
    x = tokens()
    grads = []
    for recompute in (False, True):
        model = ours().train()
        for block in model.layers.values():
            block.recompute = recompute
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=0, atol=1e-7), n
