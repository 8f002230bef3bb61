"""The dynamic-resources experiment's settings (`benchmarks/dynamic_resources/experiment.toml`): the target job
the clocks are about, the small model the simulated clock trains for real, the hardware profiles, the policies
and their parameters. Every error is a one-line ConfigError naming the file and key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.config import DP_MODES, ConfigError, ModelConfig, load_model_config, read_toml
from elastic_trainer.elastic.schedule import Phase, load_schedule
from elastic_trainer.experiment.policy import DP_ONLY_FROZEN, POLICIES, TENPLEX_TABLE, Policy
from elastic_trainer.plan.layout import parse_degrees

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = PROJECT_ROOT / "benchmarks" / "dynamic_resources" / "experiment.toml"


@dataclass(frozen=True)
class JobSpec:
    """A model and the batch it trains with."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    lr: float = 1e-3
    warmup_steps: int = 0
    seed: int | None = None
    """None: train's default seed."""
    dp_mode: str | None = None
    """Data-parallel mode of every run (None: the layout's own); the small model's losses do not depend on it."""


@dataclass(frozen=True)
class Experiment:
    source: str
    schedule: str
    """Path of the schedule file (time phases)."""
    phases: list[Phase]
    target: JobSpec
    """The job the clocks are about (GPT-3 XL, seq 1024, global batch 128)."""
    small: JobSpec
    """What the simulated clock trains for real, each rank standing for a GPU."""
    gpus_per_host: int
    profiles: tuple[str, ...]
    policies: tuple[str, ...] = POLICIES
    table: dict[int, tuple[int, int, int]] = field(default_factory=lambda: dict(TENPLEX_TABLE))
    frozen: tuple[int, int] = DP_ONLY_FROZEN

    @property
    def durations(self) -> list[float]:
        return [p.duration_s for p in self.phases]

    @property
    def gpus(self) -> list[int]:
        return [p.gpus for p in self.phases]

    def policy(self, name: str) -> Policy:
        return Policy(name, table=self.table, frozen=self.frozen, static_gpus=min(g for g in self.gpus if g))


def _job(table: dict, where: str) -> JobSpec:
    unknown = sorted(set(table) - {"model", "seq_len", "global_batch", "lr", "warmup_steps", "seed", "dp_mode"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        return JobSpec(
            load_model_config(table["model"]),
            int(table["seq_len"]),
            int(table["global_batch"]),
            float(table.get("lr", 1e-3)),
            int(table.get("warmup_steps", 0)),
            int(table["seed"]) if "seed" in table else None,
            _mode(table.get("dp_mode"), where),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing key {e.args[0]!r} (model, seq_len, global_batch)") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _mode(value, where: str) -> str | None:
    if value is not None and value not in DP_MODES:
        raise ConfigError(f"{where}: dp_mode={value!r} is not one of {', '.join(DP_MODES)}")
    return value


def _table(raw: dict, where: str) -> dict[int, tuple[int, int, int]]:
    out = {}
    for gpus, text in raw.items():
        if not (str(gpus).isascii() and str(gpus).isdigit()) or int(gpus) < 1:
            raise ConfigError(f"{where}: key {gpus!r} must be a GPU count")
        degrees = parse_degrees(str(text), f"{where}.{gpus}")
        if degrees[0] * degrees[1] * degrees[2] != int(gpus):
            raise ConfigError(f"{where}: {gpus} = {text!r} does not use {gpus} GPUs")
        out[int(gpus)] = degrees
    return out


def load_experiment(
    path: str | Path | None = None,
    schedule: str | None = None,
    policies: list[str] | None = None,
    profiles: list[str] | None = None,
) -> Experiment:
    """The experiment file (default: the shipped one), with the schedule, policies and profiles overridable."""
    path = Path(path or DEFAULT_CONFIG)
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    raw = dict(read_toml(path))
    where = str(path)
    sched = schedule or str((path.parent / raw.get("schedule", "schedule.json")).resolve())
    phases = load_schedule(sched)
    if any(p.duration_s is None or p.layout is not None for p in phases):
        raise ConfigError(
            f'{sched}: the experiment needs time phases ({{"gpus": N, "duration_s": S}}) '
            "without pinned layouts: the policies choose the layouts"
        )
    pol = raw.get("policies", {})
    names = tuple(policies or pol.get("names", POLICIES))
    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {name!r} (valid: {', '.join(POLICIES)})")
    frozen = parse_degrees(f"1,{pol.get('dp_only', '2,4')}", f"{where}: policies.dp_only (TP,PP)")[1:]
    profs = tuple(profiles or raw.get("profiles", ("h100-80g", "v100-16g")))
    if not profs:
        raise ConfigError(f"{where}: no hardware profiles")
    return Experiment(
        where,
        sched,
        phases,
        _job(raw.get("target", {}), f"{where} [target]"),
        _job(raw.get("small", {}), f"{where} [small]"),
        int(raw.get("gpus_per_host", 8)),
        profs,
        names,
        _table(
            pol.get("tenplex_table", {str(k): ",".join(map(str, v)) for k, v in TENPLEX_TABLE.items()}),
            f"{where}: policies.tenplex_table",
        ),
        frozen,
    )
