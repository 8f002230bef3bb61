"""A train state saved without a Trainer resumes in another layout on forked ranks with its values."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer
from elastic_trainer.checkpoint.train_state import save_train_state
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import Trainer
from tests.unit.test_train_state import (
    CFG,
    MODEL,
    STEP,
    TOKENS,
    reference,  # noqa: F401  (fixtures)
    whole,
)


def _resume(rank: int, world: int, folder: str) -> dict:
    layout = Layout(2, 1, 1, 1, 2, dp_mode="zero1")
    trainer = Trainer(
        MODEL, CFG, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=TOKENS, initialize=False
    )
    checkpointer = Checkpointer(CheckpointConfig(dir=str(Path(folder).parent)), log=lambda *a, **k: None)
    try:
        stats = checkpointer.load_first(trainer, [Path(folder)], strict=True)
    finally:
        checkpointer.close()
    return {
        "step": stats.step,
        "trainer_step": trainer.step,
        "weights": {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()},
    }


def test_a_run_in_another_layout_resumes_it_with_its_values(reference, tmp_path):
    _, given = reference
    folder = save_train_state(tmp_path / "ours", whole(given))
    for got in run_ranks(_resume, 2, str(folder)):
        assert (got["step"], got["trainer_step"]) == (STEP, STEP)
        for name, weight in got["weights"].items():
            assert torch.equal(weight, given[name].weight), name
