"""From `train`'s command-line flags to a checked `JobSpec`, and the planning every builder of a spec and rank 0
share. The argparse Namespace stops at the `*_from_args` functions; everything after them takes the spec.
Every error is a one-line ConfigError naming the flag or file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from elastic_trainer.config import (
    DP_MODES,
    CheckpointConfig,
    ConfigError,
    ModelConfig,
    TrainConfig,
    divisors,
    fmt_values,
    load_model_config,
    load_run_config,
)
from elastic_trainer.job_spec import JobSpec, LayoutSettings, PhaseSpec
from elastic_trainer.plan import Hardware, PlanError, Request, hardware_for_device, load_hardware, plan
from elastic_trainer.plan import measured as measured_times
from elastic_trainer.plan.layout import Layout, LayoutError, parse_degrees, split_batch
from elastic_trainer.plan.report import summary
from elastic_trainer.plan.topology import Topology
from elastic_trainer.plan.use_gpus import GpuPlan, plan_gpus
from elastic_trainer.test_hooks import count

# command-line flag -> TrainConfig field, for flags that override a run config
TRAIN_FLAGS = (
    "global_batch",
    "seq_len",
    "steps",
    "seed",
    "lr",
    "warmup_steps",
    "decay_steps",
    "dtype",
    "metrics_file",
    "log_every",
    "data_cache",
    "grad_clip",
    "weight_decay",
    "skip_bad_records",
    "text_field",
    "data_split",
    "val_fraction",
    "eval_every",
    "eval_batches",
    "tensorboard",
    "profile_steps",
    "compile",
    "compile_cache",
)


# -- flags -> parts of the spec --------------------------------------------------------------------------


def checkpoint_config(
    args: argparse.Namespace, directory: str | None = None, resume: str | None = None
) -> CheckpointConfig | None:
    """--checkpoint-dir and its settings (`directory`, `resume`: what the launcher sets for every phase)."""
    directory, resume = directory or args.checkpoint_dir, resume or args.resume
    if not directory:
        if resume not in ("auto", "never"):
            raise ConfigError("--resume PATH needs --checkpoint-dir (where this run saves)")
        return None
    cfg = CheckpointConfig(
        dir=directory,
        save_every=args.save_every,
        save_interval_s=args.save_interval_s,
        keep=args.keep,
        async_save=args.async_save,
        verify=not args.no_verify,
        memory_snapshot_every=args.memory_snapshot_every,
        resume=resume,
    )
    if cfg.resume == "never":
        from elastic_trainer.checkpoint.storage import require_no_checkpoints

        require_no_checkpoints(cfg.dir)
    return cfg


def job_configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, dict]:
    """Model, train settings (with command-line overrides) and the run config's [layout] table."""
    if args.config:
        run = load_run_config(args.config)
        model, train, layout_table = run.model, run.train, run.layout
    else:
        model, train, layout_table = load_model_config(args.model or "gpt-tiny"), TrainConfig(), {}
    overrides = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k, None) is not None}
    for key in ("data", "val_data"):
        if getattr(args, key, None):
            overrides[key] = tuple(getattr(args, key))
    try:
        train = dataclasses.replace(train, **overrides)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if train.seq_len > model.context_length:
        raise ConfigError(f"seq_len={train.seq_len} exceeds {model.name}'s context_length={model.context_length}")
    return model, train, layout_table


