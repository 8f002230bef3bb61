"""From a run's metrics and events: the trajectory that counts, the phase table, the downtime of every
reconfiguration (with where it went), the exactly-once check, and the loss plot.

A rank that dies after its last checkpoint leaves step records that the restart redoes; the later record of
a step replaces the earlier ones (`effective`). A *segment* is a run of effective steps trained by one start of
the job (one phase, one torchrun restart, one launch: rank 0 tags its records with an id of its start, so a
crashed job resumed with the same phase, restart count and layout is a segment of its own); the gap between
two segments is a reconfiguration's (or a crash's) downtime: from the end of the last step kept before it to
the start of the first step after it. A segment that begins by training again steps an earlier start had
trained (it resumed from an older checkpoint) counts them as `redone`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_trainer.plan.layout import Layout

# Stages of a reconfiguration, each ending at the named event (see elastic.events): a planned one saves, exits
# and is launched again; a failure is detected by a surviving agent, which restarts its workers. Both then pass
# the rendezvous (the agents'), start (workers up, process group formed) and setup (plan, build, load).
STAGES = (
    ("save_s", "saved"),
    ("exit_s", "exited"),
    ("relaunch_s", "launched"),
    ("detect_s", "workers_restarting"),
    ("rendezvous_s", "rendezvous_done"),
    ("start_s", "processes_up"),
    ("setup_s", "state_loaded"),
)
# A planned event through a warm start (the next world was started beside the old one): the old world writes
# its state into memory (save), the next world, if not ready yet, finishes its start (wait), reads the state
# (handover) and sets up (setup).
WARM_STAGES = (
    ("save_s", "saved"),
    ("wait_s", "next_world_ready"),
    ("handover_s", "handover_done"),
    ("setup_s", "state_loaded"),
)
PART_NAMES = {
    "save_s": "save",
    "exit_s": "exit",
    "relaunch_s": "relaunch",
    "detect_s": "detect",
    "rendezvous_s": "rendezvous",
    "start_s": "start",
    "setup_s": "setup",
    "wait_s": "wait",
    "handover_s": "hand-over",
}


def effective(records: list[dict]) -> list[dict]:
    """Step records in file order, each step's last record winning (steps redone after a restart)."""
    kept: list[dict] = []
    for r in records:
        while kept and kept[-1]["step"] >= r["step"]:
            kept.pop()
        kept.append(r)
    return kept


def samples_consumed_once(records: list[dict]) -> bool:
    """Whether the effective steps tile one contiguous range of global samples, with no gap and no overlap
    (from the first record's start: a caller that needs [0, n) checks the start too)."""
    position = records[0]["samples"][0] if records else 0
    for r in records:
        start, stop = r["samples"]
        if start != position:
            return False
        position = stop
    return True


@dataclass
class Segment:
    phase: int | None
    restart: int | None
    world_size: int
    layout: dict
    start_id: str | None = None
    """The id rank 0 gave its start (None in records written before starts had one)."""
    records: list[dict] = field(default_factory=list)
    redone: int = 0
    """Steps this segment trained again: an earlier start had trained them after the checkpoint it resumed."""
    trained_until: float | None = None
    """When the last step before the next segment ended, kept or not (a crash's lost steps still ran)."""

    @property
    def start(self) -> float:
        first = self.records[0]  # an evaluation after a step ends before its record's time
        return first["time"] - first["step_time_s"] - first.get("eval_time_s", 0.0)

    @property
    def end(self) -> float:
        return self.trained_until if self.trained_until is not None else self.records[-1]["time"]


def segments(records: list[dict]) -> list[Segment]:
    before: dict[int, tuple[int, float | None]] = {}  # id of a record -> (highest step, last time) before it
    highest, last = 0, None
    for r in records:
        before[id(r)] = (highest, last)
        highest, last = max(highest, r["step"]), r["time"]
    out: list[Segment] = []
    for r in effective(records):
        key = (r.get("phase"), r.get("restart"), r["world_size"], r["layout"], r.get("start"))
        if not out or (out[-1].phase, out[-1].restart, out[-1].world_size, out[-1].layout, out[-1].start_id) != key:
            trained, ended = before[id(r)]
            if out:
                out[-1].trained_until = ended
            out.append(Segment(*key, redone=max(0, trained - r["step"] + 1)))
        out[-1].records.append(r)
    return out


