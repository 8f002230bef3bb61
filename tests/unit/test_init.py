"""Initialization is a function of (seed, global parameter name): a pipeline stage gets exactly the values
the whole model has for the same names."""

import torch

from elastic_trainer.config import load_model_config
from elastic_trainer.model import GPT, materialize
from elastic_trainer.parallel.pipeline import split_stage
from elastic_trainer.plan.layout import stage_layers

CFG = load_model_config("gpt-tiny")


def build(seed, stage=None, pp=1):
    with torch.device("meta"):
        model = GPT(CFG)
    if stage is not None:
        split_stage(model, stage_layers(CFG.n_layers, pp)[stage], stage == 0, stage == pp - 1)
    return materialize(model, "cpu", seed)


def test_stages_hold_the_full_models_values():
    full = dict(build(7).named_parameters())
    seen = set()
    for stage in range(4):
        for name, p in build(7, stage, pp=4).named_parameters():
            assert torch.equal(p, full[name]), name
            seen.add(name)
    assert seen == set(full)


def test_seed_changes_weights_and_init_statistics():
    a, b = dict(build(1).named_parameters()), dict(build(2).named_parameters())
    assert not torch.equal(a["layers.0.mlp.fc.weight"], b["layers.0.mlp.fc.weight"])
    assert torch.equal(a["layers.0.ln_1.weight"], torch.ones(64))
    assert torch.equal(a["layers.0.mlp.fc.bias"], torch.zeros(256))
    assert abs(a["tok_emb.weight"].std().item() - 0.02) < 1e-3
    assert abs(a["layers.0.mlp.proj.weight"].std().item() - 0.02 / (2 * CFG.n_layers) ** 0.5) < 1e-3