def layout_settings(args: argparse.Namespace, layout_table: dict) -> LayoutSettings:
    """What the flags, else the run config's [layout], fix of the layout."""
    micro = args.micro_batch if args.micro_batch is not None else layout_table.get("micro_batch")
    mode = args.dp_mode or layout_table.get("dp_mode")
    recompute = args.recompute if args.recompute is not None else layout_table.get("recompute")
    degrees, source = None, ""
    if getattr(args, "layout", None):
        degrees, source = parse_degrees(args.layout), f"--layout {args.layout}"
    elif {"dp", "tp", "pp"} <= set(layout_table):
        degrees, source = (layout_table["dp"], layout_table["tp"], layout_table["pp"]), f"[layout] of {args.config}"
    fixed = []
    for flag, key in (("--micro-batch", "micro_batch"), ("--dp-mode", "dp_mode"), ("--recompute", "recompute")):
        value = getattr(args, key, None)
        if value is not None and value is not False:
            fixed.append(flag if value is True else f"{flag} {value}")
        elif key in layout_table:
            fixed.append(f"[layout] {key} = {layout_table[key]!r}")
    return LayoutSettings(
        degrees, micro, mode, None if recompute is None else bool(recompute), source, ", ".join(fixed)
    )


def resolve_hardware(name: str | None) -> Hardware:
    """--hardware NAME, else this machine's profile: cpu without a GPU, else the one matching the GPU."""
    if name:
        return load_hardware(name)
    from elastic_trainer.parallel.mesh import accelerator

    return hardware_for_device(*accelerator())


def describe_job(
    args: argparse.Namespace,
    *,
    built_by: str,
    detect_hardware: bool,
    checkpoint: tuple[str | None, str | None] = (None, None),
    events_file: str | None = None,
    stop_file: str | None = None,
    metrics_file: str | None = None,
) -> JobSpec:
    """What every builder of a spec takes from `train`'s flags (no phases yet), its data sources checked: the
    configs, the hardware (--hardware, else this machine's when `detect_hardware`, else None: rank 0 detects
    it on the hosts), checkpoints (`checkpoint`: the directory and resume mode a launcher sets) and outputs
    (the flags' unless given)."""
    from elastic_trainer.data.corpus import resolve_files  # imports torch: not needed by `plan`

    model, train, table = job_configs(args)
    resolve_files(train.data)  # a missing or unsupported data source fails here, not on every rank later
    if metrics_file is not None:
        train = dataclasses.replace(train, metrics_file=metrics_file)
    if train.tensorboard is not None:  # `--tensorboard` alone: beside the metrics file; every rank, one path
        from elastic_trainer.train.tensorboard import default_dir

        train = dataclasses.replace(
            train, tensorboard=os.path.abspath(train.tensorboard or default_dir(train.metrics_file))
        )
    if train.compile and (train.compile_cache or train.metrics_file):  # else inductor's own (/tmp, per user)
        from elastic_trainer.train.metrics import beside_metrics

        train = dataclasses.replace(
            train,
            compile_cache=os.path.abspath(train.compile_cache or beside_metrics(train.metrics_file, "compile-cache")),
        )
    hardware = resolve_hardware(args.hardware) if args.hardware or detect_hardware else None
    return JobSpec(
        model,
        train,
        checkpoint_config(args, *checkpoint),
        layout_settings(args, table),
        hardware,
        args.use_gpus,
        events_file if events_file is not None else args.events_file,
        stop_file if stop_file is not None else args.stop_file,
        built_by=built_by,
    )


def train_spec(
    args: argparse.Namespace,
    *,
    built_by: str,
    world_size: int | None,
    local_world_size: int,
    hosts_known: bool,
    detect_hardware: bool = True,
) -> JobSpec:
    """`train`'s flags as a checked spec for `world_size` ranks (None: not known before the rendezvous) on hosts
    of `local_world_size` (`hosts_known`: one host holds them all, so the plan is made here and the ranks take
    it). Bad settings (a layout that does not fit, a micro-batch that splits no count) fail here, before any
    process group. Without --hardware the profile is this machine's when `detect_hardware` (a process that
    will not fork CUDA users), else left to rank 0 on the hosts: the settings are then checked against a
    profile without a memory limit, and only rank 0's plan knows the GPUs' memory."""
    spec = describe_job(args, built_by=built_by, detect_hardware=detect_hardware)
    layout, line = given_layout(spec), ""
    pinned = layout is not None
    hosts_known = hosts_known and world_size is not None and spec.hardware is not None
    if world_size is not None and pinned:
        checked(layout, spec, world_size)
    elif world_size is not None:
        topology = Topology.uniform(world_size, local_world_size)
        layout, _, line = plan_for_hosts(spec, spec.hardware or UNLIMITED, topology)
    phase = PhaseSpec(
        args.phase,
        args.until_step,
        (world_size,) if hosts_known else None,
        layout if (hosts_known or pinned) else None,
        pinned,
        line if hosts_known else "",
    )
    return dataclasses.replace(spec, phases=(phase,))


