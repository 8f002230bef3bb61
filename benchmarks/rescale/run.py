"""Downtime of every reconfiguration of the default job, against a bare torchrun start measured in the same run.

    python benchmarks/rescale/run.py [--repeats 3] [--out benchmarks/rescale/results.json]

Each repeat runs the default job (gpt-tiny, configs/schedules/default.json: 4 -> 8 -> 2 -> 4 ranks on
localhost) through `elastic-trainer launch`, exactly as ./run.sh does, then starts a bare torchrun job of each
new rank count (bare_start.py: import torch, form a gloo process group). Per reconfiguration it prints the
downtime (end of the last step before it to the start of the first step after it) and its stages from the
job's events, and the ratio downtime / (bare start + the job's checkpoint load). Medians over the repeats go to
results.json. The repeats alternate job and bare starts, so the machine's noise hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import downtime, segments

HERE = Path(__file__).resolve().parent
STAGES = ("save_s", "exit_s", "relaunch_s", "rendezvous_s", "start_s", "setup_s", "load_s", "first_step_s")


def env(worker_start: str = "fork") -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
                ELASTIC_TRAINER_WORKER_START=worker_start)


def run_job(folder: Path, data_cache: str, worker_start: str = "fork") -> list[dict]:
    """One default job; its reconfigurations as rows (from ranks, to ranks, downtime and stages)."""
    folder.mkdir(parents=True)
    (folder / "hosts.txt").write_text("localhost slots=8\n")
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "elastic_trainer.cli", "launch", "--hosts", str(folder / "hosts.txt"),
           "--run-dir", str(run_dir), "--", "--data-cache", data_cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(worker_start))
    if proc.returncode != 0:
        raise SystemExit(f"the default job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    segs = segments(read_jsonl(run_dir / "metrics.jsonl"))
    events = read_jsonl(run_dir / "events.jsonl")
    return [{"from": a.world_size, "to": b.world_size, **downtime(a, b, events)} for a, b in zip(segs, segs[1:])]


def bare_start(ranks: int) -> float:
    """Seconds from starting torchrun to its ranks' process group being formed."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(HERE / "bare_start.py")], capture_output=True, text=True, env=env())
    up = [line for line in proc.stdout.splitlines() if line.startswith("UP ")]
    if proc.returncode != 0 or not up:
        raise SystemExit(f"bare torchrun start of {ranks} ranks failed:\n{proc.stderr[-2000:]}")
    return float(up[0].split()[1]) - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--worker-start", choices=("fork", "spawn"), default="fork",
                        help="how the agents start their workers (spawn: fresh interpreters, as plain torchrun)")
    args = parser.parse_args()
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "data-cache")
        run_job(Path(tmp) / "warm", cache)  # tokenizes the corpus once, outside the measurements
        for r in range(args.repeats):
            rows = run_job(Path(tmp) / f"job{r}", cache, args.worker_start)
            for row in rows:
                row["bare_start_s"] = bare_start(row["to"])
                row["ratio"] = row["downtime_s"] / (row["bare_start_s"] + row["load_s"])
            runs.append(rows)
            for row in rows:
                print(f"repeat {r + 1}: {row['from']} -> {row['to']} ranks: downtime {row['downtime_s']:.2f} s "
                      f"(bare start {row['bare_start_s']:.2f} + load {row['load_s']:.2f}): ratio {row['ratio']:.2f}",
                      flush=True)
    events = []
    for i, first in enumerate(runs[0]):
        med = {k: statistics.median(run[i][k] for run in runs) for k in ("downtime_s", "bare_start_s", "ratio",
                                                                          *STAGES)}
        events.append({"from": first["from"], "to": first["to"], **{k: round(v, 3) for k, v in med.items()}})
    header = f"{'event':>8}  {'downtime':>8}  " + "  ".join(f"{s[:-2]:>10}" for s in STAGES) + \
        f"  {'bare start':>10}  {'ratio':>5}"
    print(f"\nmedians over {args.repeats} repeats (seconds); ratio = downtime / (bare start + load)\n{header}")
    for e in events:
        print(f"{e['from']:>3} -> {e['to']:<2}  {e['downtime_s']:8.2f}  " +
              "  ".join(f"{e[s]:10.2f}" for s in STAGES) + f"  {e['bare_start_s']:10.2f}  {e['ratio']:5.2f}")
    ratio = statistics.median(e["ratio"] for e in events)
    print(f"median ratio over the events: {ratio:.2f} (goal <= 1.5)")
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "worker_start": args.worker_start,
                                          "cpu_count": os.cpu_count(),
                                          "median_ratio": round(ratio, 3), "events": events,
                                          "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
