"""From `train`'s command-line arguments to what a job needs: the model and training configs (a run TOML
plus overrides), the checkpoint config, and the layout, given or planned (for the hosts the ranks are really
on). Used by the CLI on every rank and by the launcher before anything starts; every error is a one-line
ConfigError.
"""

from __future__ import annotations

import argparse
import dataclasses

from elastic_trainer.config import (DP_MODES, CheckpointConfig, ConfigError, ModelConfig, TrainConfig, divisors, env_int,
                                    fmt_values, load_model_config, load_run_config)
from elastic_trainer.plan import Hardware, Plan, PlanError, Request, hardware_for_device, load_hardware, plan
from elastic_trainer.plan.layout import Layout, LayoutError, parse_degrees, split_batch
from elastic_trainer.plan.report import summary
from elastic_trainer.plan.topology import Topology

# command-line flag -> TrainConfig field, for flags that override a run config
TRAIN_FLAGS = ("global_batch", "seq_len", "steps", "seed", "lr", "warmup_steps", "decay_steps", "dtype",
               "metrics_file", "log_every", "data_cache", "grad_clip", "weight_decay", "skip_bad_records")


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig | None:
    if not args.checkpoint_dir:
        if args.resume not in ("auto", "never"):
            raise ConfigError("--resume PATH needs --checkpoint-dir (where this run saves)")
        return None
    cfg = CheckpointConfig(dir=args.checkpoint_dir, save_every=args.save_every,
                           save_interval_s=args.save_interval_s, keep=args.keep, async_save=args.async_save,
                           verify=not args.no_verify, resume=args.resume)
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
    if getattr(args, "data", None):
        overrides["data"] = tuple(args.data)
    try:
        train = dataclasses.replace(train, **overrides)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if train.seq_len > model.context_length:
        raise ConfigError(f"seq_len={train.seq_len} exceeds {model.name}'s context_length={model.context_length}")
    return model, train, layout_table


def resolve_hardware(name: str | None) -> Hardware:
    """--hardware NAME, else this machine's profile: cpu without a GPU, else the one matching the GPU."""
    if name:
        return load_hardware(name)
    from elastic_trainer.parallel.mesh import accelerator

    return hardware_for_device(*accelerator())


def layout_settings(args: argparse.Namespace, layout_table: dict) -> tuple[int | None, str | None, bool | None]:
    """(micro_batch, dp_mode, recompute) from the command line, else the run config's [layout]; None if unset."""
    micro = args.micro_batch if args.micro_batch is not None else layout_table.get("micro_batch")
    mode = args.dp_mode or layout_table.get("dp_mode")
    recompute = args.recompute if args.recompute is not None else layout_table.get("recompute")
    return micro, mode, None if recompute is None else bool(recompute)


def plan_request(args: argparse.Namespace, model: ModelConfig, train: TrainConfig, layout_table: dict,
                 world_size: int, gpus_per_host: int | None, host_sizes: tuple[int, ...] | None = None) -> Request:
    """What the planner considers: every setting the user left open."""
    hw = resolve_hardware(args.hardware)
    micro, mode, recompute = layout_settings(args, layout_table)
    return Request(model, world_size, train.global_batch, train.seq_len, hw,
                   hw.gpus_per_host if gpus_per_host is None else gpus_per_host, host_sizes=host_sizes,
                   dtype=train.dtype, micro_batch=micro, dp_modes=(mode,) if mode else DP_MODES,
                   recompute=(False, True) if recompute is None else (recompute,))


def fixed_settings(args: argparse.Namespace, layout_table: dict) -> str:
    """The layout settings the user fixed, as typed (flags, else the run config's [layout]), for errors."""
    given = []
    for flag, key in (("--micro-batch", "micro_batch"), ("--dp-mode", "dp_mode"), ("--recompute", "recompute")):
        value = getattr(args, key, None)
        if value is not None and value is not False:
            given.append(flag if value is True else f"{flag} {value}")
        elif key in layout_table:
            given.append(f"[layout] {key} = {layout_table[key]!r}")
    return ", ".join(given)


