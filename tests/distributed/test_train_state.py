"""checkpoint/train_state.py: a whole train state saved without a Trainer or a process group is the checkpoint a
one-rank Trainer holding the same values saves with Checkpointer.save (its module docstring's promise), and a
run resumes it in another layout with those values; states that are not our GPT's are refused in one line.

The reference is the Checkpointer itself, on one forked gloo rank: a Trainer whose weights, AdamW moments and
step counts are set to known random values, then saved. The same values go through save_train_state here, in
this process, with no process group; the two folders are then compared entry by entry.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, storage
from elastic_trainer.checkpoint.state import init_optimizer_state
from elastic_trainer.checkpoint.train_state import ParamTrainState, TrainState, save_train_state, tensor_state_of
from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.data import TokenSamples
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train.loop import Trainer

MODEL = ModelConfig(n_layers=2, d_model=8, n_heads=2, vocab_size=16, context_length=8, name="micro")
CFG = TrainConfig(
    global_batch=4,
    seq_len=8,
    steps=9,
    seed=3,
    lr=2e-3,
    warmup_steps=2,
    weight_decay=0.05,
    beta1=0.8,
    beta2=0.97,
    eps=1e-7,
    data=("no-such-corpus.txt",),
)
TOKENS = np.random.default_rng(1).integers(0, MODEL.vocab_size, 40 * CFG.seq_len + 1).astype(np.uint16)
STEP = 5


def values(names_shapes: dict[str, tuple[int, ...]]) -> dict[str, ParamTrainState]:
    """Random weights and moments, a different Adam step count per parameter (known, not zero)."""
    g = torch.Generator().manual_seed(11)
    return {
        n: ParamTrainState(
            torch.randn(s, generator=g), torch.randn(s, generator=g), torch.rand(s, generator=g), step=float(STEP + i)
        )
        for i, (n, s) in enumerate(names_shapes.items())
    }


def _trainer_save(rank: int, world: int, root: str) -> dict:
    """The reference: a one-rank Trainer given `values`, saved by the Checkpointer."""
    layout = Layout(1, 1, 1, CFG.global_batch, 1)
    trainer = Trainer(
        MODEL, CFG, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=TOKENS, initialize=False
    )
    init_optimizer_state(trainer.optimizer)
    given = values({n: tuple(p.shape) for n, p in trainer.engine.model.named_parameters()})
    with torch.no_grad():
        for name, param in trainer.engine.model.named_parameters():
            state = trainer.optimizer.state[param]
            param.copy_(given[name].weight)
            state["exp_avg"].copy_(given[name].exp_avg)
            state["exp_avg_sq"].copy_(given[name].exp_avg_sq)
            state["step"].fill_(given[name].step)
    trainer.restore(STEP, CFG)
    checkpointer = Checkpointer(CheckpointConfig(dir=root, resume="never", keep=0), log=lambda *a, **k: None)
    try:
        return {"path": checkpointer.save(trainer, blocking=True).path, "given": given}
    finally:
        checkpointer.close()


def describe(folder: Path) -> tuple[list, dict, dict, list]:
    """(metadata entries in order, every saved value, meta.json less its times, the manifest's file names)."""
    md = storage.read_dcp_metadata(folder / ".metadata")
    entries, state = [], {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            entries.append(
                (
                    key,
                    tuple(item.size),
                    item.properties.dtype,
                    [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks],
                )
            )
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            entries.append((key, "bytes"))
            state[key] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=storage.SafeReader(str(folder)), planner=storage.SafeLoadPlanner(), no_dist=True)
    meta = storage.read_meta(folder)
    for key in ("time", "saved_at"):
        meta.pop(key)
    return entries, state, meta, sorted(storage.read_manifest(folder))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, ParamTrainState]]:
    root = tmp_path_factory.mktemp("trainer")
    out = run_ranks(_trainer_save, 1, str(root))[0]
    return Path(out["path"]), out["given"]