UNLIMITED = Hardware(name="any GPU", memory_gb=1e6)
"""What a spec built without knowing the hosts' GPUs checks the settings with: degrees and batch splits, not
memory (rank 0 plans with the real profile)."""


# -- planning on a spec ----------------------------------------------------------------------------------


def plan_request(
    spec: JobSpec,
    hardware: Hardware,
    world_size: int,
    gpus_per_host: int | None = None,
    host_sizes: tuple[int, ...] | None = None,
    measured: tuple = (),
) -> Request:
    """What the planner considers: every setting the user left open (and what this job measured)."""
    s = spec.layout
    return Request(
        spec.model,
        world_size,
        spec.train.global_batch,
        spec.train.seq_len,
        hardware,
        hardware.gpus_per_host if gpus_per_host is None else gpus_per_host,
        host_sizes=host_sizes,
        dtype=spec.train.dtype,
        micro_batch=s.micro_batch,
        dp_modes=(s.dp_mode,) if s.dp_mode else DP_MODES,
        recompute=(False, True) if s.recompute is None else (s.recompute,),
        compiled=spec.train.compile,
        measured=measured,
    )


def _measured_key(spec: JobSpec, hardware: Hardware) -> dict:
    t = spec.train
    return measured_times.job_key(spec.model.name, t.global_batch, t.seq_len, t.dtype, hardware.name, t.compile)


def learned(spec: JobSpec, hardware: Hardware, topology: Topology) -> tuple:
    """The step times this job measured on hosts of these sizes (plan/measured.py), for its next plan."""
    return measured_times.for_hosts(
        measured_times.path_for(spec.train.metrics_file), _measured_key(spec, hardware), topology.sizes
    )


def record_measured(
    spec: JobSpec, layout: Layout, hosts: tuple[int, ...], records: list[dict], device_type: str
) -> dict | None:
    """Rank 0 when a start stops training: its steady step time on these hosts (the ranks held, the key of
    later plans), beside the prediction for the ranks it used. Nothing when the job plans with a profile of
    another kind of device (--hardware h100-80g on CPU ranks): those seconds would not be that device's."""
    from elastic_trainer.plan.candidates import evaluate

    hardware = spec.hardware or resolve_hardware(None)
    if hardware.device != device_type:
        return None
    used = Topology(hosts).first(layout.world_size)  # with GPUs idle, the plan was for these
    predicted = evaluate(plan_request(spec, hardware, layout.world_size, used.largest, used.sizes), layout)
    return measured_times.record(
        measured_times.path_for(spec.train.metrics_file),
        _measured_key(spec, hardware),
        layout,
        hosts,
        records,
        predicted.time.total if predicted.time else None,
    )


def naming_fixed(settings: LayoutSettings, fn, *args):
    """fn(*args), its PlanError naming the settings the user fixed (they are what narrowed the search)."""
    try:
        return fn(*args)
    except PlanError as err:
        if not settings.fixed:
            raise
        raise PlanError(f"with {settings.fixed}: {err}") from None


