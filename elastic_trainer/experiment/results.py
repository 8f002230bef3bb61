"""The experiment's outputs: one CSV per policy and profile, `summary.json`, one Fig. 9-like plot per profile.

A CSV row is one step: `time_s` (the clock's time at its end: simulated or wall, seconds from the start of the
schedule), `step`, `loss` (trained for real), `gpus` (held), `ranks` (used), `layout` (what the policy chose
for the target), `ran_as` (the layout the step really ran in), `downtime_s` (the reconfiguration time just
before the step under the clock: modelled for the simulated clock, measured for the real one) and
`measured_downtime_s` (what the reconfiguration before the step took on the machine that trained it).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.events import EVENTS_FILE, read_jsonl
from elastic_trainer.elastic.report import effective, segments
from elastic_trainer.experiment.policy import Choice
from elastic_trainer.plan.layout import Layout

COLUMNS = ("time_s", "step", "loss", "gpus", "ranks", "layout", "ran_as", "downtime_s", "measured_downtime_s")


def choice_text(choice: Choice) -> str:
    c = choice.candidate
    if c is None:
        return "waits"
    return c.layout.compact()


def run_records(run_dir: Path) -> tuple[dict[int, dict], dict[int, float], list[dict]]:
    """A run's effective step records by step, the measured downtime before each segment's first step (wait
    phases taken out) and its events."""
    records = effective(read_jsonl(run_dir / "metrics.jsonl"))
    events = read_jsonl(run_dir / EVENTS_FILE)
    waits = [(e["time"], e["time"] + (e.get("duration_s") or 0.0)) for e in events if e["event"] == "waiting"]
    gaps = {}
    segs = segments(records)
    for before, after in zip(segs, segs[1:]):
        gap = after.start - before.end
        gap -= sum(max(0.0, min(b, after.start) - max(a, before.end)) for a, b in waits)
        gaps[after.records[0]["step"]] = round(max(0.0, gap), 3)
    return {r["step"]: r for r in records}, gaps, events


def simulated_rows(run_dir: Path, choices: list[Choice], timeline) -> list[dict]:
    """Rows of a simulated-clock run: the timeline's times, the run's losses."""
    records, measured, _ = run_records(run_dir)
    rows = []
    for s in timeline.steps:
        r = records.get(s.step)
        if r is None:
            raise ConfigError(
                f"{run_dir}: step {s.step} was not trained (the run's last is "
                f"{max(records, default=0)}); see {run_dir / 'launch.log'}"
            )
        c = choices[s.phase]
        rows.append(
            {
                "time_s": round(s.time_s, 3),
                "step": s.step,
                "loss": r["loss"],
                "gpus": c.held,
                "ranks": c.used,
                "layout": choice_text(c),
                "ran_as": Layout.from_dict(r["layout"]).compact(),
                "downtime_s": round(s.downtime_s, 3),
                "measured_downtime_s": measured.get(s.step, 0.0),
            }
        )
    return rows


def real_rows(run_dir: Path, choices: list[Choice], durations: list[float]) -> list[dict]:
    """Rows of a real-clock run: wall time from the first launch, measured downtime under both columns; a
    step's GPUs and chosen layout are those of the schedule's phase at its time (one start may run through
    several phases)."""
    records, measured, events = run_records(run_dir)
    launched = [e["time"] for e in events if e["event"] in ("launched", "waiting")]
    if not launched or not records:
        raise ConfigError(f"{run_dir}: the run trained nothing; see {run_dir / 'launch.log'}")
    t0 = min(launched)
    ends = [sum(durations[: i + 1]) for i in range(len(durations))]
    rows = []
    for step in sorted(records):
        r = records[step]
        at = r["time"] - t0
        c = choices[next((i for i, end in enumerate(ends) if at < end), len(ends) - 1)]
        rows.append(
            {
                "time_s": round(at, 3),
                "step": step,
                "loss": r["loss"],
                "gpus": c.held,
                "ranks": r["world_size"],
                "layout": choice_text(c),
                "ran_as": Layout.from_dict(r["layout"]).compact(),
                "downtime_s": measured.get(step, 0.0),
                "measured_downtime_s": measured.get(step, 0.0),
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [
            {
                k: (v if k in ("layout", "ran_as") else float(v) if "." in v or "e" in v else int(v))
                for k, v in row.items()
            }
            for row in csv.DictReader(f)
        ]


def common_step(rows: dict[str, list[dict]]) -> int:
    """The largest step every policy reached."""
    return min((r[-1]["step"] if r else 0) for r in rows.values())


def summarize(rows: dict[str, list[dict]], ideal: dict[str, int], clock: str) -> dict[str, dict]:
    """Per policy: steps, ideal_steps, time_to_common_step_s, downtime_s, final_loss, clock."""
    common = common_step(rows)
    out = {}
    for name, r in rows.items():
        at = next((row["time_s"] for row in r if row["step"] == common), None)
        out[name] = {
            "steps": r[-1]["step"] if r else 0,
            "ideal_steps": ideal[name],
            "time_to_common_step_s": at if common else None,
            "downtime_s": round(sum(row["downtime_s"] for row in r), 3),
            "final_loss": r[-1]["loss"] if r else None,
            "clock": clock,
            "measured_downtime_s": round(sum(row["measured_downtime_s"] for row in r), 3),
        }
    return out


def loss_match(rows: list[dict], reference: list[dict]) -> dict:
    """The largest relative difference of per-step losses over the steps both runs trained."""
    ref = {r["step"]: r["loss"] for r in reference}
    diffs = [abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]) for r in rows if r["step"] in ref]
    return {"steps_compared": len(diffs), "max_rel_diff": max(diffs) if diffs else None}


def plot(path: Path, title: str, rows: dict[str, list[dict]], durations: list[float], gpus: list[int]) -> None:
    """Loss against time for every policy; the GPUs held as a step line underneath (Fig. 9's form)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, r in rows.items():
        top.plot(
            [row["time_s"] / 60 for row in r],
            [row["loss"] for row in r],
            label=f"{name} ({r[-1]['step'] if r else 0} steps)",
            marker="." if len(r) < 60 else None,
            lw=1.3,
        )
    edges = [0.0]
    for d in durations:
        edges.append(edges[-1] + d)
    bottom.step([e / 60 for e in edges], [*gpus, gpus[-1]], where="post", color="k")
    top.set_ylabel("training loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel("GPUs")
    bottom.set_ylim(0, max(gpus) * 1.15)
    bottom.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=1) + "\n")
