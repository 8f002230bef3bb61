import math

import pytest
import torch

from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.model import GPT
from elastic_trainer.train.optim import build_optimizer, lr_at, set_lr


def test_warmup_then_cosine_to_min():
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, steps=20, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(12, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, cfg) == pytest.approx(1e-4) and lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(4, cfg) == 1e-3  # the first step after warm-up is the peak: cosine at progress 0
    lrs = [lr_at(s, cfg) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("decay_steps", [5, 4, 3])
def test_a_schedule_no_longer_than_the_warmup_ends_in_one_step(decay_steps):
    """decay_steps <= warmup + 1: the cosine spans one step (never zero or negative), from the peak at the
    end of warm-up straight to the minimum."""
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, steps=20, min_lr_ratio=0.1, decay_steps=decay_steps)
    assert [lr_at(s, cfg) for s in range(3, 7)] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4], rel=1e-12)


def test_set_lr_sets_every_group():
    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1.0)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # AdamW's first step moves every element by lr (times lr * weight decay): the new lr is used
    assert params[1].detach().tolist() == pytest.approx([1 - 0.25 * 0.01 - 0.25] * 2, rel=1e-6)


def test_decay_steps_fix_the_schedule_independently_of_steps():
    a = TrainConfig(steps=10, decay_steps=100)
    b = TrainConfig(steps=50, decay_steps=100)
    assert [lr_at(s, a) for s in range(10)] == [lr_at(s, b) for s in range(10)]


def test_the_optimizer_takes_betas_eps_and_lr_from_the_config():
    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
    model = torch.nn.Module()
    model.w, model.b = params
    opt = build_optimizer(model, TrainConfig(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.2))
    assert isinstance(opt, torch.optim.AdamW)
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [
        (0.05, (0.8, 0.9), 1e-3, 0.2),
        (0.05, (0.8, 0.9), 1e-3, 0.0),
    ]


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


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_checkpoint_initializes_adam_state_as_a_first_step_would_find_it(cls, amsgrad):
    """Our zero state, then a step, equals the optimizer's own lazy initialization and the same step."""
    from elastic_trainer.checkpoint.state import init_optimizer_state

    torch.manual_seed(0)
    start = [torch.randn(3, 2), torch.randn(4)]
    grads = [torch.randn(3, 2), torch.randn(4)]
    runs = []
    for pre_init in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cls([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}], lr=0.1, amsgrad=amsgrad)
        if pre_init:
            init_optimizer_state(opt)
            want = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
            for p in params:
                assert set(opt.state[p]) == want
                assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].shape == ()
                assert float(opt.state[p]["step"]) == 0.0
                assert all(not opt.state[p][k].any() and opt.state[p][k].shape == p.shape for k in want - {"step"})
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        runs.append((params, opt))
    (ours, ours_opt), (theirs, theirs_opt) = runs
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key, value in theirs_opt.state[b].items():
            torch.testing.assert_close(ours_opt.state[a][key], value, rtol=0, atol=0)


def test_checkpoint_state_init_follows_the_default_dtype_and_the_device_branch():
    """The step count's dtype is the default dtype, except capturable/fused groups keep a float32 on the device."""
    from elastic_trainer.checkpoint.state import init_optimizer_state

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        plain, captured, fused = (torch.nn.Parameter(torch.zeros(2, dtype=torch.float32)) for _ in range(3))
        opt = torch.optim.AdamW(
            [{"params": [plain]}, {"params": [captured], "capturable": True}, {"params": [fused], "fused": True}],
            lr=0.1,
        )
        init_optimizer_state(opt)
        assert opt.state[plain]["step"].dtype == torch.float64
        assert opt.state[captured]["step"].dtype == torch.float32 and opt.state[captured]["step"].shape == ()
        assert opt.state[fused]["step"].dtype == torch.float32
        assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in (plain, captured, fused))
        # a capturable group's step lives on its parameter's device (meta here: not the default device)
        on_meta = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32, device="meta"))
        meta_opt = torch.optim.AdamW([on_meta], lr=0.1, capturable=True)
        init_optimizer_state(meta_opt)
        assert meta_opt.state[on_meta]["step"].device.type == "meta"
        assert meta_opt.state[on_meta]["exp_avg"].device.type == "meta"
    finally:
        torch.set_default_dtype(old)


def test_checkpoint_state_init_leaves_a_stepped_or_other_optimizer_alone():
    from elastic_trainer.checkpoint.state import init_optimizer_state

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((3,), 2.0)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    init_optimizer_state(opt)
    assert float(opt.state[p]["step"]) == 1.0
    for key, value in before.items():
        assert torch.equal(opt.state[p][key], value)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    init_optimizer_state(sgd)
    assert not sgd.state


def test_the_optimizer_is_fused_and_a_loaded_state_does_not_change_that():
    from elastic_trainer.checkpoint.state import keep_implementation

    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, TrainConfig())
    assert [g["fused"] for g in opt.param_groups] == [True, True]
    other = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}], lr=1.0)  # torch's default
    saved = other.state_dict()
    with keep_implementation(opt):
        opt.load_state_dict(saved)
    assert [g["fused"] for g in opt.param_groups] == [True, True] and opt.param_groups[0]["lr"] == 1.0
    opt.load_state_dict(saved)  # what the context undoes
    assert [g["fused"] for g in opt.param_groups] == [None, None]


def test_the_clipping_s_sum_of_squares_in_chunks_is_the_whole_sum():
    from elastic_trainer.parallel.engine import sum_of_squares

    t = torch.randn(25, 100, generator=torch.Generator().manual_seed(0))
    exact = float(t.double().square().sum())
    assert float(sum_of_squares(t, chunk=1000)) == pytest.approx(exact, rel=1e-6)  # 3 chunks, the last of 500
    assert float(sum_of_squares(t)) == pytest.approx(exact, rel=1e-6)  # one
    assert float(sum_of_squares(t.bfloat16(), chunk=300)) == pytest.approx(
        float(t.bfloat16().double().square().sum()), rel=1e-6
    )  # squared in fp32
