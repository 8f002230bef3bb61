"""What a job learns about its own step time, and how its later plans use it.

Every start of a job that trained at least MIN_STEPS steps appends one record to `measured.jsonl` in the run
folder (beside the metrics file): the layout, the ranks per host it ran on, the steady step time (the median
of its steps after the first, which pays for warm-up and compiles), the planner's prediction for the same
layout, and its peak memory (on GPUs the allocator's peak; on CPU ranks the heap the largest rank keeps,
`kept_memory_gib`). Each later plan of the job for the same hosts (the same ranks per host)
reads them back (`for_hosts`) and ranks its candidates (plan/planner.py `learned`) by:
- **measured**, for a layout this job has run on these hosts: the median of its records, not a prediction;
- **corrected**, for the other layouts of a family it has run (the same degrees and data-parallel mode,
  another micro-batch size or recompute): the prediction times the family's median ratio of measured to
  predicted. A family shares every term of the step-time model, so its members most likely share the error;
- **predicted**, for the rest.
So a layout that ran slower than predicted, with its family, gives way at the next re-plan to the best of the
others; if that one measures slower still, the plan after it returns. A job never stays on a layout slower
than another it measured, and tries one it has not run only when its prediction beats every measurement.
What this cannot do is find a better layout that a wrong profile predicts slow: the job never tries it
(benchmarks/planner/learning.py simulates both cases). That needs the profile measured at the job's shapes.

Memory is learned the same way, but only towards safety (plan/planner.py `learned_memory`): a layout the job
ran on these hosts is checked at the memory model's bytes times its own ratio of measured to planned peak (so
one the model's envelope rejects is admitted once a start of ADMIT_STEPS or more has run it, if it fits that
way), and when a layout took more than planned, the other layouts of its family are charged that ratio (the
largest of the family's) and rejected if they then do not fit. A peak below the plan admits nothing the job
has not run: an out-of-memory kill costs a restart and a re-plan, a layout left out costs only its step time.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import NamedTuple

from elastic_trainer.plan.layout import Layout

FILE = "measured.jsonl"
MIN_STEPS = 3
"""Steps a start must train for its step time to be recorded (the first is left out of the median)."""
ADMIT_STEPS = 10
"""Steps a start must have recorded for its peak memory to admit a layout the memory model rejects: CPU ranks'
kept heap still grows over the first steps (gpt3-small dp4 zero1: 1.47x its live peak after 4 steps, 1.74x
after 12; benchmarks/planner/README.md), so a short start's peak could admit a layout a longer one outgrows."""


class Measurement(NamedTuple):
    """What this job measured in one layout on these hosts: the median of its starts' steady step times, and
    the largest peak memory of a rank any start recorded (None when none did)."""

    layout: Layout
    step_s: float
    memory_gib: float | None = None
    memory_steps: int = 0
    """The most steps a start that recorded a peak trained for (the first included)."""


def path_for(metrics_file: str | None) -> Path | None:
    """The job's record of measured step times: beside its metrics file (the run folder under the launcher)."""
    return Path(metrics_file).parent / FILE if metrics_file else None


def measured_file_exists(metrics_file: str | None) -> bool:
    """Whether an earlier start of this job recorded a step time (its next plans may then differ from the
    launcher's)."""
    path = path_for(metrics_file)
    return path is not None and path.exists()


def job_key(model: str, global_batch: int, seq_len: int, dtype: str, hardware: str, compiled: bool) -> dict:
    """What must match for a measurement to count: the model, batch, precision, compile and the hardware."""
    return {
        "model": model,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "dtype": dtype,
        "hardware": hardware,
        "compile": compiled,
    }


def record(
    path: Path | None, key: dict, layout: Layout, hosts: tuple[int, ...], records: list[dict], predicted_s: float | None
) -> dict | None:
    """Append this start's steady step time and peak memory to `path`; None when it trained too few
    steps to say."""
    if path is None or len(records) < MIN_STEPS:
        return None
    times = [r["step_time_s"] for r in records[1:]]
    entry = {
        **key,
        "layout": layout.to_dict(),
        "hosts": list(hosts),
        "step_s": statistics.median(times),
        "steps": len(times),
        "predicted_s": predicted_s,
        "peak_memory_gib": records[-1].get("max_memory_gib"),
        "kept_memory_gib": max(
            (r["kept_memory_gib"] for r in records if r.get("kept_memory_gib") is not None), default=None
        ),
    }
    split = [r["phases_s"] for r in records[1:] if isinstance(r.get("phases_s"), dict)]
    if split:  # rank 0's time in each phase of the step (train/loop.py PHASES), the median of each
        entry["phases_s"] = {name: round(statistics.median(p.get(name, 0.0) for p in split), 6) for name in split[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one line, one write: a crash leaves whole lines
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return entry


def _entries(path: Path | None, key: dict, hosts: tuple[int, ...]) -> list[tuple[Layout, dict]]:
    """(layout, record) of every start of this job on hosts of these sizes, in the order they ran."""
    try:
        text = path.read_text() if path is not None and path.exists() else ""
    except (OSError, UnicodeDecodeError):
        return []  # unreadable: plan as if nothing were measured
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            if {k: entry.get(k) for k in key} == key and tuple(entry["hosts"]) == tuple(hosts):
                out.append((Layout(**entry["layout"]), {**entry, "step_s": float(entry["step_s"])}))
        except (ValueError, KeyError, TypeError):
            continue  # a line from another version, or cut short: ignored
    return out


def peak_gib(entry: dict) -> float | None:
    """A start's peak memory per rank: the device allocator's peak on GPUs, the heap the largest rank keeps on
    CPU ranks; None when the record has neither (or a damaged one)."""
    for name in ("peak_memory_gib", "kept_memory_gib"):
        value = entry.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def for_hosts(path: Path | None, key: dict, hosts: tuple[int, ...]) -> tuple[Measurement, ...]:
    """What this job measured in every layout it ran on hosts of these sizes: the median step time of its
    starts, the largest peak memory."""
    seen: dict[Layout, list[dict]] = {}
    for layout, entry in _entries(path, key, hosts):
        seen.setdefault(layout, []).append(entry)
    out = []
    for layout, entries in seen.items():
        sized = [(peak, e) for e in entries if (peak := peak_gib(e)) is not None]
        steps = max((_steps(e) for _, e in sized), default=0)
        out.append(
            Measurement(
                layout, statistics.median(e["step_s"] for e in entries), max((p for p, _ in sized), default=None), steps
            )
        )
    return tuple(out)


def _steps(entry: dict) -> int:
    """Steps a start trained: the recorded ones after the first, and the first."""
    steps = entry.get("steps")
    return steps + 1 if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 0


def phases_for(path: Path | None, key: dict, hosts: tuple[int, ...], layout: Layout) -> tuple[dict, int]:
    """({phase: median seconds over the starts}, starts) of `layout` on these hosts; ({}, 0) when no start
    that ran it recorded its phases."""
    split = []
    for ran, entry in _entries(path, key, hosts):
        try:
            if ran == layout:
                split.append({str(k): float(v) for k, v in entry["phases_s"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # a start before phases were recorded, or a damaged line
    if not split:
        return {}, 0
    return {name: statistics.median(p.get(name, 0.0) for p in split) for name in split[0]}, len(split)


def family(layout: Layout) -> tuple:
    """Layouts that share every term of the step-time model: the same degrees and data-parallel mode."""
    return layout.dp, layout.tp, layout.pp, layout.dp_mode
