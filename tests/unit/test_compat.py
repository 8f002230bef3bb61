"""Run:AI-style API: gradient accumulation against a plain optimizer on the concatenated batch, and init()."""

from __future__ import annotations

import ast
import copy
import io
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer import compat
from elastic_trainer.compat import GradientAccumulation
from elastic_trainer.config import ConfigError

PACKAGE = Path(compat.__file__).resolve().parents[1]

K, B, UPDATES = 4, 3, 5  # accumulation steps, micro-batch, optimizer updates
HYPER = {
    "SGD": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "Adam": dict(lr=1e-2),
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "RMSprop": dict(lr=1e-2, momentum=0.5),
    "Adagrad": dict(lr=0.1),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def make_data(n: int = K * B * UPDATES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)  # mean over the (micro-)batch


def train_usual_loop(model, opt, x, y, batch) -> None:
    """The Run:AI user's loop: backward, step, zero_grad on every batch."""
    for xb, yb in zip(x.split(batch), y.split(batch)):
        loss_of(model, xb, yb).backward()
        opt.step()
        opt.zero_grad()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def accumulated(name: str, how: str, params, steps: int = K) -> GradientAccumulation:
    if how == "ready-made":
        return getattr(compat.optim, name)(params, steps=steps, **HYPER[name])
    return GradientAccumulation(getattr(torch.optim, name)(params, **HYPER[name]), steps)


@pytest.mark.parametrize("how", ["wrapper", "ready-made"])
@pytest.mark.parametrize("name", list(HYPER))
def test_k_accumulated_steps_equal_one_step_on_k_times_the_batch(name, how):
    x, y = make_data()
    reference = make_model()
    train_usual_loop(reference, getattr(torch.optim, name)(reference.parameters(), **HYPER[name]), x, y, K * B)
    model = make_model()
    opt = accumulated(name, how, model.parameters())
    train_usual_loop(model, opt, x, y, B)
    assert opt.at_boundary and max_diff(model, reference) < 1e-6
    # The comparison can fail: one update per micro-batch lands far away.
    per_micro = make_model()
    train_usual_loop(per_micro, getattr(torch.optim, name)(per_micro.parameters(), **HYPER[name]), x, y, B)
    assert max_diff(per_micro, reference) > 1e-3


def test_parameters_without_grad_in_some_micro_batches():
    """A parameter used by one micro-batch in K gets that gradient / K; one never used is left alone."""
    x, y = make_data()

    def run(batch, steps, extra_scale):
        model, extra, unused = make_model(), nn.Parameter(torch.zeros(3)), nn.Parameter(torch.ones(2))
        opt = GradientAccumulation(torch.optim.AdamW([*model.parameters(), extra, unused], lr=1e-2), steps)
        for i, (xb, yb) in enumerate(zip(x.split(batch), y.split(batch))):
            loss = loss_of(model, xb, yb)
            if i % steps == steps - 1:  # only the last micro-batch of a cycle touches `extra`
                loss = loss + extra_scale * (extra * torch.arange(3.0)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model, extra, unused, opt

    model, extra, unused, opt = run(B, K, 1.0)
    ref_model, ref_extra, _, _ = run(K * B, 1, 1.0 / K)  # the mean over the big batch weighs it 1/K
    assert max_diff(model, ref_model) < 1e-6 and (extra - ref_extra).abs().max() < 1e-6
    assert extra.abs().sum() > 0 and unused.grad is None and torch.equal(unused, torch.ones(2))
    assert unused not in opt.state


def test_zero_grad_clears_only_at_a_boundary():
    model = make_model()
    opt = compat.optim.SGD(model.parameters(), lr=0.1, steps=3)
    x, y = make_data()
    before = [p.detach().clone() for p in model.parameters()]
    for i in range(2):
        loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
        opt.step()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad()
        assert not opt.at_boundary and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # no update yet
    loss_of(model, x[2:3], y[2:3]).backward()
    opt.step()
    opt.zero_grad()
    assert opt.at_boundary and all(p.grad is None for p in model.parameters())
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_state_dict_round_trip_mid_cycle_resumes_identically():
    x, y = make_data(K * B * 3)
    whole = make_model()
    train_usual_loop(whole, compat.optim.AdamW(whole.parameters(), lr=1e-2, steps=K), x, y, B)

    cut = (K + K // 2) * B  # two micro-batches into the second cycle
    first = make_model()
    opt = compat.optim.AdamW(first.parameters(), lr=1e-2, steps=K)
    train_usual_loop(first, opt, x[:cut], y[:cut], B)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = make_model(seed=7)  # other weights, no gradients: everything must come from the checkpoint
    opt = compat.optim.AdamW(resumed.parameters(), lr=1e-2, steps=K)
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    assert not opt.at_boundary
    train_usual_loop(resumed, opt, x[cut:], y[cut:], B)
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), whole.parameters()))


