"""What a train job checks before its process group forms and before it creates or changes a file.

`resolve` turns flags and config files into a checked job spec; this module checks the rest of a job's
inputs, in the order that creates nothing until everything cheaper has passed:

1. the environment variables the job reads (torchrun's, and ours);
2. the paths it will write (metrics, events, checkpoints): not a folder where a file goes or the reverse,
   and a writable place to create them;
3. the checkpoint it would resume: its meta.json read and compared with the run's model and trajectory;
4. the data: every text file opened and sampled (`data.read.sample`), then the corpus prepared once (the
   only step that writes, into the data cache, and only complete shards), then the checkpoint's data compared
   with it by content.

Every failure is a one-line ConfigError (or CheckpointError) naming the flag, file or variable.
"""

from __future__ import annotations

import os
from pathlib import Path

from elastic_trainer.config import CheckpointConfig, CheckpointError, ConfigError, ModelConfig, TrainConfig
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.job_spec import JobSpec

WORKER_START_VALUES = ("fork", "spawn")


def check_environment() -> TorchrunEnv:
    """torchrun's variables (all or none of RANK and WORLD_SIZE; ranks in range; a port), read once into the
    object the rank uses, and ours."""
    env = os.environ
    torchrun = TorchrunEnv.read()
    start = env.get("ELASTIC_TRAINER_WORKER_START")
    if start is not None and start not in WORKER_START_VALUES:
        raise ConfigError(
            f"environment variable ELASTIC_TRAINER_WORKER_START={start!r} is not one of "
            f"{', '.join(WORKER_START_VALUES)}"
        )
    configs = env.get("ELASTIC_TRAINER_CONFIGS")
    if configs is not None and not Path(configs).is_dir():
        raise ConfigError(
            f"environment variable ELASTIC_TRAINER_CONFIGS={configs!r} is not a folder "
            "(valid: a folder with models/, hardware/, runs/)"
        )
    cache = env.get("ELASTIC_TRAINER_CACHE")
    if cache:
        check_dir_target(cache, "environment variable ELASTIC_TRAINER_CACHE")
    return torchrun


def _creatable(path: Path, what: str) -> None:
    """`path` does not exist yet: its nearest existing ancestor must be a folder this process can write."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(parent)!r} is not writable")


def check_file_target(path: str | os.PathLike, what: str) -> None:
    """A file the job appends to: an existing writable file, or creatable. Creates nothing."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder (valid: a file path)")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{what} {str(path)!r} is not writable")
        return
    _creatable(path, what)


def check_dir_target(path: str | os.PathLike, what: str) -> None:
    """A folder the job writes into: an existing writable folder, or creatable. Creates nothing."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a file, not a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} {str(path)!r} is not writable")
        return
    _creatable(path, what)


def resume_meta(ckpt: CheckpointConfig) -> tuple[Path, dict] | None:
    """The checkpoint this run would resume and its meta.json, read without a process group: the given folder
    (--resume PATH), else the newest complete one whose meta.json reads (a newer one that does not is skipped
    at load time too, with its reason; when none reads, an error)."""
    from elastic_trainer.checkpoint import storage

    if ckpt.resume == "never":
        return None
    if ckpt.resume != "auto":
        folder = Path(ckpt.resume)
        if not (folder / storage.META).is_file() or not (folder / storage.MANIFEST).is_file():
            raise CheckpointError(
                f"--resume {ckpt.resume!r} is not a complete checkpoint folder (it has no "
                f"{storage.META} and {storage.MANIFEST}; valid: a step-NNNNNNNN folder)"
            )
        return folder, storage.read_meta(folder)
    errors = []
    for folder in storage.complete_checkpoints(ckpt.dir):
        try:
            return folder, storage.read_meta(folder)
        except CheckpointError as err:
            errors.append(str(err))
    if errors:  # the loader refuses too
        raise storage.none_resumable(ckpt.dir, errors)
    return None


def check_checkpoint(
    ckpt: CheckpointConfig | None, model: ModelConfig, train: TrainConfig, data_id: str | None = None
) -> int:
    """The checkpoint folder is usable and what this run would resume matches its model, trajectory and data
    (by content, with `data_id`); the step it would resume from (0: none)."""
    if ckpt is None:
        return 0
    check_dir_target(ckpt.dir, "--checkpoint-dir")
    if ckpt.resume == "never":
        from elastic_trainer.checkpoint.storage import require_no_checkpoints

        require_no_checkpoints(ckpt.dir)
    found = resume_meta(ckpt)
    if found is None:
        return 0
    folder, meta = found
    from elastic_trainer.checkpoint.state import check_compatible

    check_compatible(meta, model, train, str(folder), data_id)
    return int(meta["step"])


def check_outputs(spec: JobSpec) -> None:
    for flag, value in (("--metrics-file", spec.train.metrics_file), ("--events-file", spec.events_file)):
        if value:
            check_file_target(value, flag)
    check_tracing(spec.train)
    if spec.stop_file and Path(spec.stop_file).is_dir():
        raise ConfigError(f"--stop-file {spec.stop_file!r} is a folder (valid: a file path that does not exist yet)")


def check_tracing(train: TrainConfig) -> None:
    """--tensorboard (the package importable, the folder one that can be made or written) and --profile-steps
    (a window A:B)."""
    if train.profile_steps is not None:
        from elastic_trainer.train.profile import parse

        parse(train.profile_steps)
    if train.tensorboard is None:
        return
    from elastic_trainer.train.tensorboard import missing

    error = missing()
    if error:
        raise ConfigError(error)
    check_dir_target(train.tensorboard, "--tensorboard")


def resume_summary(ckpt: CheckpointConfig | None) -> str:
    if ckpt is None:
        return "no --checkpoint-dir: nothing will be saved"
    found = resume_meta(ckpt)
    return f"resumes step {found[1]['step']} from {found[0]}" if found else f"starts from the seed, saves to {ckpt.dir}"


def train_inputs(spec: JobSpec):
    """Check everything a train job reads and writes (after `check_environment` and the spec's own checks),
    then prepare its data once (`data.corpus`): the corpus (train and validation streams, memory-mapped)."""
    from elastic_trainer.data import corpus as data

    train, ckpt = spec.train, spec.checkpoint
    check_outputs(spec)
    known = data.content_id(train) if ckpt else None  # token sources: their digest, without preparing anything
    step = check_checkpoint(ckpt, spec.model, train, known)
    until = spec.phases[0].until_step
    if until is not None and step and until < step:
        raise ConfigError(
            f"--until-step {until} is before step {step}, where this run resumes "
            f"({ckpt.dir}); valid: a step after {step}"
        )
    check_dir_target(train.data_cache or data.default_cache_dir(), "the data cache (--data-cache)")
    corpus = data.prepare_for_job(train)
    if step and known is None:  # text: its digest is known once prepared
        check_checkpoint(ckpt, spec.model, train, corpus.data_id)
    return corpus
