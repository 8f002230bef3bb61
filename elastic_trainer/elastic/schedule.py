"""Schedules: the GPU count a job holds over time, as phases.

A schedule file is JSON: a list of phases, or {"phases": [...]}; each phase is {"gpus": N, "steps": K}
(the phase ends after K more optimizer steps) or {"gpus": N, "duration_s": S} (it ends S seconds after it
was launched, as a cluster allocation would), all phases of one kind. Steps phases have absolute boundaries:
phase i covers global steps [sum of the steps before it, that plus its own), so a resumed job finds its
phase from the checkpoint's step. `configs/schedules/NAME.json` can be named by NAME.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.config import ConfigError, configs_dir

KEYS = ("gpus", "steps", "duration_s")


@dataclass(frozen=True)
class Phase:
    gpus: int
    """GPUs (ranks) the job holds during the phase."""
    steps: int | None = None
    """Optimizer steps of the phase (steps schedules)."""
    duration_s: float | None = None
    """Seconds from the phase's launch to its stop request (time schedules)."""


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}={value!r} must be a positive integer")
    return value


def _phase(entry, where: str) -> Phase:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object like {{\"gpus\": 8, \"steps\": 100}}, not {entry!r}")
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (valid: {', '.join(KEYS)})")
    if "gpus" not in entry or ("steps" in entry) == ("duration_s" in entry):
        raise ConfigError(f"{where} needs \"gpus\" and exactly one of \"steps\" or \"duration_s\"")
    gpus = _int(entry["gpus"], f"{where}: gpus")
    if "steps" in entry:
        return Phase(gpus, steps=_int(entry["steps"], f"{where}: steps"))
    seconds = entry["duration_s"]
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ConfigError(f"{where}: duration_s={seconds!r} must be a positive number of seconds")
    return Phase(gpus, duration_s=float(seconds))


def parse_schedule(data, source: str = "schedule") -> list[Phase]:
    """Phases of a decoded schedule; ConfigError (one line naming the phase) on anything else."""
    entries = data.get("phases") if isinstance(data, dict) else data
    if isinstance(data, dict) and set(data) - {"phases", "comment"}:
        unknown = sorted(set(data) - {"phases", "comment"})
        raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} (valid: phases, comment)")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: expected a non-empty list of phases (or {{\"phases\": [...]}})")
    phases = [_phase(e, f"{source}: phase {i + 1}") for i, e in enumerate(entries)]
    if len({p.steps is None for p in phases}) > 1:
        raise ConfigError(f"{source}: phases mix \"steps\" and \"duration_s\"; use one kind")
    return phases


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
        raise ConfigError(f"schedule {name_or_path!r} does not exist (a JSON file, or one of: "
                          f"{', '.join(presets) or 'none'})") from None
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