def test_state_dict_steps_mismatch_and_plain_state():
    model = make_model()
    x, y = make_data()
    opt = compat.optim.SGD(model.parameters(), lr=0.1, steps=K)
    train_usual_loop(model, opt, x[:B], y[:B], B)
    with pytest.raises(ConfigError, match=r"saved 1 calls into a 4-step .* steps=2 \(valid: steps=4"):
        compat.optim.SGD(model.parameters(), lr=0.1, steps=2).load_state_dict(opt.state_dict())
    plain = torch.optim.SGD(model.parameters(), lr=0.05)
    other = compat.optim.SGD(model.parameters(), lr=0.1, steps=2)
    other.load_state_dict(plain.state_dict())  # a plain optimizer's state: resumes at a boundary
    assert other.at_boundary and other.param_groups[0]["lr"] == 0.05


def test_lr_scheduler_stepped_per_update_matches_the_big_batch_run():
    x, y = make_data()
    schedule = lambda update: 1.0 / (1 + update)  # noqa: E731
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    model = make_model()
    opt = compat.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, steps=K)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for i, (xb, yb) in enumerate(zip(x.split(B), y.split(B))):
            loss_of(model, xb, yb).backward()
            opt.step()
            opt.zero_grad()
            if opt.at_boundary:
                sched.step()
            if i % K == K - 1:
                loss_of(reference, x[(i + 1 - K) * B : (i + 1) * B], y[(i + 1 - K) * B : (i + 1) * B]).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                ref_sched.step()
    assert sched.get_last_lr() == ref_sched.get_last_lr() == [0.1 / (1 + UPDATES)]
    assert max_diff(model, reference) < 1e-6