def whole(params: dict[str, ParamTrainState], cfg: TrainConfig = CFG, step: int = STEP) -> TrainState:
    return TrainState(MODEL, cfg, step, params, num_samples=len(TokenSamples(TOKENS, cfg.seq_len, cfg.seed)))


def test_the_saved_state_is_the_checkpoint_a_one_rank_trainer_saves(reference, tmp_path):
    folder_ref, given = reference
    folder = save_train_state(tmp_path / "ours", whole(given))
    assert folder == tmp_path / "ours" / "step-00000005" and folder.name == folder_ref.name
    assert (tmp_path / "ours" / "latest").read_text() == "step-00000005\n"
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["latest", "step-00000005"]  # no temporary
    storage.verify(folder)
    entries, state, meta, files = describe(folder)
    entries_ref, state_ref, meta_ref, files_ref = describe(folder_ref)
    assert entries == entries_ref  # the same keys, shapes, dtypes and chunks, in the same order
    assert any(key.startswith("optim.param_groups.") for key, *_ in entries)
    for key, value in state_ref.items():
        if torch.is_tensor(value):
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
        else:
            assert type(state[key]) is type(value) and state[key] == value, key
    assert meta == meta_ref and files == files_ref
    assert (meta["step"], meta["consumed_samples"], meta["layout"]["dp"], meta["world_size"]) == (5, 20, 1, 1)


def test_the_weight_decay_groups_and_settings_follow_the_config(reference):
    _, given = reference
    optim = tensor_state_of(whole(given, dataclasses.replace(CFG, weight_decay=0.3, lr=0.5)))["optim"]
    assert optim["param_groups.layers.0.mlp.fc.weight.weight_decay"] == 0.3
    assert optim["param_groups.tok_emb.weight.weight_decay"] == 0.3
    assert optim["param_groups.layers.0.mlp.fc.bias.weight_decay"] == 0.0
    assert optim["param_groups.ln_f.weight.weight_decay"] == 0.0
    assert optim["param_groups.ln_f.weight.betas"] == (0.8, 0.97) and optim["param_groups.ln_f.weight.lr"] == 0.5
    assert optim["state.ln_f.bias.step"].dtype == torch.float32
    assert float(optim["state.tok_emb.weight.step"]) == STEP


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


def test_what_is_not_our_gpt_s_state_is_refused_in_one_line_and_nothing_is_written(reference, tmp_path):
    _, given = reference
    cases = [
        ({k: v for k, v in given.items() if k != "ln_f.bias"}, r"it lacks 'ln_f.bias' \(1 missing, 0 extra\)"),
        ({**given, "head.weight": given["ln_f.bias"]}, r"it has 'head.weight', which the GPT lacks"),
        (
            {**given, "ln_f.bias": dataclasses.replace(given["ln_f.bias"], exp_avg=torch.zeros(9))},
            r"exp_avg of 'ln_f.bias' is \(9,\), but the GPT's parameter is \(8,\)",
        ),
    ]
    for params, message in cases:
        with pytest.raises(ConfigError, match=message):
            save_train_state(tmp_path / "bad", whole(params))
    with pytest.raises(ConfigError, match="step must be 0 or more, not -1"):
        save_train_state(tmp_path / "bad", whole(given, step=-1))
    with pytest.raises(ConfigError, match="seq_len=16 exceeds the model's context_length=8"):
        save_train_state(tmp_path / "bad", whole(given, dataclasses.replace(CFG, seq_len=16)))
    assert not (tmp_path / "bad").exists()
    save_train_state(tmp_path / "once", whole(given))
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(step-00000005, ...\)"):
        save_train_state(tmp_path / "once", whole(given, step=6))
    assert [p.name for p in storage.complete_checkpoints(tmp_path / "once")] == ["step-00000005"]
    assert json.loads((tmp_path / "once" / "step-00000005" / "meta.json").read_text())["step"] == STEP
