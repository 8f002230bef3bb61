"""Checkpoints reshard on load into any layout and resume exactly.

One chain of runs: each trains 3 steps in its layout, saves, and the next run (another layout, another world size)
loads that checkpoint. Every link checks that the gathered weights and AdamW moments (and step counts) after loading
equal, bitwise, what was saved; all per-step losses of the chain, and the validation loss at the end of every link,
must be within 1e-5 relative of one uninterrupted single-process run. The 6 links change every dimension up and down
(to degrees of 2 and 4), the micro-batch split, and the data-parallel mode each way between sharded (FSDP2),
replicated and ZeRO-1 (all six changes, one per link).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from elastic_trainer.checkpoint import CheckpointConfig
from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.parallel import build_mesh
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job, Trainer

MODEL = load_model_config("gpt-tiny")
STEPS_PER_RUN = 3
CHAIN = [  # dp, tp, pp, micro_batch, dp_mode: six links, the six changes of dp mode once each
    (1, 1, 1, 8, "fsdp"),
    (2, 2, 2, 2, "ddp"),  # every dimension up; sharded -> replicated
    (1, 1, 1, 4, "zero1"),  # every dimension down, another micro-batch split; replicated -> ZeRO-1
    (1, 4, 1, 8, "fsdp"),  # tp up to 4; ZeRO-1 -> sharded
    (2, 2, 2, 2, "zero1"),  # dp and pp up, tp down; sharded -> ZeRO-1 with tp-sharded rows
    (1, 1, 4, 2, "ddp"),  # pp up to 4, dp and tp down; ZeRO-1 -> replicated
    (4, 1, 1, 2, "fsdp"),  # dp up to 4, pp down; replicated -> sharded
]


def config(steps: int, **kw) -> TrainConfig:
    return TrainConfig(
        global_batch=8,
        seq_len=32,
        steps=steps,
        decay_steps=len(CHAIN) * STEPS_PER_RUN,
        seed=0,
        lr=1e-3,
        warmup_steps=2,
        eval_batches=1,
        **kw,
    )


def validation(tokens) -> np.ndarray:
    """One validation batch: the corpus' last 8 samples of 32 + 1 tokens, in order."""
    return np.asarray(tokens[-(8 * 32 + 1) :], dtype=np.uint16)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor of this rank's stage, gathered to full global tensors."""
    out, zero = {}, trainer.engine.zero
    for i, (name, p) in enumerate(trainer.engine.model.named_parameters()):
        out[f"param/{name}"] = _full(p)
        trained = zero.masters[i] if zero else p
        for key, value in trainer.optimizer.state.get(trained, {}).items():
            if zero and value.ndim:  # this rank's rows of the moment, as the checkpoint sees them
                value = zero.dtensor(zero.slots[i], value)
            out[f"{key}/{name}"] = _full(value)
    return out


def chain_job(rank, world, layout: Layout, ckpt_dir: str, until: int, tokens, val_tokens=None) -> dict:
    with Job(
        MODEL,
        config(until),
        layout,
        torch.device("cpu"),
        ckpt=CheckpointConfig(dir=ckpt_dir),
        tokens=tokens,
        val_tokens=val_tokens,
    ) as job:
        trainer = job.trainer
        loaded = full_state(trainer) if job.loaded else None
        losses, ids = [], []
        while trainer.step < until:
            losses.append(trainer.train_step()["loss"])
            ids.append(trainer.last_sample_ids.tolist())
        val = trainer.evaluate() if val_tokens is not None else None
        saved = full_state(trainer)
        job.checkpointer.save(trainer)
    c = trainer.engine.coords
    return {
        "loaded": loaded,
        "saved": saved,
        "losses": losses,
        "ids": ids,
        "reader": c.pp == 0 and c.tp == 0,
        "val": val,
    }


def merge(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in (r[key] or {}).items():
            if name in merged:
                assert torch.equal(merged[name], value), f"copies of {name} differ between ranks"
            merged[name] = value
    return merged


def uninterrupted_losses(tokens, steps: int) -> tuple[list[float], list[float]]:
    """(the loss of every step, the validation loss after every STEPS_PER_RUN-th)."""

    def job(rank, world):
        layout = Layout(1, 1, 1, 8, 1)
        trainer = Trainer(
            MODEL,
            config(steps),
            layout,
            build_mesh(layout, "cpu"),
            torch.device("cpu"),
            tokens=tokens,
            val_tokens=validation(tokens),
        )
        losses, val = [], []
        for _ in range(steps):
            losses.append(trainer.train_step()["loss"])
            if trainer.step % STEPS_PER_RUN == 0:
                val.append(trainer.evaluate())
        return losses, val

    return run_ranks(job, 1)[0]


@pytest.mark.slow
def test_reshard_chain_is_exact_and_continues_the_trajectory(tmp_path, sotu_tokens):
    total = len(CHAIN) * STEPS_PER_RUN
    reference, reference_val = uninterrupted_losses(sotu_tokens, total)
    losses, val, previous = [], [], None
    for i, (dp, tp, pp, micro, mode) in enumerate(CHAIN):
        layout = Layout(dp, tp, pp, micro, 8 // (dp * micro), dp_mode=mode)
        results = run_ranks(
            chain_job,
            layout.world_size,
            layout,
            str(tmp_path),
            (i + 1) * STEPS_PER_RUN,
            sotu_tokens,
            validation(sotu_tokens),
        )
        assert len({r["val"] for r in results}) == 1, f"link {i}: ranks differ in the validation loss"
        val.append(results[0]["val"])
        loaded = merge(results, "loaded")
        if previous is not None:
            assert set(loaded) == set(previous), set(loaded) ^ set(previous)
            for name, value in previous.items():
                assert torch.equal(loaded[name], value), f"link {i}: {name} changed through save/load"
        previous = merge(results, "saved")
        losses += results[0]["losses"]
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) / b <= 1e-5, f"step {step + 1}: {a} vs uninterrupted {b}"
    assert len(val) == len(reference_val) == len(CHAIN)
    for i, (a, b) in enumerate(zip(val, reference_val)):
        assert abs(a - b) / b <= 1e-5, f"validation loss after step {(i + 1) * STEPS_PER_RUN}: {a} vs uninterrupted {b}"


def test_exactly_once_data_across_reshards(tmp_path, sotu_tokens):
    """dp 4 -> 1 -> 2 on a 40-sample corpus (an epoch is 5 steps): every sample once per epoch."""
    tokens = np.asarray(sotu_tokens[: 40 * 32 + 1])
    consumed: list[int] = []
    for until, (dp, micro) in zip((4, 7, 12), ((4, 2), (1, 4), (2, 1))):
        layout = Layout(dp, 1, 1, micro, 8 // (dp * micro))
        results = run_ranks(chain_job, dp, layout, str(tmp_path), until, tokens)
        for s in range(len(results[0]["ids"])):
            consumed += [i for r in results if r["reader"] for i in r["ids"][s]]
    assert len(consumed) == 12 * 8
    epochs = [consumed[e * 40 : (e + 1) * 40] for e in range(len(consumed) // 40)]
    assert all(sorted(epoch) == list(range(40)) for epoch in epochs)  # each epoch is a permutation
    assert len(set(consumed[80:])) == len(consumed[80:])  # and the partial third epoch has no repeats
    assert epochs[0] != epochs[1]  # a new order every epoch
