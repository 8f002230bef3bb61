"""What an unplanned loss costs: a worker, a host or the host of rank 0 SIGKILLed, or a host frozen, mid-run,
with in-memory snapshots every step and without them.

    python benchmarks/rescale/failures.py [--repeats 3] [--out benchmarks/rescale/failures.json]

Two hosts on this machine (127.0.0.1 and 127.0.0.2, 2 ranks each) run the default model through `elastic-trainer
launch` with the launcher's default settings (no periodic durable save), once with `--memory-snapshot-every 1`
and once without (`off`). Once step 6 is in the metrics, one of:

- worker: one rank process of 127.0.0.2 is SIGKILLed (its agent restarts its workers, the job stays at 4 ranks);
- host: 127.0.0.2's agent is SIGKILLed (its ranks die with it; the job goes on with 2 ranks);
- first host: 127.0.0.1's agent, the host of rank 0, is SIGKILLed (the same, with the other host);
- frozen host: 127.0.0.2's agent and workers are SIGSTOPped (no process exits, its connections stay open): the
  launcher cuts it off after its heartbeat has been silent for the hang timeout (launch/heartbeat.py).

**Recovery** is from the kill to the start of the first step after it, from the job's events, in stages:
detect (kill or freeze -> the first surviving agent restarts its workers; for a frozen host this includes
the hang timeout, and `cut_s` is the freeze -> the launcher's `host_lost`), rendezvous (-> the last agent's rendezvous
completed), start (-> process group formed, `processes_up`), setup (-> state loaded: plan, build, load). The first
step after a restart is reported apart (gloo connects lazily), as are the steps redone (steps done before the
loss and trained again after it) and where the state came from. Medians of the repeats; the kinds and modes
alternate, so the machine's noise hits each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_trainer.elastic.events import read_jsonl

HERE = Path(__file__).resolve().parent
KINDS = ("worker", "host", "first host", "frozen host")
MODES = {"snapshots": ["--memory-snapshot-every", "1"], "off": []}
EXTRA = [a for a in os.environ.get("ET_BENCH_LAUNCH_ARGS", "").split() if a]
STAGES = ("detect_s", "rendezvous_s", "start_s", "setup_s")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def agent_of(launcher: int, host: str) -> int:
    for pid in children(launcher):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"elastic_trainer.launch.agent" in argv and argv[argv.index(b"--local-addr") + 1] == host.encode():
            return pid
    raise SystemExit(f"no agent for {host} under the launcher {launcher}")


def wait(what, proc: subprocess.Popen, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        if proc.poll() is not None:
            raise SystemExit(f"the job ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.02)
    raise SystemExit("timed out")


def start_on_two_hosts(folder: Path, launch: list[str], train: list[str]) -> tuple[subprocess.Popen, Path]:
    """A job on 127.0.0.1 and 127.0.0.2 (2 ranks each) through `elastic-trainer launch --schedule none LAUNCH --
    TRAIN`, its hosts file, run folder (`run`) and shared-memory folder (`shm`) in `folder`: the process, its
    output piped, and the run folder. The other benchmarks of two hosts start theirs here too."""
    folder.mkdir(parents=True)
    (folder / "hosts.txt").write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
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
        "--schedule",
        "none",
        *launch,
        "--",
        *train,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ELASTIC_TRAINER_SHM_DIR=str(folder / "shm")),
    )
    return proc, run_dir


def trial(folder: Path, kind: str, mode: str, data_cache: str) -> dict:
    train = ["--steps", "400", "--data-cache", data_cache, *MODES[mode]]
    proc, run_dir = start_on_two_hosts(folder, EXTRA, train)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait(lambda: any(r["step"] >= 6 for r in read_jsonl(metrics)), proc)
        agent = agent_of(proc.pid, "127.0.0.1" if kind == "first host" else "127.0.0.2")
        victim = children(agent)[0] if kind == "worker" else agent
        killed = time.time()
        if kind == "frozen host":
            os.killpg(victim, signal.SIGSTOP)  # the agent and its workers: one process group
        else:
            os.kill(victim, signal.SIGKILL)
        world = 4 if kind == "worker" else 2
        first = wait(
            lambda: next(
                (
                    r
                    for r in read_jsonl(metrics)
                    if r["time"] > killed and r["world_size"] == world and r["time"] - r["step_time_s"] > killed
                ),
                None,
            ),
            proc,
        )
        (run_dir / "stop").touch()
        proc.communicate(timeout=300)
    finally:
        proc.kill()
        if kind == "frozen host":
            try:
                os.killpg(victim, signal.SIGCONT)
            except ProcessLookupError:  # the launcher killed it when it cut it off
                pass
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if killed <= e["time"] <= first["time"]]

    def at(name: str, pick=min) -> float | None:
        times = [e["time"] for e in events if e["event"] == name]
        return pick(times) if times else None

    marks = [killed, at("workers_restarting"), at("rendezvous_done", max), at("processes_up"), at("state_loaded")]
    stages = {
        name: (b - a if a is not None and b is not None else None) for name, a, b in zip(STAGES, marks, marks[1:])
    }
    loaded = next((e for e in events if e["event"] == "state_loaded"), {})
    before = max(r["step"] for r in read_jsonl(metrics) if r["time"] <= killed)
    path = str((loaded.get("load") or {}).get("path", ""))
    return {
        "kind": kind,
        "mode": mode,
        "source": "memory" if path.startswith("memory:") else "durable" if path else "none (from the start)",
        "recovery_s": first["time"] - first["step_time_s"] - killed,
        **stages,
        "cut_s": (at("host_lost") - killed) if kind == "frozen host" and at("host_lost") else None,
        "load_s": (loaded.get("load") or {}).get("total_s"),
        "first_step_s": first["step_time_s"],
        "redone": before - first["step"] + 1,
    }


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--out", default=str(HERE / "failures.json"))
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "data-cache")
        for r in range(args.repeats):
            for kind in kinds:
                for mode in modes:
                    row = trial(Path(tmp) / f"{kind.replace(' ', '-')}-{mode}-{r}", kind, mode, cache)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    keys = ("recovery_s", "cut_s", *STAGES, "load_s", "first_step_s", "redone")
    summary = {}
    for kind in kinds:
        for mode in modes:
            mine = [x for x in rows if x["kind"] == kind and x["mode"] == mode]
            summary[f"{kind}, {mode}"] = {
                **{k: median(mine, k) for k in keys},
                "sources": sorted({x["source"] for x in mine}),
                "recovery_range_s": [
                    round(min(x["recovery_s"] for x in mine), 3),
                    round(max(x["recovery_s"] for x in mine), 3),
                ],
            }
    print(f"{'lost':<24}" + "".join(f"{k:>14}" for k in keys) + "  source")
    for name, values in summary.items():
        print(
            f"{name:<24}"
            + "".join(f"{'-' if values[k] is None else values[k]:>14}" for k in keys)
            + "  "
            + "/".join(values["sources"])
        )
    Path(args.out).write_text(json.dumps({"medians": summary, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
