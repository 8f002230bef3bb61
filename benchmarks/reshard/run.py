"""Reshard benchmark: save a training state at one layout, load it into another, against the disk.

    python benchmarks/reshard/run.py                        # gpt3-small and a GPT-3 XL-sized state
    python benchmarks/reshard/run.py --models gpt3-small    # a minute or so

For each model: the state is weights + AdamW moments in fp32 (GPT-3 XL: 1.3 B parameters x 12 bytes =
15.8 GB). Ranks are forked gloo processes on this machine, sized so the state fits in 24 GiB. Reported:
- this machine's sequential write and cold read bandwidth (a 2 GB file; the page cache is dropped for it
  with posix_fadvise(DONTNEED));
- save: synchronous checkpoint time and GB/s (DCP write + fsync + checksums + commit);
- load (another layout, cold cache): checksum verification and DCP reshard-load, each in GB/s and as a
  fraction of the disk's read bandwidth;
- verification that the reloaded state equals the saved one: per tensor, row and column sums in float64
  (layout-free fingerprints computed through DTensor reductions; bitwise-equal values agree to ~1e-12);
- gpt3-small only: the training stall of a synchronous against an asynchronous save, around real steps.
  (An asynchronous save stages a full host copy of the local state; at GPT-3 XL size that copy does not fit
  beside the state in 24 GiB, so XL is measured synchronously.)
Results go to benchmarks/reshard/results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, storage  # noqa: E402
from elastic_trainer.checkpoint.state import init_optimizer_state  # noqa: E402
from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.data import load_tokens  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402

CASES = {  # model: (save layout, load layout) as (dp, tp, pp)
    "gpt3-small": ((2, 1, 2), (1, 2, 1)),
    "gpt3-xl": ((4, 1, 1), (1, 2, 1)),
}
GB = 1e9


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(folder: Path, size: int = 2 << 30) -> tuple[float, float]:
    """(sequential write GB/s including fsync, cold sequential read GB/s) of a file in `folder`."""
    path = folder / "bandwidth.bin"
    block = os.urandom(16 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = size / (time.perf_counter() - t0) / GB
    drop_cache([path])
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    read = size / (time.perf_counter() - t0) / GB
    path.unlink()
    return write, read


def config() -> TrainConfig:
    return TrainConfig(global_batch=4, seq_len=128, steps=10, seed=0, warmup_steps=1)


def make_trainer(model: str, degrees, tokens) -> Trainer:
    dp, tp, pp = degrees
    layout = Layout(dp, tp, pp, micro_batch=4 // dp, num_microbatches=1)
    return Trainer(
        load_model_config(model), config(), layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens
    )


@torch.no_grad()
def fill_optimizer_state(trainer: Trainer) -> None:
    """Moments that differ from the weights and from each other, without a (slow) real step."""
    init_optimizer_state(trainer.optimizer)
    for p, state in trainer.optimizer.state.items():
        local = p.to_local() if isinstance(p, DTensor) else p
        (state["exp_avg"].to_local() if isinstance(p, DTensor) else state["exp_avg"]).copy_(local * 0.5)
        (state["exp_avg_sq"].to_local() if isinstance(p, DTensor) else state["exp_avg_sq"]).copy_(local * local)
        state["step"].fill_(7)


@torch.no_grad()
def fingerprints(trainer: Trainer) -> dict[str, list]:
    """Per global name: row and column sums (float64) of every weight and moment; layout-independent."""
    out = {}
    for name, p in trainer.engine.model.named_parameters():
        for key, t in [("param", p)] + [(k, v) for k, v in trainer.optimizer.state[p].items() if k != "step"]:
            t = t.double()
            sums = [t] if t.ndim == 1 else [t.sum(dim=1), t.sum(dim=0)]
            out[f"{key}/{name}"] = [(s.full_tensor() if isinstance(s, DTensor) else s).tolist() for s in sums]
    return out


def timed(fn) -> tuple[float, object]:
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t0, result


def save_job(rank, world, model, degrees, folder, tokens, stall_steps):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    trainer = make_trainer(model, degrees, tokens)
    out = {}
    if stall_steps:  # real steps around a synchronous and an asynchronous save
        ck = Checkpointer(CheckpointConfig(dir=str(folder / "stall")), log=lambda *a, **k: None)
        steps = [trainer.train_step()["step_time_s"] for _ in range(stall_steps)]
        sync = ck.save(trainer, blocking=True)
        asyn = ck.save(trainer, blocking=False)
        during = [trainer.train_step()["step_time_s"] for _ in range(stall_steps)]
        ck.wait()
        ck.close()
        out["stall"] = {
            "step_s": statistics.median(steps),
            "sync_stall_s": sync.stall_s,
            "async_stall_s": asyn.stall_s,
            "async_total_s": asyn.total_s,
            "steps_during_async_s": during,
        }
    fill_optimizer_state(trainer)
    ck = Checkpointer(CheckpointConfig(dir=str(folder / "ckpt")), log=lambda *a, **k: None)
    seconds, stats = timed(lambda: ck.save(trainer, blocking=True))
    ck.close()
    out.update(save_s=seconds, fingerprints=fingerprints(trainer), path=stats.path)
    return out if rank == 0 else {"fingerprints": out["fingerprints"]}


def load_job(rank, world, model, degrees, folder, tokens):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    trainer = make_trainer(model, degrees, tokens)
    target = storage.complete_checkpoints(folder / "ckpt")[0]
    files = [target / n for n in sorted(storage.read_manifest(target))]
    ck = Checkpointer(CheckpointConfig(dir=str(folder / "ckpt")), log=lambda *a, **k: None)
    if rank == 0:
        drop_cache(files)
    verify_s, error = timed(lambda: ck.verify(target))
    assert error is None, error
    if rank == 0:
        drop_cache(files)
    load_s, meta = timed(lambda: ck.load(trainer, str(target), verify=False))
    ck.close()
    return {"verify_s": verify_s, "load_s": load_s, "fingerprints": fingerprints(trainer)}


def merged(results: list[dict]) -> dict:
    out = {}
    for r in results:
        out.update(r["fingerprints"])
    return out


def compare(saved: dict, loaded: dict) -> float:
    assert set(saved) == set(loaded), set(saved) ^ set(loaded)
    worst = 0.0
    for key, a_sums in saved.items():
        for a, b in zip(a_sums, loaded[key]):
            a, b = torch.tensor(a), torch.tensor(b)
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return worst


def run_case(model: str, folder: Path, tokens, stall_steps: int) -> dict:
    save_deg, load_deg = CASES[model]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    world = save_deg[0] * save_deg[1] * save_deg[2]
    print(f"[{model}] saving at dp,tp,pp={save_deg} on {world} ranks ...", flush=True)
    saved = run_ranks(save_job, world, model, save_deg, folder, tokens, stall_steps, timeout=3600)
    ckpt = Path(saved[0]["path"])
    nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
    world = load_deg[0] * load_deg[1] * load_deg[2]
    print(f"[{model}] loading {nbytes / GB:.2f} GB at dp,tp,pp={load_deg} on {world} ranks ...", flush=True)
    loaded = run_ranks(load_job, world, model, load_deg, folder, tokens, timeout=3600)
    worst = compare(merged(saved), merged(loaded))
    result = {
        "save_layout": save_deg,
        "load_layout": load_deg,
        "bytes": nbytes,
        "save_s": saved[0]["save_s"],
        "verify_s": loaded[0]["verify_s"],
        "load_s": loaded[0]["load_s"],
        "fingerprint_max_rel_diff": worst,
        "stall": saved[0].get("stall"),
    }
    shutil.rmtree(folder, ignore_errors=True)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt3-small,gpt3-xl")
    p.add_argument("--dir", default="/tmp/elastic-trainer-reshard", help="scratch folder on the disk to test")
    p.add_argument("--stall-steps", type=int, default=3, help="training steps around the gpt3-small saves")
    p.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = p.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_bw, read_bw = disk_bandwidth(folder)
    print(f"[disk] sequential write {write_bw:.2f} GB/s (with fsync), cold sequential read {read_bw:.2f} GB/s")
    tokens = load_tokens(config().data)
    results = {
        "disk": {"write_GBps": write_bw, "read_GBps": read_bw},
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "models": {},
    }
    for model in args.models.split(","):
        r = run_case(model, folder / model, tokens, args.stall_steps if model == "gpt3-small" else 0)
        r["save_GBps"] = r["bytes"] / r["save_s"] / GB
        r["verify_GBps"] = r["bytes"] / r["verify_s"] / GB
        r["load_GBps"] = r["bytes"] / r["load_s"] / GB
        r["load_vs_disk_read"] = r["load_GBps"] / read_bw
        results["models"][model] = r
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"\n{'model':<11} {'GB':>6} {'save':>13} {'verify (cold)':>15} {'load (cold)':>14} {'load/disk':>9} "
        f"{'max rel diff':>12}"
    )
    for model, r in results["models"].items():
        print(
            f"{model:<11} {r['bytes'] / GB:>6.2f} {r['save_s']:>6.1f}s {r['save_GBps']:>4.2f}GB/s "
            f"{r['verify_s']:>6.1f}s {r['verify_GBps']:>4.2f}GB/s {r['load_s']:>5.1f}s {r['load_GBps']:>4.2f}GB/s "
            f"{r['load_vs_disk_read']:>9.2f} {r['fingerprint_max_rel_diff']:>12.1e}"
        )
    small = results["models"].get("gpt3-small", {}).get("stall")
    if small:
        print(
            f"\ntraining stall (gpt3-small, step {small['step_s']:.2f} s): synchronous save "
            f"{small['sync_stall_s']:.2f} s, asynchronous save {small['async_stall_s']:.2f} s "
            f"(committed after {small['async_total_s']:.2f} s; steps meanwhile "
            f"{', '.join(f'{s:.2f}' for s in small['steps_during_async_s'])} s)"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
