"""Resuming checks the checkpoint's trajectory settings against this run's, in one line naming both values."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import pytest

from elastic_trainer.checkpoint import state
from elastic_trainer.config import ConfigError, TrainConfig, load_model_config
from elastic_trainer.plan.layout import Layout

MODEL = load_model_config("gpt-tiny")
CFG = TrainConfig(global_batch=8, seq_len=32, steps=10, seed=3)


def saved_meta(cfg: TrainConfig = CFG, step: int = 4) -> dict:
    """meta.json as a run with `cfg` writes it (through JSON, as it is read back)."""
    trainer = SimpleNamespace(
        cfg=cfg,
        model_cfg=MODEL,
        layout=Layout(2, 1, 1, 4, 1),
        step=step,
        consumed_samples=step * cfg.global_batch,
        samples=range(100),
    )
    return json.loads(json.dumps(state.build_meta(trainer)))


def check(meta: dict, cfg: TrainConfig, model=MODEL) -> None:
    state.check_compatible(meta, model, cfg, "ckpt/step-00000004")


def test_meta_records_the_position_and_the_trajectory():
    meta = saved_meta()
    assert (meta["step"], meta["consumed_samples"]) == (4, 32)
    assert meta["train"]["schedule_steps"] == 10 and meta["train"]["data"] == list(CFG.data)
    assert meta["layout"]["dp"] == 2 and meta["model"]["n_layers"] == MODEL.n_layers
    check(meta, CFG)  # the same settings resume
    check(meta, dataclasses.replace(CFG, steps=50, metrics_file="m.jsonl"))  # so do non-trajectory ones


@pytest.mark.parametrize(
    "change, message",
    [
        ({"global_batch": 16}, "global_batch=16 (checkpoint: 8)"),
        ({"seed": 4, "lr": 1e-3}, "seed=4 (checkpoint: 3), lr=0.001 (checkpoint: 0.0006)"),
        ({"decay_steps": 20}, "decay_steps=20 (checkpoint: 10)"),
    ],
)
def test_other_trajectory_settings_are_refused(change, message):
    with pytest.raises(ConfigError) as err:
        check(saved_meta(), dataclasses.replace(CFG, **change))
    text = str(err.value)
    assert f"ckpt/step-00000004 was trained with other settings: {message}; resuming would change" in text
    assert "\n" not in text


def test_a_different_model_or_format_is_refused():
    with pytest.raises(ConfigError, match=r"holds a different model: n_layers=2 \(checkpoint: 4\)$"):
        check(saved_meta(), CFG, dataclasses.replace(MODEL, n_layers=2))
    with pytest.raises(ConfigError, match=r"checkpoint format 99 is not supported \(valid: 1\)$"):
        check({**saved_meta(), "format": 99}, CFG)


def test_resume_keeps_the_checkpoints_schedule_unless_given():
    meta = saved_meta()
    longer = dataclasses.replace(CFG, steps=40)  # train further: the schedule stays the checkpoint's
    check(meta, longer)
    assert state.resumed_config(meta, longer).schedule_steps == 10
    assert state.resumed_config(meta, dataclasses.replace(longer, decay_steps=10)).schedule_steps == 10


def test_the_same_data_files_named_from_another_folder_resume(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "b.txt").write_text("other text\n")
    monkeypatch.chdir(tmp_path)
    meta = saved_meta(dataclasses.replace(CFG, data=("a.txt",)))  # saved from tmp_path, relative
    check(meta, dataclasses.replace(CFG, data=(str(tmp_path / "a.txt"),)))  # absolute: the same file
    check(meta, dataclasses.replace(CFG, data=(str(tmp_path / "." / "a.txt"),)))
    with pytest.raises(ConfigError, match=r"other settings: data=\[.*b.txt'\] \(checkpoint: \['a.txt'\]\)"):
        check(meta, dataclasses.replace(CFG, data=(str(tmp_path / "b.txt"),)))


# Every TrainConfig field, classified by hand from what it does (a new field fails the test below until it
# is put in one of the three): trajectory settings change the losses a resumed run computes; the others
# change where or how long it runs, how it logs, or are refused elsewhere (skip_bad_records: a corpus cached
# with skipped records is refused without the flag, so it never changes the tokens silently; dtype: resolved
# per device, so a GPU checkpoint can be resumed on CPUs); decay_steps is the schedule length, refused only
# when given and different from the checkpoint's.
TRAJECTORY = (
    "global_batch",
    "seq_len",
    "seed",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "data",
    "val_fraction",
)
# text_field and data_split change the tokens, which the data's content digest (meta "data.id") compares
NOT_TRAJECTORY = {
    "steps": 50,
    "dtype": "fp32",
    "data_cache": "/elsewhere/cache",
    "metrics_file": "m.jsonl",
    "log_every": 5,
    "skip_bad_records": True,
    "text_field": "body",
    "data_split": "other",
    "val_data": ("v.txt",),
    "eval_every": 3,
    "eval_batches": 2,
    "tensorboard": "/tmp/tb",
    "profile_steps": "2:3",
    "compile": True,
    "compile_cache": "/tmp/cc",
}
SCHEDULE = ("decay_steps",)


def test_every_train_setting_is_classified():
    """TRAJECTORY_FIELDS is exactly the hand classification, and the three groups partition TrainConfig."""
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    groups = [*TRAJECTORY, *NOT_TRAJECTORY, *SCHEDULE]
    assert sorted(groups) == sorted(fields) and len(set(groups)) == len(groups)
    assert sorted(state.TRAJECTORY_FIELDS) == sorted(TRAJECTORY)


def other_value(value):
    """A different valid value of the same kind (numbers change by a factor or a step, data another file)."""
    if isinstance(value, tuple):
        return ("other.txt",)
    if isinstance(value, int):
        return value + 1
    return value / 2 if value else 0.1


def as_saved(value):
    """A value as meta.json holds it (tuples become lists)."""
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("field", TRAJECTORY)
def test_each_trajectory_setting_is_refused_alone(field):
    """Changing one trajectory setting refuses the resume with one line naming it, ours and the saved value."""
    old = getattr(CFG, field)
    new = other_value(old)
    assert new != old
    with pytest.raises(ConfigError) as err:
        check(saved_meta(), dataclasses.replace(CFG, **{field: new}))
    assert str(err.value) == (
        f"ckpt/step-00000004 was trained with other settings: {field}={as_saved(new)!r} "
        f"(checkpoint: {as_saved(old)!r}); resuming would change the loss trajectory "
        "(use the checkpoint's values or another --checkpoint-dir)"
    )


@pytest.mark.parametrize("field, value", list(NOT_TRAJECTORY.items()) + [("decay_steps", CFG.schedule_steps)])
def test_each_other_setting_resumes(field, value):
    """Settings outside the trajectory (and decay_steps equal to the saved schedule) do not refuse."""
    assert getattr(CFG, field) != value
    check(saved_meta(), dataclasses.replace(CFG, **{field: value}))


def other_model(field: str):
    """MODEL with `field` changed to the first different value that is still a valid model."""
    old = getattr(MODEL, field)
    candidates = [old + 1, old * 2] if isinstance(old, int) else [old / 2 if old else 0.1]
    for new in candidates:
        try:
            return dataclasses.replace(MODEL, **{field: new}), new
        except ConfigError:
            continue
    raise AssertionError(f"no other valid {field}")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(MODEL) if f.name != "name"])
def test_each_model_setting_is_refused_alone(field):
    """Every model setting but its name must match the checkpoint's: one line naming it and both values."""
    model, new = other_model(field)
    with pytest.raises(ConfigError) as err:
        check(saved_meta(), CFG, model)
    assert str(err.value) == (
        f"ckpt/step-00000004 holds a different model: {field}={new!r} (checkpoint: {getattr(MODEL, field)!r})"
    )


