"""The hand-over's file format in one process: DCP's own files against `checkpoint/raw.py`'s, and the floor.

    .venv/bin/python benchmarks/rescale/file_format.py            # ~20 s on the 2-core machine

A state shaped like one gpt3-small rank's share (12 blocks' weights and two AdamW moments, plus an embedding;
291 fp32 tensors, 0.74 GB) written into a fresh folder under /dev/shm and read back into allocated tensors:
- write: `dcp.save` with FileSystemWriter (each tensor framed by torch.save), with `raw.Writer` (each piece's
  bytes), and the floor: every tensor's bytes written to one file with `os.write`;
- read: `dcp.load` with FileSystemReader (torch.load per tensor, then a copy) and with `raw.Reader` (a copy
  out of the mapped file); every read is checked equal to the state.
Best of 3 each; one thread, no process group.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elastic_trainer.checkpoint import raw  # noqa: E402


def rank_state() -> dict[str, torch.Tensor]:
    g, state = torch.Generator().manual_seed(0), {}
    shapes = [
        ("qkv", (1152, 768)),
        ("proj", (384, 768)),
        ("fc", (1536, 768)),
        ("fc2", (384, 3072)),
        ("ln1", (768,)),
        ("ln2", (768,)),
        ("b1", (1536,)),
        ("b2", (384,)),
    ]
    for i in range(12):
        for name, shape in shapes:
            for kind in ("w", "m", "v"):
                state[f"{i}.{name}.{kind}"] = torch.randn(shape, generator=g)
    for kind in ("w", "m", "v"):
        state[f"emb.{kind}"] = torch.randn(25000, 768, generator=g)
    return state


def best(fn, setup=lambda: None, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    warnings.simplefilter("ignore")  # DCP's "no process group: one process" warnings
    state = rank_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="file-format-", dir="/dev/shm"))
    folders = {"dcp": root / "dcp", "raw": root / "raw"}
    writers = {
        "dcp": lambda: FileSystemWriter(str(folders["dcp"]), sync_files=False),
        "raw": lambda: raw.Writer(folders["raw"]),
    }
    readers = {"dcp": FileSystemReader, "raw": raw.Reader}

    def fresh(path: Path):
        return lambda: (shutil.rmtree(path, ignore_errors=True), path.mkdir())

    def floor() -> None:
        with open(root / "floor" / "bytes", "wb", buffering=0) as f:
            for t in state.values():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    def row(what: str, seconds: float) -> None:
        print(f"{what:34s} {seconds:6.3f} s  {nbytes / seconds / 1e9:5.2f} GB/s", flush=True)

    ok = True
    try:
        print(
            f"[file-format] {len(state)} tensors, {nbytes / 1e9:.2f} GB, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs"
        )
        for name in ("dcp", "raw"):
            row(
                f"write {name}",
                best(lambda: dcp.save(state, storage_writer=writers[name](), no_dist=True), fresh(folders[name])),
            )
        row("write floor (os.write, one file)", best(floor, fresh(root / "floor")))
        for name in ("dcp", "raw"):
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            row(
                f"read {name}",
                best(lambda: dcp.load(target, storage_reader=readers[name](str(folders[name])), no_dist=True)),
            )
            ok = ok and all(torch.equal(target[k], v) for k, v in state.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("every read equal to the state" if ok else "A READ DIFFERS FROM THE STATE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
