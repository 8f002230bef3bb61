"""What in-memory snapshots cost a steady job: the same job with a snapshot after every step and without, side by
side in one run.

    python benchmarks/rescale/snapshot_cost.py [--model gpt3-small] [--repeats 3] [--steps 12] [--out FILE]

Two hosts on this machine (127.0.0.1 and 127.0.0.2, 2 ranks each) train `--model` through `elastic-trainer
launch` (`--schedule none`, global batch 8 x 128 tokens), once with `--memory-snapshot-every 1` and once with
snapshots off, the two alternating `--repeats` times so that the machine's noise hits both alike. A job's step
time is the median of its steps after the first two (the first compiles nothing but connects and warms up);
the table gives the median over repeats of each and their ratio, and the memory each host holds for its
snapshots (its own and its partner's files, the newest generation, at the job's end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from elastic_trainer.elastic.events import read_jsonl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from failures import start_on_two_hosts  # noqa: E402  (the sibling benchmark's helper)

MODES = {"snapshots every step": ["--memory-snapshot-every", "1"], "off": []}


def held_bytes(shm: Path) -> dict[str, int]:
    """{host: bytes of the snapshot files in its shared-memory folder}: the states and the ranks' spare files."""
    out: dict[str, int] = {}
    for folder in [*shm.glob("elastic-trainer-*/*/*/step-*"), *shm.glob("elastic-trainer-*/*/*/.spare-*")]:
        try:
            size = sum(f.stat().st_size for f in folder.iterdir())
        except FileNotFoundError:  # removed while it was read
            continue
        out[folder.parent.name] = out.get(folder.parent.name, 0) + size
    return out


def job(folder: Path, model: str, steps: int, extra: list[str], data_cache: str) -> dict:
    train = ["--steps", str(steps), "--global-batch", "8", "--seq-len", "128", "--data-cache", data_cache, *extra]
    proc, run_dir = start_on_two_hosts(folder, ["--model", model], train)
    shm = folder / "shm"
    # the job's last snapshot is removed by its final durable save: the memory held is read while it trains
    held: dict[str, int] = {}
    while True:
        try:
            out, _ = proc.communicate(timeout=0.5)  # reading the output meanwhile: a full pipe would stop the job
            break
        except subprocess.TimeoutExpired:
            now = held_bytes(shm)
            if sum(now.values()) > sum(held.values()):
                held = now
    if proc.returncode != 0:
        raise SystemExit(f"the job failed:\n{out[-3000:]}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    times = [r["step_time_s"] for r in records if r["step"] > 2]
    return {"step_s": statistics.median(times), "steps": len(records), "held_bytes": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt3-small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(HERE / "snapshot_cost.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "data-cache")
        for r in range(args.repeats):
            for mode, extra in MODES.items():
                row = {
                    "mode": mode,
                    "repeat": r,
                    **job(Path(tmp) / f"{r}-{len(rows)}", args.model, args.steps, extra, cache),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    medians = {m: statistics.median(r["step_s"] for r in rows if r["mode"] == m) for m in MODES}
    ratio = medians["snapshots every step"] / medians["off"]
    held = max((r["held_bytes"] for r in rows if r["mode"] != "off"), key=lambda h: sum(h.values()), default={})
    print(
        f"{args.model}, 4 ranks on 2 hosts: step {medians['off']:.3f} s off, {medians['snapshots every step']:.3f} s "
        f"with snapshots every step ({ratio:.3f}x); held per host: "
        + ", ".join(f"{h} {b / 2**20:.0f} MiB" for h, b in sorted(held.items()))
    )
    summary = {"model": args.model, "step_s": medians, "ratio": ratio, "held_bytes": held}
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
