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