def test_a_renamed_model_resumes():
    """The preset's name is a label: the same shapes under another name resume."""
    check(saved_meta(), CFG, dataclasses.replace(MODEL, name="renamed"))


def test_two_different_model_settings_are_named_in_one_line():
    """Every differing model setting, in the config's field order, separated by ', '."""
    model = dataclasses.replace(MODEL, n_layers=2, dropout=0.1)
    with pytest.raises(ConfigError) as err:
        check(saved_meta(), CFG, model)
    assert str(err.value) == (
        "ckpt/step-00000004 holds a different model: n_layers=2 (checkpoint: 4), dropout=0.1 (checkpoint: 0.0)"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 4}, "seed=4 (checkpoint: 3)"),
        ({"decay_steps": 20}, "decay_steps=20 (checkpoint: 10)"),
    ],
)
def test_the_same_data_files_from_another_folder_do_not_hide_other_changes(tmp_path, monkeypatch, change, message):
    """The data setting is dropped from the differences when it names the same files; the others remain."""
    (tmp_path / "a.txt").write_text("some text\n")
    monkeypatch.chdir(tmp_path)
    meta = saved_meta(dataclasses.replace(CFG, data=("a.txt",)))
    with pytest.raises(ConfigError) as err:
        check(meta, dataclasses.replace(CFG, data=(str(tmp_path / "a.txt"),), **change))
    assert str(err.value) == (
        f"ckpt/step-00000004 was trained with other settings: {message}; resuming would "
        "change the loss trajectory (use the checkpoint's values or another --checkpoint-dir)"
    )


