"""Read a checkpoint without a training job: `checkpoint inspect` and `checkpoint export-hf`.

Both work from the files alone (meta.json, manifest.json and DCP's .metadata read through the allowlisted
unpickler) on one process, whatever layout saved the checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from elastic_trainer.checkpoint import storage
from elastic_trainer.config import ModelConfig


def resolve(path: str | Path) -> tuple[Path, list[Path]]:
    """(the checkpoint folder to read, all complete checkpoints) for a checkpoint folder or a root."""
    path = Path(path)
    if not path.exists():
        raise storage.CheckpointError(
            f"{str(path)!r} does not exist (valid: a checkpoint folder or a checkpoint "
            "root such as runs/default/checkpoints)"
        )
    if not path.is_dir():
        raise storage.CheckpointError(f"{str(path)!r} is a file, not a checkpoint folder or root")
    if (path / storage.META).exists():
        storage.read_meta(path)
        return path, [path]
    found = storage.complete_checkpoints(path)
    if not found:
        raise storage.CheckpointError(f"{str(path)!r} holds no complete checkpoint")
    return found[0], found


def summarize(folder: Path, verify: bool = True) -> dict:
    meta = storage.read_meta(folder)
    metadata = storage.read_dcp_metadata(folder / ".metadata")
    groups: dict[str, dict] = {}
    for key, md in metadata.state_dict_metadata.items():
        group = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "elements": 0, "bytes": 0, "other": 0})
        if isinstance(md, BytesStorageMetadata):
            group["other"] += 1
            continue
        n = md.size.numel()
        group["tensors"] += 1
        group["elements"] += n
        group["bytes"] += n * torch.empty((), dtype=md.properties.dtype).element_size()
    files = storage.read_manifest(folder)
    integrity = "not checked"
    if verify:
        try:
            storage.verify(folder)
            integrity = f"ok ({len(files)} files, {storage.HASH} checksums match)"
        except storage.CheckpointError as e:
            integrity = f"FAILED: {e}"
    return {
        "path": str(folder),
        "step": meta["step"],
        "consumed_samples": meta.get("consumed_samples", 0),
        "saved_at": meta.get("saved_at"),
        "layout": meta["layout"],
        "world_size": meta.get("world_size"),
        "model": meta["model"],
        "train": meta["train"],
        "versions": meta.get("versions", {}),
        "state": groups,
        "files": len(files),
        "file_bytes": sum(f["bytes"] for f in files.values()),
        "integrity": integrity,
    }


def format_summary(s: dict, others: list[Path]) -> str:
    m, t, lay = s["model"], s["train"], s["layout"]
    params = ModelConfig(**m).num_params()
    lines = [
        f"checkpoint   {s['path']}",
        f"step         {s['step']} ({s['consumed_samples']:,} samples consumed; saved {s['saved_at']})",
        f"layout       dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} micro_batch={lay['micro_batch']} "
        f"num_microbatches={lay['num_microbatches']} ({lay['dp_mode']}), {s['world_size']} ranks",
        f"model        {m['name']}: {m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, "
        f"vocab {m['vocab_size']}, context {m['context_length']} ({params / 1e6:.1f} M parameters)",
        f"training     global batch {t['global_batch']} x {t['seq_len']} tokens, seed {t['seed']}, lr {t['lr']}, "
        f"schedule {t['schedule_steps']} steps, data {', '.join(t['data'])}",
    ]
    for name, g in sorted(s["state"].items()):
        lines.append(
            f"{name:<12} {g['tensors']} tensors, {g['elements']:,} elements, "
            f"{g['bytes'] / 1e9:.3f} GB" + (f", {g['other']} other values" if g["other"] else "")
        )
    lines.append(f"files        {s['files']} files, {s['file_bytes'] / 1e9:.3f} GB")
    lines.append(f"integrity    {s['integrity']}")
    lines.append("versions     " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    if len(others) > 1:
        lines.append("complete     " + ", ".join(p.name for p in others))
    return "\n".join(lines)


def load_model_weights(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The full (unsharded) model weights of a checkpoint, on CPU, in one process."""
    from elastic_trainer.model import GPT

    storage.verify(folder)
    cfg = ModelConfig(**storage.read_meta(folder)["model"])
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in GPT(cfg).state_dict().items()}
    state = {"model": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=storage.SafeReader(str(folder)), planner=storage.SafeLoadPlanner(), no_dist=True)
    return cfg, state["model"]


def export_hf(source: str | Path, out: str | Path) -> Path:
    """Write a Hugging Face GPT-2 folder (config.json + model.safetensors) from a checkpoint."""
    from elastic_trainer.model.hf import save_hf_folder

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise storage.CheckpointError(
            f"output {str(out)!r} is {'a file' if not out.is_dir() else 'a folder that is not empty'}"
            " (valid: a new or empty folder)"
        )
    from elastic_trainer.preflight import check_dir_target

    check_dir_target(out, "output")
    folder, _ = resolve(source)
    cfg, weights = load_model_weights(folder)
    return save_hf_folder(out, cfg, weights)