def planned(args: argparse.Namespace, layout_table: dict, req: Request) -> Plan:
    """plan(req), its error naming the settings the user fixed (they are what narrowed the search)."""
    try:
        return plan(req)
    except PlanError as err:
        given = fixed_settings(args, layout_table)
        if not given:
            raise
        raise PlanError(f"with {given}: {err}") from None


def plan_for_hosts(args: argparse.Namespace, model: ModelConfig, train: TrainConfig, layout_table: dict,
                   topology: Topology) -> tuple[Layout, str]:
    """The planned layout for ranks on these hosts, and the plan's one-line summary."""
    result = planned(args, layout_table, plan_request(args, model, train, layout_table, topology.world_size,
                                                      topology.largest, topology.sizes))
    return result.chosen.layout, summary(result)


def given_layout(args: argparse.Namespace, train: TrainConfig, layout_table: dict) -> Layout | None:
    """The layout set by --layout or the run config's degrees (not yet checked against a world size), or
    None when it is left to the planner."""
    if args.layout:
        degrees = parse_degrees(args.layout)
    elif {"dp", "tp", "pp"} <= set(layout_table):
        degrees = layout_table["dp"], layout_table["tp"], layout_table["pp"]
    else:
        return None
    return layout_of(args, train, layout_table, degrees)


def layout_of(args: argparse.Namespace, train: TrainConfig, layout_table: dict, degrees: tuple[int, int, int],
              micro_batch: int | None = None) -> Layout:
    """These degrees with the micro-batch (`micro_batch`, else the command line's or the run config's, else the
    whole dp share), data-parallel mode and recompute that the command line and the run config set."""
    dp, tp, pp = degrees
    micro, mode, recompute = layout_settings(args, layout_table)
    micro_batch, num_microbatches = split_batch(train.global_batch, dp, micro_batch or micro)
    return Layout(dp, tp, pp, micro_batch, num_microbatches, dp_mode=mode or "fsdp", recompute=bool(recompute))


def train_job(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, Layout | None, dict]:
    """`train`'s configs, its data sources checked, the layout it gives (None: to be planned; not yet checked
    against a world size) and the run config's [layout] table."""
    from elastic_trainer.data.corpus import resolve_files  # imports torch: not needed by `plan`

    model, train, layout_table = job_configs(args)
    resolve_files(train.data)  # a missing or unsupported data source fails here, not on every rank later
    return model, train, given_layout(args, train, layout_table), layout_table


def resolve_train_args(args: argparse.Namespace,
                       world_size: int) -> tuple[ModelConfig, TrainConfig, Layout | None, dict]:
    """Configs, the layout given by --layout or the run config (validated; None when it is to be planned)
    and the run config's [layout] table. Raises ConfigError on bad input."""
    model, train, layout, layout_table = train_job(args)
    if layout is None:
        # Rank 0 plans for the real hosts once the process group exists; planning for hosts of
        # LOCAL_WORLD_SIZE ranks here makes bad settings (a micro-batch that cannot split the batch, a
        # count no layout fits) fail before anything starts.
        planned(args, layout_table, plan_request(args, model, train, layout_table, world_size,
                                                 env_int("LOCAL_WORLD_SIZE", world_size, minimum=1)))
        return model, train, None, layout_table
    try:
        return model, train, layout.validate(world_size, model, train.global_batch), layout_table
    except LayoutError as err:
        source = f"--layout {args.layout}" if args.layout else f"[layout] of {args.config}"
        raise LayoutError(f"{source}: {err}") from None


def check_hosts(layout: Layout, model: ModelConfig, topology: Topology) -> None:
    """A given layout must keep every tp group on one host."""
    if not topology.within(layout.tp):
        valid = [t for t in divisors(topology.common) if model.n_heads % t == 0]
        raise ConfigError(f"tp={layout.tp} groups would span hosts ({topology.describe()}) "
                          f"(valid tp: {fmt_values(valid)})")