def tiny_trainer(seed: int) -> SimpleNamespace:
    """What apply_tensor_state and tensor_state use of a Trainer: engine.model (not zero1) and its AdamW optimizer."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return SimpleNamespace(
        engine=SimpleNamespace(model=model, zero=None),
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01),
    )


def test_tensor_state_round_trips_weights_and_optimizer_moments_exactly():
    """The state taken from a trained model and applied to a fresh one (other weights, no optimizer state)
    gives it the same weights, AdamW moments and step counts."""
    import copy

    import torch

    trained = tiny_trainer(0)
    for _ in range(2):
        trained.engine.model(torch.randn(5, 3)).square().sum().backward()
        trained.optimizer.step()
    fresh = tiny_trainer(1)
    state.apply_tensor_state(fresh, copy.deepcopy(state.tensor_state(trained)))
    ours, theirs = trained.engine.model.state_dict(), fresh.engine.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    saved, loaded = trained.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1, 2, 3}
    for i in saved:
        assert saved[i].keys() == loaded[i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(saved[i][k], loaded[i][k]) for k in saved[i]) and float(loaded[i]["step"]) == 2


def test_meta_records_the_data_rng_time_and_versions(tmp_path, monkeypatch):
    import platform
    import time

    import torch

    from elastic_trainer import __version__

    (tmp_path / "a.txt").write_text("some text\n")
    monkeypatch.chdir(tmp_path)
    cfg = dataclasses.replace(CFG, data=("a.txt",), seed=11)
    before = time.time()
    meta = saved_meta(cfg)
    after = time.time()
    digest = hashlib.sha256(str((tmp_path / "a.txt").resolve()).encode()).hexdigest()[:20]
    assert meta["data"] == {"num_samples": 100, "seq_len": 32, "files_id": digest, "id": None}
    assert meta["rng"] == {"scheme": "reseed every step from (seed, step, stage, dp rank)", "seed": 11}
    assert before <= meta["time"] <= after
    saved = time.mktime(time.strptime(meta["saved_at"], "%Y-%m-%d %H:%M:%S %z"))
    assert abs(saved - meta["time"]) < 2
    assert meta["versions"] == {
        "elastic_trainer": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert meta["world_size"] == 2 and meta["format"] == state.FORMAT
    assert meta["train"] == {**dataclasses.asdict(cfg), "data": ["a.txt"], "val_data": [], "schedule_steps": 10}
    assert meta["model"] == dataclasses.asdict(MODEL)


def test_data_files_id_is_none_when_the_files_are_gone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.txt").write_text("y\n")
    both = state.data_files_id(dataclasses.replace(CFG, data=("a.txt", "b.txt")))
    joined = "\0".join(str((tmp_path / n).resolve()) for n in ("a.txt", "b.txt"))
    assert both == hashlib.sha256(joined.encode()).hexdigest()[:20]
    assert state.data_files_id(dataclasses.replace(CFG, data=("missing.txt",))) is None


def test_the_data_is_compared_by_content_when_both_digests_are_known():
    """A checkpoint of data with content digest X: the same digest under another path resumes, another digest
    under the same path is refused, a held-out fraction that differs is named as the setting it is."""
    meta = saved_meta(dataclasses.replace(CFG, data=("/old/place/ds",)))
    meta["data"]["id"] = "a" * 32
    moved = dataclasses.replace(CFG, data=("/new/place/ds",))
    state.check_compatible(meta, MODEL, moved, "ck", data_id="a" * 32)
    with pytest.raises(
        ConfigError,
        match=r"^ck was trained on other data: the content digest of --data "
        r"/old/place/ds is bbbbbbbbbbbb, the checkpoint's aaaaaaaaaaaa; ",
    ):
        state.check_compatible(meta, MODEL, dataclasses.replace(CFG, data=("/old/place/ds",)), "ck", "b" * 32)
    with pytest.raises(ConfigError, match=r"other settings: val_fraction=0\.1 \(checkpoint: 0\.0\)"):
        state.check_compatible(meta, MODEL, dataclasses.replace(moved, val_fraction=0.1), "ck", "a" * 32 + ":val0.1")
    with pytest.raises(ConfigError, match="other settings: data="):  # without a digest: by path, as before
        state.check_compatible(meta, MODEL, moved, "ck")
