"""`--compile` against eager in the same run: step time, the first start's compile, a restart's with a warm cache.

    python benchmarks/compile/run.py [--model gpt3-small] [--ranks 4] [--steps 6] [--seq-len 256]

Every case trains `--steps` steps of the model on `--ranks` gloo ranks forked from this process (fp32, the
layout below, fixed so that every case runs the same one), each case in fresh ranks, so nothing compiled in
one is in the memory of the next:
1. eager;
2. compiled with an empty compile cache (the job's first start);
3. compiled again with the cache that (2) filled (a restart, or a reconfiguration back into a layout seen
   before).
For each: the first step (which compiles), the median of the later ones, and what parallel/compile.report
says (graphs, seconds compiling, cache hits and misses). Also the planner's view: one block's forward +
backward at this model's width, eager and compiled (calibrate --compile's compiled_speedup), beside the
whole step's measured ratio. Writes benchmarks/compile/results-MODEL.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.calibrate import measure_compiled_speedup  # noqa: E402
from elastic_trainer.parallel.compile import report  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402

HERE = Path(__file__).resolve().parent


def job(rank: int, world: int, model_name: str, cfg: TrainConfig, layout: Layout) -> dict:
    torch.set_num_threads(1)
    model = load_model_config(model_name)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 1 << 20, dtype=np.uint16)
    t0 = time.perf_counter()
    trainer = Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    built = time.perf_counter() - t0
    steps = [trainer.train_step()["step_time_s"] for _ in range(cfg.steps)]
    return {
        "build_s": built,
        "first_step_s": steps[0],
        "step_s": statistics.median(steps[1:]),
        "compile": report() if cfg.compile else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    layout = Layout(args.ranks, 1, 1, 1, 1, "fsdp")
    base = TrainConfig(global_batch=args.ranks, seq_len=args.seq_len, steps=args.steps, seed=0)
    results: dict = {
        "model": args.model,
        "ranks": args.ranks,
        "layout": layout.to_dict(),
        "seq_len": args.seq_len,
        "steps": args.steps,
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)),
    }
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        compiled = dataclasses.replace(base, compile=True, compile_cache=cache)
        for name, cfg in (("eager", base), ("compiled_cold", compiled), ("compiled_warm", compiled)):
            t0 = time.perf_counter()
            ranks = run_ranks(job, args.ranks, args.model, cfg, layout)
            r = dict(
                ranks[0],
                wall_s=time.perf_counter() - t0,
                first_step_s=max(x["first_step_s"] for x in ranks),
                step_s=max(x["step_s"] for x in ranks),
            )
            results[name] = r
            extra = (
                (
                    f", compiled {r['compile']['graphs']} graph(s) in {r['compile']['compile_s']:.1f} s, cache "
                    f"{r['compile']['cache_hits']} hit(s) {r['compile']['cache_misses']} miss(es)"
                )
                if r["compile"]
                else ""
            )
            print(f"{name:14s} first step {r['first_step_s']:7.2f} s, then {r['step_s']:.3f} s/step{extra}", flush=True)
    model = load_model_config(args.model)
    torch.set_num_threads(1)
    speedup, seconds = measure_compiled_speedup(torch.device("cpu"), torch.float32, (model.d_model, 512))
    eager, cold, warm = results["eager"], results["compiled_cold"], results["compiled_warm"]
    results["ratios"] = {
        "step_eager_over_compiled": eager["step_s"] / cold["step_s"],
        "warm_compile_over_cold": warm["compile"]["compile_s"] / cold["compile"]["compile_s"],
        "warm_first_step_over_cold": warm["first_step_s"] / cold["first_step_s"],
        "block_eager_over_compiled (calibrate --compile)": speedup,
    }
    for k, v in results["ratios"].items():
        print(f"{k}: {v:.3f}")
    out = Path(args.out or HERE / f"results-{args.model}.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