def downtime(before: Segment, after: Segment, events: list[dict]) -> dict:
    """The gap between two segments, when no step ran (steps redone after it are counted apart, in
    `after.redone`), and its stages (seconds; None where the event was not recorded)."""
    window = [e for e in events if before.end <= e["time"] <= after.records[0]["time"]]
    from_memory = any(e["event"] == "handover_done" for e in window)
    # a restart after a failure may read a snapshot in memory: it is still a restart, not a warm start
    warm = from_memory and not any(e["event"] == "workers_restarting" for e in window)
    out: dict = {"downtime_s": after.start - before.end, "warm": warm}
    if not warm:
        loaded = next((e for e in window if e["event"] == "state_loaded"), None)
        out["source"] = "memory" if from_memory else "disk" if loaded and loaded.get("load") else None
    last = before.end
    for name, event in WARM_STAGES if warm else STAGES:
        hit = next((e for e in window if e["event"] == event and e["time"] >= last), None)
        out[name] = None if hit is None else hit["time"] - last
        last = hit["time"] if hit is not None else last
        if event == "state_loaded" and hit is not None and hit.get("load"):
            out["load_s"] = hit["load"]["total_s"]
        if event == "handover_done" and hit is not None:
            out["load_s"], out["handover"] = hit["handover"]["total_s"], hit["handover"]
    out["first_step_s"] = after.records[0]["step_time_s"]
    return out


def parts(gap: dict) -> str:
    """The downtime's parts in one short string: "memory: save 0.29 + hand-over 0.64 + setup 0.01" (a warm
    start) or "restart: save 0.30 + exit 0.43 + ... , from disk" (the stages recorded, in order, and where a
    restart's state came from: a snapshot in memory or a checkpoint on disk)."""
    named = [
        f"{PART_NAMES[k]} {gap[k]:.2f}"
        for k, _ in (WARM_STAGES if gap.get("warm") else STAGES)
        if gap.get(k) is not None
    ]
    source = {"memory": ", from memory", "disk": ", from disk"}.get(gap.get("source"), "")
    return ("memory: " if gap.get("warm") else "restart: ") + " + ".join(named) + source


def _resumed(before: Segment, after: Segment) -> bool:
    """A new start of the same phase and restart count: the job was started again (a crash, then --resume)."""
    return (before.phase, before.restart) == (after.phase, after.restart) and before.start_id != after.start_id


def _reformed(before: Segment, after: Segment, events: list[dict] | None) -> bool:
    """A new start of the same phase because the job's hosts changed (a notice, an edit of the hosts file)."""
    return any(e["event"] == "hosts_changed" and before.start <= e["time"] <= after.start for e in events or ())


def _unplanned(before: Segment, after: Segment, events: list[dict] | None = None) -> bool:
    """The gap was a failure's, not a schedule's: a torchrun restart, a resumed job, or steps trained twice."""
    return (
        after.redone > 0
        or (_resumed(before, after) and not _reformed(before, after, events))
        or (after.phase == before.phase and after.restart != before.restart)
    )