def plan_for_hosts(
    spec: JobSpec, hardware: Hardware, topology: Topology, measured: tuple = ()
) -> tuple[Layout, GpuPlan, str]:
    """The layout for ranks on these hosts (on the first `used` of them when no layout fits all, or when the
    job's use_gpus prefers fewer), its GpuPlan, and one line for the log; `measured`: step times this job
    measured on these hosts (plan/measured.py)."""
    count("plan")
    req = plan_request(spec, hardware, topology.world_size, topology.largest, topology.sizes, measured)
    chosen = naming_fixed(spec.layout, plan_gpus, req, spec.use_gpus)
    line = summary(chosen.plan) + (f"; {chosen.note()}" if chosen.idle else "")
    return chosen.plan.chosen.layout, chosen, line


def given_layout(spec: JobSpec) -> Layout | None:
    """The layout fixed by --layout or the run config's degrees (not yet checked against a world size), or
    None when it is left to the planner."""
    if spec.layout.degrees is None:
        return None
    return layout_of(spec, spec.layout.degrees)


def layout_of(spec: JobSpec, degrees: tuple[int, int, int], micro_batch: int | None = None) -> Layout:
    """These degrees with the micro-batch (`micro_batch`, else the one the user fixed, else the whole dp share),
    data-parallel mode and recompute the user fixed."""
    dp, tp, pp = degrees
    s = spec.layout
    micro_batch, num_microbatches = split_batch(spec.train.global_batch, dp, micro_batch or s.micro_batch)
    return Layout(dp, tp, pp, micro_batch, num_microbatches, dp_mode=s.dp_mode or "fsdp", recompute=bool(s.recompute))


def checked(layout: Layout, spec: JobSpec, world_size: int) -> Layout:
    """A given layout, valid for this world size (its error names where the layout came from)."""
    try:
        return layout.validate(world_size, spec.model, spec.train.global_batch)
    except LayoutError as err:
        raise LayoutError(f"{spec.layout.source}: {err}" if spec.layout.source else str(err)) from None


def check_hosts(layout: Layout, model: ModelConfig, topology: Topology) -> None:
    """A given layout must keep every tp group on one host."""
    if not topology.within(layout.tp):
        valid = [t for t in divisors(topology.common) if model.n_heads % t == 0]
        raise ConfigError(
            f"tp={layout.tp} groups would span hosts ({topology.describe()}) (valid tp: {fmt_values(valid)})"
        )


def plan_table(args: argparse.Namespace):
    """`elastic-trainer plan`: the full plan for --gpus (no GPUs left idle: it shows what N GPUs can do)."""
    model, train, table = job_configs(args)
    spec = JobSpec(model, train, None, layout_settings(args, table), resolve_hardware(args.hardware))
    req = plan_request(spec, spec.hardware, args.gpus, args.gpus_per_host)
    if getattr(args, "run_dir", None):
        req = dataclasses.replace(
            req, measured=measured_times.for_hosts(measured_in(args.run_dir), _request_key(req), req.topology.sizes)
        )
    return naming_fixed(spec.layout, plan, req)


def _request_key(req: Request) -> dict:
    """The measured records' key of a plan request (the same as `_measured_key` of the job it plans)."""
    return measured_times.job_key(
        req.model.name, req.global_batch, req.seq_len, req.dtype, req.hardware.name, req.compiled
    )


def measured_in(run_dir: str) -> Path:
    """A job's record of measured step times in its run folder; a folder without one is an error."""
    path = Path(run_dir) / measured_times.FILE
    if not path.is_file():
        raise ConfigError(
            f"--run-dir {run_dir}: no {measured_times.FILE} there (a job writes it in its run folder "
            f"once a start trained {measured_times.MIN_STEPS} steps)"
        )
    return path


def measured_phases(args: argparse.Namespace, req: Request, layout: Layout) -> tuple[dict, int]:
    """The phases `plan --run-dir`'s job measured in `layout` on these hosts (plan/measured.py)."""
    if not getattr(args, "run_dir", None):
        return {}, 0
    return measured_times.phases_for(measured_in(args.run_dir), _request_key(req), req.topology.sizes, layout)