def test_changing_lr_in_param_groups_takes_effect():
    x, y = make_data()
    model = make_model()
    opt = GradientAccumulation(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert opt.param_groups is opt.optimizer.param_groups and opt.defaults["lr"] == 0.1
    opt.param_groups[0]["lr"] = 0.0
    before = copy.deepcopy(model)
    train_usual_loop(model, opt, x[: 2 * B], y[: 2 * B], B)
    assert max_diff(model, before) == 0.0
    opt.param_groups[0]["lr"] = 0.3
    train_usual_loop(model, opt, x[2 * B : 4 * B], y[2 * B : 4 * B], B)
    train_usual_loop(before, torch.optim.SGD(before.parameters(), lr=0.3), x[2 * B : 4 * B], y[2 * B : 4 * B], 2 * B)
    assert max_diff(model, before) < 1e-6 and max_diff(model, make_model()) > 1e-3


def test_closure_is_evaluated_once_per_call():
    x, y = make_data()
    reference = make_model()
    train_usual_loop(reference, compat.optim.Adam(reference.parameters(), lr=1e-2, steps=K), x, y, B)
    model = make_model()
    opt = compat.optim.Adam(model.parameters(), lr=1e-2, steps=K)
    losses = []
    for xb, yb in zip(x.split(B), y.split(B)):

        def closure(xb=xb, yb=yb):
            opt.zero_grad()
            loss = loss_of(model, xb, yb)
            loss.backward()
            return loss

        losses.append(opt.step(closure))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert len(losses) == K * UPDATES and all(loss.ndim == 0 for loss in losses)


def test_hooks_run_on_real_updates_and_copies_keep_the_cycle():
    model = make_model()
    opt = compat.optim.AdamW(model.parameters(), lr=1e-3, steps=K)
    updates = []
    opt.register_step_post_hook(lambda o, args, kwargs: updates.append(o))
    x, y = make_data()
    train_usual_loop(model, opt, x[: (2 * K + 1) * B], y[: (2 * K + 1) * B], B)
    assert updates == [opt.optimizer, opt.optimizer]
    clone = copy.deepcopy(opt)
    assert (clone.steps, clone.at_boundary, type(clone).__name__) == (K, False, "AdamW")
    assert repr(opt).startswith("AdamW(steps=4, pending=1, AdamW (")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda p: GradientAccumulation(torch.optim.SGD(p, lr=0.1), 0), "steps=0 must be a positive integer"),
        (lambda p: GradientAccumulation(torch.optim.SGD(p, lr=0.1), 2.0), "steps=2.0 must be a positive integer"),
        (lambda p: GradientAccumulation(list(p), 2), "optimizer=list is not a torch.optim.Optimizer"),
        (
            lambda p: GradientAccumulation(compat.optim.SGD(p, lr=0.1, steps=2), 2),
            "optimizer already accumulates over 2 steps (valid: wrap its inner SGD once)",
        ),
        (lambda p: GradientAccumulation(torch.optim.LBFGS(p), 2), "LBFGS re-evaluates its closure"),
    ],
)
def test_bad_wrapper_input_is_one_clear_line(build, message):
    with pytest.raises(ConfigError) as info:
        build(make_model().parameters())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_ready_made_optimizers_take_steps_by_keyword_only():
    params = list(make_model().parameters())
    with pytest.raises(TypeError, match="steps"):
        compat.optim.AdamW(params, 4)  # Run:AI's positional steps would collide with torch's lr
    opt = compat.optim.AdamW(params, 1e-3, steps=2)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.steps == 2
    assert isinstance(opt, GradientAccumulation) and isinstance(opt, torch.optim.Optimizer)
    assert isinstance(opt.optimizer, torch.optim.AdamW)
    for name in ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam"):
        assert isinstance(getattr(compat.optim, name)(params, steps=3).optimizer, getattr(torch.optim, name))


# --- init ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, batch_size, steps", [(1, 64, 4), (2, 64, 2), (4, 64, 1), (8, 32, 1)])
def test_init_reproduces_runai_examples(world, batch_size, steps):
    """Run:AI's documented example: global batch 256, at most 64 samples per GPU."""
    cfg = compat.init(256, 64, world_size=world)
    assert (cfg.batch_size, cfg.steps, cfg.world_size, cfg.global_batch_size) == (batch_size, steps, world, 256)


