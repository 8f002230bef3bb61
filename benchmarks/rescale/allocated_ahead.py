"""The hand-over's write into shared memory prepared ahead, beside new pages (checkpoint/spare.py's reason).

    .venv/bin/python benchmarks/rescale/allocated_ahead.py                       # gpt3-medium, 4 ranks, 2 rounds
    .venv/bin/python benchmarks/rescale/allocated_ahead.py --model gpt3-small --rounds 1

The stopping world's write of a planned hand-over, as benchmarks/vs_deepspeed times it: 4 data-parallel
ranks (FSDP) hold the model's fp32 weights and AdamW moments (filled as benchmarks/reshard does), plan the
write (`prepare_memory`, untimed) and `write_memory` into a fresh folder of /dev/shm (timed; the slowest
rank). Per mode, the files the write goes into are:
- **new**: made at the write (no preparation);
- **reserved**: allocated ahead with `os.posix_fallocate` only (tmpfs reserves the pages, writes nothing);
- **written**: allocated and written once with zeros ahead (`spare.fill`: what a stopping rank does once the
  next world is started; `allocate_memory`).
The preparation is timed apart (it is off the critical path). Modes alternate within each round, each in new
processes. Prints per mode the median write, its runs, the preparation, and the ratio new / mode.
Writes benchmarks/rescale/allocated_ahead.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("new", "reserved", "written")


def _bench():
    """benchmarks/vs_deepspeed/run.py: the same trainer, state filling and timing as the comparison."""
    spec = importlib.util.spec_from_file_location("vs_deepspeed_bench", ROOT / "benchmarks" / "vs_deepspeed" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_job(rank, world, model, folder, shm, tokens, mode):
    from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, memory, spare
    from elastic_trainer.plan.layout import Layout
    from elastic_trainer.train import heap

    bench = _bench()
    bench.quiet()
    os.environ[memory.SHM_ENV] = shm
    if mode == "reserved":
        spare.fill = lambda fd, size: os.posix_fallocate(fd, 0, size) if size else None
    trainer = bench.our_trainer(model, Layout(world, 1, 1, 4 // world, 1), 128, tokens)
    bench.fill_optimizer_state(trainer)
    ck = Checkpointer(CheckpointConfig(dir=str(folder)), log=lambda *a, **k: None)
    ck.prepare_memory(trainer)
    t0 = time.perf_counter()
    if mode != "new":
        ck.allocate_memory(wait=True)
    prepare_s = time.perf_counter() - t0
    heap.settle()
    seconds, written = bench.timed(lambda: ck.write_memory(trainer))
    if written.server is not None:
        written.server.stop()
    ck.close()
    return {"write_s": seconds, "prepare_s": prepare_s, "bytes": written.bytes}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt3-medium")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/tmp/elastic-trainer-allocated-ahead", help="checkpoint folders (ids only)")
    p.add_argument("--out", default=str(Path(__file__).with_name("allocated_ahead.json")))
    args = p.parse_args(argv)
    from elastic_trainer.config import load_model_config
    from elastic_trainer.parallel.local_ranks import run_ranks

    bench = _bench()
    tokens = bench.tokens_for(load_model_config(args.model), 128)
    runs = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            folder, shm = Path(args.dir) / f"{r}-{mode}", f"/dev/shm/elastic-trainer-allocated-ahead-{os.getpid()}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                got = run_ranks(write_job, args.ranks, args.model, folder, shm, tokens, mode, timeout=1800)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
                shutil.rmtree(folder, ignore_errors=True)
            runs[mode].append(
                {
                    "write_s": max(g["write_s"] for g in got),
                    "prepare_s": max(g["prepare_s"] for g in got),
                    "bytes": got[0]["bytes"],
                }
            )
            print(
                f"[round {r + 1}] {mode:9s} write {runs[mode][-1]['write_s']:.2f} s "
                f"(prepared in {runs[mode][-1]['prepare_s']:.2f} s)",
                flush=True,
            )
    new = statistics.median(x["write_s"] for x in runs["new"])
    print(
        f"\n{args.model}'s state, {runs['new'][0]['bytes'] / 1e9:.2f} GB from {args.ranks} ranks into /dev/shm, "
        f"{args.rounds} rounds (medians):"
    )
    summary = {}
    for mode in MODES:
        write = statistics.median(x["write_s"] for x in runs[mode])
        prepare = statistics.median(x["prepare_s"] for x in runs[mode])
        summary[mode] = {"write_s": write, "prepare_s": prepare, "ratio_new": new / write}
        print(
            f"  {mode:9s} write {write:6.2f} s   ratio new/{mode} {new / write:5.2f}   prepared ahead in "
            f"{prepare:5.2f} s   runs " + ", ".join(f"{x['write_s']:.2f}" for x in runs[mode])
        )
    Path(args.out).write_text(
        json.dumps({"model": args.model, "ranks": args.ranks, "rounds": runs, "summary": summary}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
