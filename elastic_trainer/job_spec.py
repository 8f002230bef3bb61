"""The job spec: one frozen, JSON-serializable description of a training job, built and checked once by whoever
starts the job, and the only thing a rank reads.

    elastic-trainer launch    -> JobSetup builds it (every phase planned for its hosts) and writes RUN_DIR/job.json
    elastic-trainer torchrun  -> built once per host before its agent starts, handed to the workers as a file
    elastic-trainer train     -> built in the process (under plain torchrun: in every rank, from its flags)

A rank gets `--job PATH [--phase N]` (elastic_trainer.rank) and never the original flags. What the spec says
about a phase's layout is a plan made where the job was described, for the hosts it placed and the job's
hardware profile; rank 0 takes it when the hosts it really got are those (any order) and plans again only
when they differ (a lost host, another allocation) or the hardware was left to detection on the hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.config import CheckpointConfig, ConfigError, ModelConfig, TrainConfig, from_dict
from elastic_trainer.plan.hardware import Hardware
from elastic_trainer.plan.layout import Layout

SPEC_VERSION = 1
JOB_FILE = "job.json"
USE_GPUS = ("all", "fastest")
"""How many of the GPUs a start holds it trains on. all (default): every GPU some layout can use (all of them
when a layout fits, else the largest count that one does, the rest idle). fastest: the count the step-time
model predicts fastest, which may leave GPUs idle that a layout could use."""


@dataclass(frozen=True)
class LayoutSettings:
    """The layout settings the user fixed (None: left to the planner)."""

    degrees: tuple[int, int, int] | None = None
    """dp, tp, pp from --layout or the run config's [layout]."""
    micro_batch: int | None = None
    dp_mode: str | None = None
    recompute: bool | None = None
    source: str = ""
    """Where the degrees came from, as the user typed it ("--layout 2,1,2", "[layout] of run.toml")."""
    fixed: str = ""
    """The settings that narrow the planner's search, as typed (for its errors)."""

    @classmethod
    def from_json(cls, values: dict) -> LayoutSettings:
        degrees = values.get("degrees")
        return cls(**{**values, "degrees": tuple(degrees) if degrees else None})


@dataclass(frozen=True)
class PhaseSpec:
    """One start of the job's processes: a schedule phase (or the whole job without a schedule)."""

    index: int | None = None
    """Schedule phase (None: no schedule)."""
    until_step: int | None = None
    """Stop (saving) after this global step; None: the run's last step."""
    hosts: tuple[int, ...] | None = None
    """Ranks per host where the job was described (None: learnt at start)."""
    layout: Layout | None = None
    """The layout planned (or pinned) for `hosts`; None: rank 0 plans at start."""
    pinned: bool = False
    """The schedule or the flags fixed `layout`: it is taken whatever the hosts."""
    plan_line: str = ""
    """The plan's one line where it was made (what a single `train` process prints)."""

    @classmethod
    def from_json(cls, values: dict) -> PhaseSpec:
        layout, hosts = values.get("layout"), values.get("hosts")
        return cls(
            **{
                **values,
                "layout": Layout.from_dict(layout) if layout else None,
                "hosts": tuple(hosts) if hosts else None,
            }
        )


@dataclass(frozen=True)
class JobSpec:
    model: ModelConfig
    train: TrainConfig
    checkpoint: CheckpointConfig | None
    layout: LayoutSettings
    hardware: Hardware | None
    """The profile the job plans with; None: detected on the hosts at start (rank 0's device)."""
    use_gpus: str = "all"
    events_file: str | None = None
    stop_file: str | None = None
    phases: tuple[PhaseSpec, ...] = (PhaseSpec(),)
    built_by: str = "train"
    """Which command described the job: launch, torchrun or train."""
    prepared_data: tuple[str, ...] = ()
    """Where the describer prepared (or found) the training tokens: prepared datasets and token files the ranks
    read as they are, without the raw files (empty: the ranks resolve `train.data`)."""
    prepared_val: tuple[str, ...] = ()
    """The same for the validation data (empty: none, or `train.val_fraction` of the training data)."""

    def __post_init__(self) -> None:
        if self.use_gpus not in USE_GPUS:
            raise ConfigError(f"--use-gpus {self.use_gpus!r} is not one of {', '.join(USE_GPUS)}")
        if not self.phases:
            raise ConfigError("a job spec needs at least one phase")

    def phase(self, index: int | None) -> PhaseSpec:
        """The phase a start runs: schedule phase `index`, or the only one."""
        if index is None:
            return self.phases[0]
        for p in self.phases:
            if p.index == index:
                return p
        raise ConfigError(f"the job spec has no phase {index} (phases: {', '.join(str(p.index) for p in self.phases)})")

    # -- JSON ------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"version": SPEC_VERSION, **dataclasses.asdict(self)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = JOB_FILE) -> JobSpec:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not JSON ({e})") from None
        if not isinstance(values, dict) or values.pop("version", None) != SPEC_VERSION:
            raise ConfigError(
                f"{where} is not a version-{SPEC_VERSION} job spec (written by another version of "
                "elastic_trainer? start the job again with this one)"
            )
        try:
            return cls._from_values(values, where)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"{where} is not a complete job spec ({type(e).__name__}: {e}); start the job again to write it"
            ) from None

    @classmethod
    def _from_values(cls, values: dict, where: str) -> JobSpec:
        hw, ckpt = values.get("hardware"), values.get("checkpoint")
        if hw is not None:
            hw = from_dict(Hardware, {**hw, "device_names": tuple(hw.get("device_names", ()))}, f"{where} hardware")
        return cls(
            model=from_dict(ModelConfig, values["model"], f"{where} model"),
            train=from_dict(TrainConfig, values["train"], f"{where} train"),
            checkpoint=from_dict(CheckpointConfig, ckpt, f"{where} checkpoint") if ckpt else None,
            layout=LayoutSettings.from_json(values["layout"]),
            hardware=hw,
            use_gpus=values["use_gpus"],
            events_file=values["events_file"],
            stop_file=values["stop_file"],
            phases=tuple(PhaseSpec.from_json(p) for p in values["phases"]),
            built_by=values["built_by"],
            prepared_data=tuple(values.get("prepared_data", ())),
            prepared_val=tuple(values.get("prepared_val", ())),
        )

    def write(self, path: str | os.PathLike) -> Path:
        """Atomically (a reader sees the old spec or the new one, never half of one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> JobSpec:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(
                f"cannot read the job spec {str(path)!r} ({e.strerror}); the launcher writes it into "
                "its --run-dir, which every host must see"
            ) from None
        return cls.from_json(text, str(path))
