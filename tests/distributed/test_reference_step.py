"""The trainer's step against an independent reference: Hugging Face `GPT2LMHeadModel` holding the trainer's
initial weights, trained by plain PyTorch written here from the documented recipe: mean cross-entropy over
every token of the global batch, `torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW` (weight decay on
tensors of two or more dimensions only), and the learning rate computed by hand (linear warm-up from
lr/warmup, then a cosine from lr to lr * min_lr_ratio over the schedule's remaining steps).

The single-process trainer (one micro-batch, and four with gradient accumulation) must match it at every step:
loss, gradient norm (before clipping), learning rate, and the parameters after the last step. The layout
invariance tests compare other layouts with this single-process run, so through this test they compare with
a reference that is itself checked.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.data.order import samples_for
from elastic_trainer.model.hf import config_to_hf, state_dict_to_hf
from elastic_trainer.parallel import build_mesh
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Trainer

transformers = pytest.importorskip("transformers")
MODEL = load_model_config("gpt-tiny")
STEPS = 6
CFG = TrainConfig(
    global_batch=8,
    seq_len=32,
    steps=STEPS,
    seed=11,
    lr=2e-3,
    warmup_steps=2,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    grad_clip=1.0,
)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()


def trainer_run(rank: int, world: int, layout: Layout, cfg: TrainConfig, tokens) -> dict:
    trainer = Trainer(MODEL, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    initial = {n: full(p) for n, p in trainer.engine.model.named_parameters()}
    records, batches = [], []
    for step in range(cfg.steps):
        batches.append(trainer.samples.batch(samples_for(step, cfg.global_batch, 0, 1))[1])
        records.append(trainer.train_step())
    final = {n: full(p) for n, p in trainer.engine.model.named_parameters()}
    return {"initial": initial, "final": final, "records": records, "batches": batches}


def lr_by_hand(step: int, cfg: TrainConfig) -> float:
    """The documented schedule for the update of 0-based step `step` (README, train/optim.py)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * (1 + math.cos(math.pi * progress)) / 2


def reference_run(initial: dict, batches: list[torch.Tensor], cfg: TrainConfig) -> dict:
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in config_to_hf(MODEL).items() if k != "architectures"})
    model = transformers.GPT2LMHeadModel(hf_cfg)
    missing, unexpected = model.load_state_dict(state_dict_to_hf(initial, MODEL), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    model.tie_weights()
    model.train()
    params = list(model.parameters())  # the tied head is wte: listed once
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    losses, norms, lrs = [], [], []
    for step, batch in enumerate(batches):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))  # mean over all tokens
        optimizer.zero_grad()
        loss.backward()
        # the norm in float64: torch's fp32 norm kernel on CPU sums a 3.2M-element embedding gradient
        # naively (measured: 4e-5 relative error by step 2), which the trainer's norm avoids
        norm = torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        lr = lr_by_hand(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(loss.item())
        norms.append(norm.item())
        lrs.append(lr)
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"},
    }


@pytest.mark.parametrize(
    "micro_batch, clip", [(8, 1.0), (2, 1.0), (8, 0.0)], ids=["one-micro-batch", "four-micro-batches", "no-clipping"]
)
def test_single_process_step_matches_a_plain_pytorch_gpt2_step(micro_batch, clip, sotu_tokens):
    cfg = dataclasses.replace(CFG, grad_clip=clip)
    ours = run_ranks(trainer_run, 1, Layout(1, 1, 1, micro_batch, CFG.global_batch // micro_batch), cfg, sotu_tokens)[0]
    ref = reference_run(ours["initial"], ours["batches"], cfg)
    records = ours["records"]

    assert abs(records[0]["loss"] - math.log(MODEL.vocab_size)) < 0.1  # an untrained model guesses uniformly
    assert [r["lr"] for r in records] == pytest.approx(ref["lrs"], rel=1e-12)
    assert [r["loss"] for r in records] == pytest.approx(ref["losses"], rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref["norms"], rel=1e-5)
    if clip:
        assert max(ref["norms"]) > clip  # clipping did act
    # parameters after the last step, in HF's names and shapes
    final = state_dict_to_hf(ours["final"], MODEL)
    assert set(final) == set(ref["final"])
    diff = torch.cat([(final[k] - ref["final"][k]).flatten() for k in final]).norm()
    whole = torch.cat([ref["final"][k].flatten() for k in final]).norm()
    assert diff / whole <= 1e-5
    moved = torch.cat([(ref["final"][k] - state_dict_to_hf(ours["initial"], MODEL)[k]).flatten() for k in final]).norm()
    assert diff / moved <= 1e-3  # the match is in how the weights moved, not only in where they started
