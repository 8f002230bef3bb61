"""Downtime of every reconfiguration of the default job: through the warm start and the hand-over in memory (what
./run.sh does), through a restart of the processes and the checkpoint folder (`--no-warm-start`, the path before
issue 33), and a bare torchrun start of the same ranks, all measured in the same run.

    python benchmarks/rescale/run.py [--repeats 3] [--out benchmarks/rescale/results.json]

Each repeat runs the default job (gpt-tiny, configs/schedules/default.json: 4 -> 8 -> 2 -> 4 ranks on
localhost) through `elastic-trainer launch` both ways, then starts a bare torchrun job of each new rank count
(bare_start.py: import torch, form a gloo process group). Per reconfiguration: the downtime (end of the last step
before it to the start of the first step after it) and its stages from the job's events, the ratio downtime /
bare start, and the first step after the event against the median step of the phase after it. The host's memory
in use (MemTotal - MemAvailable, sampled every 50 ms) is recorded over each job: its peak above what was in use
before the job. Medians over the repeats go to results.json; the repeats alternate the three, so the machine's
noise hits all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import downtime, segments

HERE = Path(__file__).resolve().parent
STAGES = ("save_s", "exit_s", "relaunch_s", "rendezvous_s", "start_s", "setup_s", "load_s", "first_step_s")
WARM_STAGES = ("save_s", "wait_s", "handover_s", "setup_s", "load_s", "first_step_s", "steady_step_s")


def env(worker_start: str = "fork") -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
        ELASTIC_TRAINER_WORKER_START=worker_start,
    )


def used_memory() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"] - info["MemAvailable"]


class MemoryPeak:
    """The peak of the host's memory in use while the `with` block runs, above what was in use at its start."""

    def __enter__(self):
        self.base, self.peak, self._done = used_memory(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, used_memory() - self.base)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def run_job(folder: Path, data_cache: str, worker_start: str = "fork", warm: bool = True) -> tuple[list[dict], int]:
    """One default job; its reconfigurations as rows (from ranks, to ranks, downtime and stages), and the peak
    host memory it used."""
    folder.mkdir(parents=True)
    (folder / "hosts.txt").write_text("localhost slots=8\n")
    run_dir = folder / "run"
    cmd = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "launch",
        "--hosts",
        str(folder / "hosts.txt"),
        "--run-dir",
        str(run_dir),
        *([] if warm else ["--no-warm-start"]),
        "--",
        "--data-cache",
        data_cache,
    ]
    with MemoryPeak() as memory:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(worker_start))
    if proc.returncode != 0:
        raise SystemExit(f"the default job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    segs = segments(read_jsonl(run_dir / "metrics.jsonl"))
    events = read_jsonl(run_dir / "events.jsonl")
    rows = []
    for a, b in zip(segs, segs[1:]):
        row = {"from": a.world_size, "to": b.world_size, **downtime(a, b, events)}
        row["steady_step_s"] = statistics.median(r["step_time_s"] for r in b.records[1:])
        rows.append({k: v for k, v in row.items() if k != "handover"})
    return rows, memory.peak


def bare_start(ranks: int) -> float:
    """Seconds from starting torchrun to its ranks' process group being formed."""
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(HERE / "bare_start.py"),
        ],
        capture_output=True,
        text=True,
        env=env(),
    )
    up = [line for line in proc.stdout.splitlines() if line.startswith("UP ")]
    if proc.returncode != 0 or not up:
        raise SystemExit(f"bare torchrun start of {ranks} ranks failed:\n{proc.stderr[-2000:]}")
    return float(up[0].split()[1]) - t0


def _medians(runs: list[list[dict]], keys) -> list[dict]:
    out = []
    for i, first in enumerate(runs[0]):
        med = {
            k: statistics.median(run[i][k] for run in runs if run[i].get(k) is not None)
            for k in keys
            if any(run[i].get(k) is not None for run in runs)
        }
        out.append({"from": first["from"], "to": first["to"], **{k: round(v, 3) for k, v in med.items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument(
        "--worker-start",
        choices=("fork", "spawn"),
        default="fork",
        help="how the agents start their workers (spawn: fresh interpreters, as plain torchrun)",
    )
    args = parser.parse_args()
    warm_runs, cold_runs, peaks = [], [], {"warm": [], "restart": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "data-cache")
        run_job(Path(tmp) / "first", cache)  # tokenizes the corpus once, outside the measurements
        for r in range(args.repeats):
            warm, peak = run_job(Path(tmp) / f"warm{r}", cache, args.worker_start)
            peaks["warm"].append(peak)
            cold, peak = run_job(Path(tmp) / f"cold{r}", cache, args.worker_start, warm=False)
            peaks["restart"].append(peak)
            for w, c in zip(warm, cold):
                w["bare_start_s"] = c["bare_start_s"] = bare_start(w["to"])
                w["ratio"], c["ratio"] = w["downtime_s"] / w["bare_start_s"], c["downtime_s"] / c["bare_start_s"]
                w["first_step_ratio"] = w["first_step_s"] / w["steady_step_s"]
                print(
                    f"repeat {r + 1}: {w['from']} -> {w['to']} ranks: downtime {w['downtime_s']:.2f} s in memory, "
                    f"{c['downtime_s']:.2f} s through a restart; bare start {w['bare_start_s']:.2f} s; first step "
                    f"{w['first_step_s']:.2f} s (steady {w['steady_step_s']:.2f} s)",
                    flush=True,
                )
            warm_runs.append(warm)
            cold_runs.append(cold)
    warm = _medians(warm_runs, ("downtime_s", "bare_start_s", "ratio", "first_step_ratio", *WARM_STAGES))
    cold = _medians(cold_runs, ("downtime_s", "ratio", *STAGES))
    print(f"\nmedians over {args.repeats} repeats (seconds); ratio = downtime / bare start")
    print(
        f"{'event':>8}  {'warm':>6}  {'restart':>7}  {'bare':>6}  {'warm/bare':>9}  {'restart/bare':>12}  "
        f"{'first step / steady':>19}  " + "  ".join(f"{s[:-2]:>10}" for s in WARM_STAGES[:4])
    )
    for w, c in zip(warm, cold):
        print(
            f"{w['from']:>3} -> {w['to']:<2}  {w['downtime_s']:6.2f}  {c['downtime_s']:7.2f}  "
            f"{w['bare_start_s']:6.2f}  {w['ratio']:9.2f}  {c['ratio']:12.2f}  {w['first_step_ratio']:19.2f}  "
            + "  ".join(f"{w.get(s, 0.0):10.2f}" for s in WARM_STAGES[:4])
        )
    ratio = statistics.median(e["ratio"] for e in warm)
    before = statistics.median(e["ratio"] for e in cold)
    gib = 1 << 30
    memory = {k: round(statistics.median(v) / gib, 3) for k, v in peaks.items()}
    print(
        f"median ratio over the events: {ratio:.2f} in memory (goal <= 0.3), {before:.2f} through a restart; "
        f"peak host memory above idle: {memory['warm']:.2f} GiB warm, {memory['restart']:.2f} GiB restart"
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "repeats": args.repeats,
                "worker_start": args.worker_start,
                "cpu_count": os.cpu_count(),
                "median_ratio": round(ratio, 3),
                "median_ratio_restart": round(before, 3),
                "peak_memory_gib": memory,
                "events": warm,
                "events_restart": cold,
                "runs": warm_runs,
                "runs_restart": cold_runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
