"""The hand-over's path through host memory on one GPU: a GPU training state written as DCP files into /dev/shm
and read back onto the GPU, the way `checkpoint/memory.py` does it, beside variants of it and the copy floor.

    python benchmarks/rescale/gpu_memory_path.py --out results.json      # on a CUDA machine (about a minute)

The state: the parameters of a GPT-3 XL cut to `--layers` blocks (width 2048, vocabulary 50257), as fp32
weights and two AdamW moments, on the GPU (6 blocks: 4.9 GB). Each case writes to a fresh folder under
/dev/shm, reads it back and removes it before the next case; every read is checked against the written state
(per tensor, a float64 sum).
- write `dcp`: `dcp.save` with FileSystemWriter as memory.py calls it (one thread, GPU tensors: DCP copies
  each to the CPU, then `torch.save`s it into the file); `dcp-threads-N`: the same with N threads and files;
  `staged`: first every tensor copied to pinned host memory in one pass of asynchronous copies
  (`checkpoint/staging.py`, what memory.py now does with a GPU state), then `dcp.save` of the host tensors (N
  threads). The figures in benchmarks/gpu/results/ were taken before memory.py had it, with this file's own
  copy (`to_pinned`: the same empty pinned tensors and non-blocking copies);
  `raw`: staged, then written by `checkpoint/raw.py`'s writer (each piece as its bytes, N threads and files:
  what memory.py does since it has it);
- read `dcp`: `dcp.load` of the one-file state into the GPU tensors (DCP's reader: one thread); `dcp-threads`:
  of the N-file state; `staged`: into pinned host tensors, then one pass of asynchronous copies to the GPU;
  `raw`: `raw.Reader` from the mapped files straight into the GPU tensors (what memory.py does), and the same
  into pinned host tensors first;
- floor: the same bytes GPU -> pinned host and back (`copy`).
On a machine without CUDA it says so and exits 2: the figures are a GPU's or nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from elastic_trainer.checkpoint import raw, staging  # noqa: E402
from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.model.gpt import GPT  # noqa: E402

DEV = "cuda"  # `--cpu-check`: "cpu", to try the program's logic on a machine without a GPU (no figures)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def gpu_state(layers: int) -> dict[str, torch.Tensor]:
    cfg = dataclasses.replace(load_model_config("gpt3-xl"), n_layers=layers)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPT(cfg).named_parameters()}
    state, g = {}, torch.Generator(device=DEV).manual_seed(0)
    for kind in ("model", "exp_avg", "exp_avg_sq"):
        for n, shape in shapes.items():
            state[f"{kind}.{n}"] = torch.rand(shape, device=DEV, generator=g)
    sync()
    return state


def sums(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


def device_name() -> str:
    return torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (a check of the program, not figures)"


def to_pinned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=DEV == "cuda") for k, v in state.items()}
    for k, v in state.items():
        host[k].copy_(v, non_blocking=True)
    sync()
    return host


def to_gpu(host: dict[str, torch.Tensor], gpu: dict[str, torch.Tensor]) -> None:
    for k, v in host.items():
        gpu[k].copy_(v, non_blocking=True)
    sync()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def RawWriter(path: str, sync_files: bool, thread_count: int):
    return raw.Writer(path, thread_count=thread_count)


def write_case(row, name: str, state: dict, folder: Path, threads: int, staged: bool, writer_of) -> None:
    writer = writer_of(str(folder), sync_files=False, thread_count=threads)
    if staged:  # what checkpoint/memory.py does with a GPU state
        stage_s, cpu = timed(lambda: staging.to_host(state, pin=DEV == "cuda"))
        save_s, _ = timed(lambda: dcp.save(cpu, storage_writer=writer, no_dist=True))
        row(f"write {name}", stage_s + save_s, stage_s=round(stage_s, 3), save_s=round(save_s, 3))
    else:
        row(f"write {name}", timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))[0])


def read_case(row, name: str, state: dict, folder: Path, want: dict, pinned: bool) -> None:
    """Read `folder` onto the GPU: directly, or (`pinned`) into pinned host tensors, then copied over."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = (raw.Reader if name.startswith("raw") else FileSystemReader)(str(folder))
    if pinned:
        cpu = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=DEV == "cuda") for k, v in state.items()}
        load_s, _ = timed(lambda: dcp.load(cpu, storage_reader=reader, no_dist=True))
        copy_s, _ = timed(lambda: to_gpu(cpu, target))
        row(
            f"read {name}",
            load_s + copy_s,
            load_s=round(load_s, 3),
            copy_s=round(copy_s, 3),
            exact=sums(target) == want,
        )
    else:
        seconds, _ = timed(lambda: dcp.load(target, storage_reader=reader, no_dist=True))
        row(f"read {name}", seconds, exact=sums(target) == want)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--out", default="gpu_memory_path.json")
    p.add_argument("--cpu-check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global DEV
    DEV = "cpu" if args.cpu_check else "cuda"
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU's path only")
        return 2
    state = gpu_state(args.layers)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    want = sums(state)
    rows = []
    shm = Path(tempfile.mkdtemp(prefix="gpu-memory-path-", dir="/dev/shm"))

    def row(name, seconds, **extra):
        rows.append({"name": name, "seconds": round(seconds, 3), "gbs": round(nbytes / seconds / 1e9, 2), **extra})
        print(f"{name:28s} {seconds:7.2f} s  {nbytes / seconds / 1e9:7.2f} GB/s  {extra or ''}", flush=True)

    try:
        print(
            f"[gpu-memory-path] {device_name()}, torch {torch.__version__}: "
            f"{len(state)} tensors, {nbytes / 1e9:.2f} GB",
            flush=True,
        )
        host_s, host = timed(lambda: to_pinned(state))
        row("copy GPU -> pinned host", host_s)
        back = {k: torch.empty_like(v) for k, v in state.items()}
        row("copy pinned host -> GPU", timed(lambda: to_gpu(host, back))[0])  # noqa: F821  (del below)
        del back
        for name, threads, staged, writer_of in (
            ("raw", args.threads, True, RawWriter),
            ("dcp", 1, False, FileSystemWriter),
            (f"dcp-threads-{args.threads}", args.threads, False, FileSystemWriter),
            ("staged", args.threads, True, FileSystemWriter),
        ):
            folder = shm / name  # each case's files are removed before the next is written
            write_case(row, name, state, folder, threads, staged, writer_of)
            read_case(row, name, state, folder, want, pinned=name == "staged")
            if name == "raw":
                read_case(row, "raw, via pinned host memory", state, folder, want, pinned=True)
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    Path(args.out).write_text(
        json.dumps(
            {"device": device_name(), "torch": torch.__version__, "bytes": nbytes, "tensors": len(state), "rows": rows},
            indent=1,
        )
        + "\n"
    )
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
