import math

import pytest
import torch

from elastic_trainer.config import TrainConfig
from elastic_trainer.model import GPT
from elastic_trainer.config import load_model_config
from elastic_trainer.train.optim import build_optimizer, lr_at


def test_warmup_then_cosine_to_min():
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, steps=20, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(12, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, cfg) == pytest.approx(1e-4) and lr_at(100, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_decay_steps_fix_the_schedule_independently_of_steps():
    a = TrainConfig(steps=10, decay_steps=100)
    b = TrainConfig(steps=50, decay_steps=100)
    assert [lr_at(s, a) for s in range(10)] == [lr_at(s, b) for s in range(10)]


def test_weight_decay_only_on_matrices():
    with torch.device("meta"):
        model = GPT(load_model_config("gpt-tiny"))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_checkpoint_initializes_adamw_state_like_adamw_itself():
    from elastic_trainer.checkpoint.state import init_optimizer_state

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    ours = torch.optim.AdamW(params, lr=0.1)
    init_optimizer_state(ours)
    theirs = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.0)
    for p in theirs.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    theirs.step()  # AdamW's own lazy initialization (then one step with zero gradients)
    for a, b in zip(params, theirs.param_groups[0]["params"]):
        sa, sb = ours.state[a], theirs.state[b]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape
            assert sa[key].device == sb[key].device
        assert float(sa["step"]) == 0.0 and float(sb["step"]) == 1.0
        assert not sa["exp_avg"].any() and not sa["exp_avg_sq"].any()