def smallest_steps(share: int, limit: int) -> int:
    """Brute force: the fewest equal batches of at most `limit` that `share` splits into."""
    return min(s for s in range(1, share + 1) if share % s == 0 and share // s <= limit)


def test_init_takes_the_fewest_accumulation_steps_that_fit():
    for world in (1, 2, 3, 4, 8):
        for global_batch in range(world, 61, world):
            for limit in range(1, 13):
                cfg = compat.init(global_batch, limit, world_size=world)
                assert cfg.batch_size * cfg.steps * world == global_batch and cfg.batch_size <= limit
                assert cfg.steps == smallest_steps(global_batch // world, limit)


def test_init_world_size_and_master_from_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert (compat.init(8, 8).world_size, compat.init(8, 8).master) == (1, True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    cfg = compat.init(256, 64)
    assert (cfg.world_size, cfg.steps, cfg.master) == (4, 1, False)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match=r"^environment variable WORLD_SIZE='four' must be an integer >= 1$"):
        compat.init(256, 64)
    assert compat.init(256, 64, world_size=2).steps == 2  # an explicit world size never reads WORLD_SIZE


def test_init_prefers_the_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = compat.init(256, 64)
    finally:
        dist.destroy_process_group()
    assert (cfg.world_size, cfg.steps, cfg.master) == (1, 4, True)


@pytest.mark.parametrize(
    "args, message",
    [
        ((100, 64, 3), "global batch 100 is not divisible by 3 GPUs (nearest feasible: 99 or 102)"),
        ((2, 64, 4), "global batch 2 is not divisible by 4 GPUs (nearest feasible: 4)"),
        (
            (0, 64, 2),
            "global_batch_size=0 must be a positive integer divisible by the world size 2 (nearest feasible: 2)",
        ),
        (
            (256.5, 64, 1),
            "global_batch_size=256.5 must be a positive integer divisible by the world size 1 "
            "(nearest feasible: 256 or 257)",
        ),
        (("256", 64, 1), "global_batch_size='256' must be a positive integer"),
        ((True, 64, 1), "global_batch_size=True must be a positive integer"),
        ((256, 0, 1), "max_gpu_batch_size=0 must be a positive integer"),
        ((256, 64, 0), "world_size=0 must be a positive integer"),
    ],
)
def test_init_bad_input_is_one_line(args, message):
    with pytest.raises(ValueError) as info:
        compat.init(*args)
    assert isinstance(info.value, ConfigError) and message in str(info.value) and "\n" not in str(info.value)


def test_init_names_the_nearest_feasible_global_batches():
    for world in (2, 3, 4, 8):
        for global_batch in range(1, 50):
            if global_batch % world == 0:
                continue
            multiples = range(world, 100, world)
            expected = [
                m
                for m in (
                    max([m for m in multiples if m < global_batch], default=None),
                    min(m for m in multiples if m > global_batch),
                )
                if m
            ]
            with pytest.raises(ConfigError) as info:
                compat.init(global_batch, 8, world_size=world)
            named = re.search(r"nearest feasible: ([\d or]+)\)$", str(info.value)).group(1)
            assert [int(v) for v in named.split(" or ")] == expected


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module a source file imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                package = path.parent.relative_to(PACKAGE.parent).parts
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            names.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return names


def test_the_core_never_imports_compat():
    core = [f for f in PACKAGE.rglob("*.py") if "compat" not in f.relative_to(PACKAGE).parts]
    assert len(core) > 10
    offenders = {str(f): m for f in core for m in imported_modules(f) if m.startswith("elastic_trainer.compat")}
    assert not offenders


def module_source(name: str) -> Path | None:
    stem = PACKAGE.parent.joinpath(*name.split("."))
    return next((f for f in (stem.with_suffix(".py"), stem / "__init__.py") if f.is_file()), None)


def reachable_imports(module: str) -> set[str]:
    """Every module name imported by `module`, following this project's own modules transitively."""
    names, done, todo = set(), set(), [module]
    while todo:
        name = todo.pop()
        source = module_source(name)
        if name in done or source is None:
            continue
        done.add(name)
        found = imported_modules(source)
        if "." in name:
            found.add(name.rsplit(".", 1)[0])  # importing a submodule runs its package first
        names |= found
        todo.extend(found)
    return names


def test_importing_compat_does_not_import_keras():
    def imports_keras(module: str) -> bool:
        return any(m == "keras" or m.startswith("keras.") for m in reachable_imports(module))

    assert not imports_keras("elastic_trainer.compat")
    assert imports_keras("elastic_trainer.compat.keras")  # the check can fail: this one does import keras
