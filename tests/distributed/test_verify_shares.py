"""Ranks share a checkpoint's checksum verification (each checks every world-th file) and all-gather what
they found: a damaged file is reported on every rank whichever rank's share holds it, for 2 and 4 ranks.

The checkpoint is a real one (gpt-tiny saved by 4 ranks: .metadata, meta.json and four __R_0.distcp files),
saved once; each case is a copy of it (hard links, the damaged file copied) with one file flipped or cut.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, storage
from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.parallel import build_mesh
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Trainer

MODEL = load_model_config("gpt-tiny")
CFG = TrainConfig(global_batch=8, seq_len=32, steps=1, seed=1)
SAVED_BY = Layout(4, 1, 1, 2, 1)


def save_job(rank, world, root: str) -> None:
    tokens = np.arange(4096, dtype=np.int64) % MODEL.vocab_size
    trainer = Trainer(MODEL, CFG, SAVED_BY, build_mesh(SAVED_BY, "cpu"), torch.device("cpu"), tokens=tokens)
    checkpointer = Checkpointer(CheckpointConfig(dir=root))
    checkpointer.save(trainer)
    checkpointer.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    run_ranks(save_job, SAVED_BY.world_size, str(root))
    (folder,) = storage.complete_checkpoints(root)
    return folder


def flip(path: Path) -> str:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return "fails its xxh3_128 checksum (corrupted)"


def cut(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"has {size // 2} bytes, expected {size} (truncated?)"


def damaged_copy(source: Path, case: Path, name: str | None, damage) -> Path:
    """source as case/<its name>, every file hard-linked except `name`, which is copied and damaged;
    returns the one-line error a verification must give (None when nothing is damaged)."""
    folder = case / source.name
    folder.mkdir(parents=True)
    for path in source.iterdir():
        if path.name == name:
            shutil.copyfile(path, folder / name)
        else:
            os.link(path, folder / path.name)
    return f"{folder.name}: file {name} {damage(folder / name)}" if name else None


def verify_job(rank, world, folders: list[str]) -> list[str | None]:
    checkpointer = Checkpointer(CheckpointConfig(dir=str(Path(folders[0]).parent)))
    try:
        return [checkpointer.verify(Path(f)) for f in folders]
    finally:
        checkpointer.close()


def test_saved_checkpoint_has_one_data_file_per_rank(saved):
    """The cases below cover every kind of file: the save wrote one data file per saving rank."""
    names = sorted(p.name for p in saved.iterdir())
    assert names == sorted(
        [".metadata", "manifest.json", "meta.json"] + [f"__{r}_0.distcp" for r in range(SAVED_BY.world_size)]
    )


@pytest.mark.parametrize("world", [2, 4])
def test_damage_in_any_one_file_is_found_by_every_rank(saved, tmp_path, world):
    """Each file of the manifest in turn, flipped in the middle or cut to half: Checkpointer.verify on
    every one of `world` ranks returns the exact one-line reason naming that file; the intact copy passes."""
    files = sorted(p.name for p in saved.iterdir() if p.name != "manifest.json")
    cases = [(None, None)] + [(name, damage) for name in files for damage in (flip, cut)]
    folders, expected = [], []
    for i, (name, damage) in enumerate(cases):
        expected.append(damaged_copy(saved, tmp_path / f"case{i}", name, damage))
        folders.append(str(tmp_path / f"case{i}" / saved.name))
    found = run_ranks(verify_job, world, folders)
    for rank in range(world):
        for (name, damage), want, got in zip(cases, expected, found[rank]):
            assert got == want, f"rank {rank} of {world}, {name} {damage and damage.__name__}"