def phase_rows(records: list[dict], events: list[dict]) -> list[dict]:
    """One row per segment: phase, ranks, layout, steps, loss at its end, downtime before it."""
    segs = segments(records)
    rows = []
    for i, seg in enumerate(segs):
        gap = downtime(segs[i - 1], seg, events) if i else None
        reformed = bool(i) and _reformed(segs[i - 1], seg, events)
        resumed = bool(i) and _resumed(segs[i - 1], seg) and not reformed
        rows.append(
            {
                "phase": seg.phase,
                "restart": seg.restart,
                "resumed": resumed,
                "reformed": reformed,
                "ranks": seg.world_size,
                "layout": Layout.from_dict(seg.layout).compact(),
                "steps": (seg.records[0]["step"], seg.records[-1]["step"]),
                "loss": seg.records[-1]["loss"],
                "downtime": gap,
                "redone": seg.redone,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    if not rows:
        return "(no steps recorded)"
    head = (
        "phase",
        "ranks",
        "layout",
        "steps",
        "loss at end",
        "downtime s",
        "of which load s",
        "steps redone",
        "downtime parts s",
    )
    table = []
    for r in rows:
        gap = r["downtime"]
        phase = "-" if r["phase"] is None else str(r["phase"] + 1)
        if r["restart"]:
            phase += f" (restart {r['restart']})"
        if r.get("resumed"):
            phase += " (resumed)"
        if r.get("reformed"):
            phase += " (new hosts)"
        table.append(
            (
                phase,
                str(r["ranks"]),
                r["layout"],
                f"{r['steps'][0]}-{r['steps'][1]}",
                f"{r['loss']:.4f}",
                "-" if gap is None else f"{gap['downtime_s']:.1f}",
                "-" if not gap or gap.get("load_s") is None else f"{gap['load_s']:.2f}",
                str(r.get("redone", 0)) if gap else "-",
                parts(gap) if gap else "-",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in table]
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str = "", events: list[dict] | None = None) -> str:
    """Loss against step and against time, the validation loss (markers) where records have one, the rank
    count underneath; downtime shaded and, with the run's `events`, its parts written beside it. Returns
    `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segs = segments(records)
    t0 = segs[0].start
    fig, axes = plt.subplots(2, 2, figsize=(11, 5.5), sharex="col", gridspec_kw={"height_ratios": [3, 1]})
    for seg in segs:
        steps = [r["step"] for r in seg.records]
        times = [(r["time"] - t0) / 60 for r in seg.records]
        losses = [r["loss"] for r in seg.records]
        evaluated = [i for i, r in enumerate(seg.records) if "val_loss" in r]
        for col, xs in ((0, steps), (1, times)):
            axes[0, col].plot(xs, losses, color="C0", label="train")
            axes[0, col].plot(
                [xs[i] for i in evaluated],
                [seg.records[i]["val_loss"] for i in evaluated],
                "o",
                color="C2",
                ms=4,
                label="validation",
            )
            axes[1, col].step(xs, [seg.world_size] * len(xs), where="post", color="C1")
    for a, b in zip(segs, segs[1:]):
        failure = _unplanned(a, b, events)
        axes[0, 1].axvspan((a.end - t0) / 60, (b.start - t0) / 60, color="mistyrose" if failure else "0.85")
        axes[1, 1].plot([(a.end - t0) / 60, (b.start - t0) / 60], [0, 0], color="C3", lw=4)
        gap = downtime(a, b, events) if events is not None else None
        if gap is not None:  # where the downtime went, beside its span
            axes[0, 1].annotate(
                parts(gap).replace(": ", ":\n").replace(" + ", "\n"),
                ((b.start - t0) / 60, 1.0),
                xycoords=("data", "axes fraction"),
                va="top",
                ha="left",
                fontsize=6,
                color="0.3",
            )
        if failure:  # where the trajectory went on after the failure, and what it trained twice
            first = b.records[0]["step"]
            axes[0, 0].axvline(first - 0.5, color="C3", ls=":", lw=1)
            axes[0, 0].annotate(
                f"restart, {b.redone} redone" if b.redone else "restart",
                (first - 0.5, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="C3",
            )
    axes[0, 0].set_ylabel("loss")
    if any("val_loss" in r for r in records):  # one legend entry each, not one per segment
        handles, labels = axes[0, 0].get_legend_handles_labels()
        axes[0, 0].legend(handles[:2], labels[:2], fontsize=8)
    axes[1, 0].set_ylabel("ranks")
    axes[1, 0].set_xlabel("step (red: a restart after a failure)")
    axes[1, 1].set_xlabel("minutes (grey: reconfiguration; red: failure)")
    for ax in axes[1]:
        ax.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_lines(run_dir, title: str) -> list[str]:
    """What the launcher says at the end of a job: the phase table and where the loss plot went (nothing
    before the first metrics)."""
    from elastic_trainer.elastic.events import EVENTS_FILE, read_jsonl

    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        return []
    events = read_jsonl(run_dir / EVENTS_FILE)
    lines = ["phases:\n" + format_rows(phase_rows(records, events))]
    try:
        lines.append(f"loss plot: {plot(records, str(run_dir / 'loss.png'), title, events)}")
    except ImportError:
        lines.append("loss plot skipped: matplotlib is not installed")
    return lines
