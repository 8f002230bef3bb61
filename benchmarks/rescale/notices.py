"""What a host that leaves with notice, or joins, costs the job, against the same host lost without notice.

    python benchmarks/rescale/notices.py [--repeats 3] [--out benchmarks/rescale/notices.json]

Two hosts on this machine (127.0.0.1 and 127.0.0.2, 2 ranks each) run the default model through `elastic-trainer
launch` with the launcher's default settings (`--schedule none`: every slot, `--save-every 10`). Each repeat runs
two jobs:

- **notice, then join**: once step 6 is in the metrics, 127.0.0.2's agent gets SIGTERM (a scheduler's notice,
  30 s of grace): the launcher re-forms the job on 127.0.0.1 in a world started beside the running one and the
  state passes through memory (launch/notices.py). Once that world trains, 127.0.0.3 is added to the hosts
  file: the job re-forms on 127.0.0.1 + 127.0.0.3 the same way.
- **lost**: once step 6 is in the metrics, 127.0.0.2's agent is SIGKILLed (no notice): torchrun restarts the
  survivors' workers, which resume from the newest periodic checkpoint (what the job paid for a leaving host
  before; benchmarks/rescale/failures.py measures it in detail).

Per event: the downtime (end of the last step before it to the start of the first step after it), its parts
from the job's events, the seconds the old world went on training after the notice while the new one started
(`overlap_s`), and the steps trained twice. Medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.elastic.report import downtime, segments

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from failures import agent_of, median, start_on_two_hosts, wait  # noqa: E402  (the sibling benchmark's helpers)

PARTS = ("save_s", "wait_s", "handover_s", "setup_s", "first_step_s")


def start(folder: Path, data_cache: str) -> tuple[subprocess.Popen, Path]:
    return start_on_two_hosts(folder, [], ["--steps", "600", "--save-every", "10", "--data-cache", data_cache])


def stepped(run_dir: Path, after: float, world: int):
    """The first step that began after `after` in a world of `world` ranks (or None)."""
    return next(
        (
            r
            for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["world_size"] == world and r["time"] - r["step_time_s"] > after
        ),
        None,
    )


def reached(run_dir: Path, step: int) -> bool:
    return any(r["step"] >= step for r in read_jsonl(run_dir / "metrics.jsonl"))


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    (run_dir / "stop").touch()
    try:
        proc.communicate(timeout=300)
    finally:
        proc.kill()


def gaps(run_dir: Path, marks: list[float]) -> list[dict]:
    """One row per reconfiguration after each mark: downtime, its parts, overlap, steps redone."""
    records, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    segs = segments(records)
    rows = []
    for mark in marks:
        i = next(i for i, s in enumerate(segs) if s.start > mark)
        a, b = segs[i - 1], segs[i]
        gap = downtime(a, b, events)
        stop = min((e["time"] for e in events if e["event"] == "stop_requested" and e["time"] >= mark), default=None)
        rows.append(
            {
                "from": a.world_size,
                "to": b.world_size,
                "downtime_s": gap["downtime_s"],
                **{k: gap.get(k) for k in PARTS},
                "overlap_s": None if stop is None else stop - mark,
                "redone": a.records[-1]["step"] - b.records[0]["step"] + 1,
            }
        )
    return rows


def notice_then_join(folder: Path, data_cache: str) -> list[dict]:
    proc, run_dir = start(folder, data_cache)
    try:
        wait(lambda: reached(run_dir, 6), proc)
        noticed = time.time()
        os.kill(agent_of(proc.pid, "127.0.0.2"), signal.SIGTERM)
        two = wait(lambda: stepped(run_dir, noticed, 2), proc)
        wait(lambda: reached(run_dir, two["step"] + 5), proc)
        edited = time.time()
        new = folder / "hosts.new"
        new.write_text("127.0.0.1 slots=2\n127.0.0.3 slots=2\n")
        os.replace(new, folder / "hosts.txt")
        wait(lambda: stepped(run_dir, edited, 4), proc)
        finish(proc, run_dir)
    finally:
        proc.kill()
    rows = gaps(run_dir, [noticed, edited])
    for row, kind in zip(rows, ("notice", "join")):
        row["kind"] = kind
    return rows


def lost(folder: Path, data_cache: str) -> dict:
    proc, run_dir = start(folder, data_cache)
    try:
        wait(lambda: reached(run_dir, 6), proc)
        killed = time.time()
        os.kill(agent_of(proc.pid, "127.0.0.2"), signal.SIGKILL)
        first = wait(lambda: stepped(run_dir, killed, 2), proc)
        finish(proc, run_dir)
    finally:
        proc.kill()
    before = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["time"] <= killed)
    last_end = max(r["time"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["time"] <= killed)
    return {
        "kind": "lost",
        "from": 4,
        "to": 2,
        "downtime_s": first["time"] - first["step_time_s"] - last_end,
        "first_step_s": first["step_time_s"],
        "redone": before - first["step"] + 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "notices.json"))
    args = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "data-cache")
        for r in range(args.repeats):  # the kinds alternate, so the machine's noise hits each alike
            for row in [*notice_then_join(Path(tmp) / f"notice-{r}", cache), lost(Path(tmp) / f"lost-{r}", cache)]:
                rows.append(row)
                print(json.dumps(row), flush=True)
    keys = ("downtime_s", *PARTS, "overlap_s", "redone")
    summary = {
        kind: {k: median([x for x in rows if x["kind"] == kind], k) for k in keys}
        for kind in ("notice", "join", "lost")
    }
    print(f"{'event':<8}" + "".join(f"{k:>14}" for k in keys))
    for kind, values in summary.items():
        print(f"{kind:<8}" + "".join(f"{'-' if values[k] is None else values[k]:>14}" for k in keys))
    Path(args.out).write_text(
        json.dumps({"repeats": args.repeats, "cpu_count": os.cpu_count(), "medians": summary, "runs": rows}, indent=1)
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
