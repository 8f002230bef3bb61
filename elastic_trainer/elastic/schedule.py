"""Schedules: the GPU count a job holds over time, as phases.

A schedule file is JSON: a list of phases, or {"phases": [...]}; each phase is {"gpus": N, "steps": K} (the phase ends
after K more optimizer steps) or {"gpus": N, "duration_s": S} (it ends S seconds after it was launched, as a cluster
allocation would), all phases of one kind. A phase may pin its layout, `"layout": "DP,TP,PP"` (and `"micro_batch":
M`), as a hand-written layout table does; without one every start re-plans. A time phase of `"gpus": 0` holds no GPUs:
the job is stopped for its duration (a policy that cannot run on what it was given waits); in a steps schedule
`{"gpus": 0, "steps": 0}` stops the job and starts it again. Steps phases have absolute boundaries: phase i covers
global steps [sum of the steps before it, that plus its own), so a resumed job finds its phase from the checkpoint's
step. `configs/schedules/NAME.json` can be named by NAME.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.config import ConfigError, configs_dir

KEYS = ("gpus", "steps", "duration_s", "layout", "micro_batch")


@dataclass(frozen=True)
class Phase:
    gpus: int
    """GPUs (ranks) the job holds during the phase."""
    steps: int | None = None
    """Optimizer steps of the phase (steps schedules)."""
    duration_s: float | None = None
    """Seconds from the phase's launch to its stop request (time schedules)."""
    layout: tuple[int, int, int] | None = None
    """(dp, tp, pp) pinned for the phase; None: planned at every start."""
    micro_batch: int | None = None
    """Micro-batch pinned with the layout; None: the whole data-parallel share."""

    @property
    def waits(self) -> bool:
        """The phase holds no GPUs: the job is stopped through it."""
        return self.gpus == 0

    def to_dict(self) -> dict:
        out: dict = {"gpus": self.gpus}
        out.update({"steps": self.steps} if self.steps is not None else {"duration_s": self.duration_s})
        if self.layout is not None:
            out["layout"] = ",".join(map(str, self.layout))
        if self.micro_batch is not None:
            out["micro_batch"] = self.micro_batch
        return out


def _int(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}={value!r} must be a {'positive' if minimum else 'non-negative'} integer")
    return value


def _pinned(entry: dict, gpus: int, where: str) -> dict:
    """The phase's layout and micro-batch, checked against its GPU count."""
    from elastic_trainer.plan.layout import parse_degrees

    out: dict = {}
    if "layout" in entry:
        if not isinstance(entry["layout"], str):
            raise ConfigError(f'{where}: layout={entry["layout"]!r} must be a string "DP,TP,PP"')
        dp, tp, pp = out["layout"] = parse_degrees(entry["layout"], f"{where}: layout")
        if dp * tp * pp != gpus:
            raise ConfigError(f"{where}: layout {entry['layout']} has {dp * tp * pp} GPUs, the phase {gpus}")
    if "micro_batch" in entry:
        if "layout" not in entry:
            raise ConfigError(f"{where}: micro_batch needs a layout in the same phase")
        out["micro_batch"] = _int(entry["micro_batch"], f"{where}: micro_batch")
    return out


def _phase(entry, where: str) -> Phase:
    if not isinstance(entry, dict):
        raise ConfigError(f'{where} must be an object like {{"gpus": 8, "steps": 100}}, not {entry!r}')
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (valid: {', '.join(KEYS)})")
    if "gpus" not in entry or ("steps" in entry) == ("duration_s" in entry):
        raise ConfigError(f'{where} needs "gpus" and exactly one of "steps" or "duration_s"')
    gpus = _int(entry["gpus"], f"{where}: gpus", minimum=0)
    if gpus == 0 and "layout" in entry:
        raise ConfigError(f"{where}: a phase of 0 GPUs (the job waits) has no layout")
    pinned = _pinned(entry, gpus, where)
    if "steps" in entry:
        steps = _int(entry["steps"], f"{where}: steps", minimum=0)
        if (gpus == 0) != (steps == 0):
            raise ConfigError(
                f"{where}: a steps phase of 0 GPUs (the job stops and starts again) has steps=0, "
                f"and only such a phase: gpus={gpus}, steps={steps}"
            )
        return Phase(gpus, steps=steps, **pinned)
    seconds = entry["duration_s"]
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{where}: duration_s={seconds!r} must be a positive number of seconds")
    return Phase(gpus, duration_s=float(seconds), **pinned)


def parse_schedule(data, source: str = "schedule") -> list[Phase]:
    """Phases of a decoded schedule; ConfigError (one line naming the phase) on anything else."""
    entries = data.get("phases") if isinstance(data, dict) else data
    if isinstance(data, dict) and set(data) - {"phases", "comment"}:
        unknown = sorted(set(data) - {"phases", "comment"})
        raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} (valid: phases, comment)")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f'{source}: expected a non-empty list of phases (or {{"phases": [...]}})')
    phases = [_phase(e, f"{source}: phase {i + 1}") for i, e in enumerate(entries)]
    if len({p.steps is None for p in phases}) > 1:
        raise ConfigError(f'{source}: phases mix "steps" and "duration_s"; use one kind')
    if all(p.waits for p in phases):
        raise ConfigError(f"{source}: every phase has 0 GPUs; nothing would train")
    return phases


def dump_schedule(phases: list[Phase], comment: str = "") -> str:
    """A schedule file's text (readable by `load_schedule`)."""
    data = (
        {"comment": comment, "phases": [p.to_dict() for p in phases]}
        if comment
        else {"phases": [p.to_dict() for p in phases]}
    )
    return json.dumps(data, indent=1) + "\n"


def same_run(a: Phase, b: Phase) -> bool:
    """Consecutive phases one start of the job can run through: the same GPUs and the same pinned layout."""
    return not a.waits and (a.gpus, a.layout, a.micro_batch) == (b.gpus, b.layout, b.micro_batch)


def run_end(phases: list[Phase], index: int) -> int:
    """The last phase that the start at phase `index` runs through (consecutive phases of `same_run`)."""
    end = index
    while end + 1 < len(phases) and same_run(phases[end], phases[end + 1]):
        end += 1
    return end


def schedule_path(name_or_path: str) -> Path:
    """A schedule file, or the preset configs/schedules/NAME.json."""
    path = Path(name_or_path)
    if path.suffix or path.exists():
        return path
    return configs_dir() / "schedules" / f"{name_or_path}.json"


def load_schedule(name_or_path: str) -> list[Phase]:
    path = schedule_path(name_or_path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        presets = sorted(p.stem for p in (configs_dir() / "schedules").glob("*.json"))
        raise ConfigError(
            f"schedule {name_or_path!r} does not exist (a JSON file, or one of: {', '.join(presets) or 'none'})"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"schedule {str(path)!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"schedule {str(path)!r} is not valid JSON: {e.msg} (line {e.lineno})") from None
    return parse_schedule(data, str(path))


def step_ends(phases: list[Phase]) -> list[int]:
    """The global step at which each phase of a steps schedule ends."""
    ends, total = [], 0
    for phase in phases:
        total += phase.steps
        ends.append(total)
    return ends


def phase_at(phases: list[Phase], step: int) -> int | None:
    """Index of the steps-schedule phase that global step `step` (0-based, the next to run) falls in;
    None when the schedule ends at or before it."""
    return next((i for i, end in enumerate(step_ends(phases)) if step < end), None)
