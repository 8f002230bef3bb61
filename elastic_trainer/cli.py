"""`elastic-trainer`: the commands (their flags are defined in cli_parser.py).

    elastic-trainer train --model gpt-tiny --layout 2,1,2 --micro-batch 2 --global-batch 8 --steps 20

Run it as one plain process for layout 1,1,1, or under torchrun for more ranks (our wrapper checks the inputs
once before any worker starts and forks the workers; plain torchrun ... -m elastic_trainer.cli works too):

    elastic-trainer torchrun --standalone --nproc-per-node 4 train --layout 2,1,2 ...

Without --layout, train plans the layout for its world size. The planner on its own, and the command that
measures this machine for it:

    elastic-trainer plan --model gpt3-xl --gpus 16 --gpus-per-host 8 --hardware h100-80g --global-batch 128
    elastic-trainer calibrate --output configs/hardware/cpu.toml
    elastic-trainer calibrate --base cpu --model gpt3-small --only-optimizer --output cpu-gpt3-small.toml

Bad input (flags, config files, environment, data, output paths, the checkpoint to resume; see preflight.py)
fails with one line naming the flag or file and what would be valid, exit code 2, before any process group
forms or any file is written. Divergence (a non-finite loss or gradient norm) is bad input too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from elastic_trainer import cli_parser, resolve
from elastic_trainer.cli_parser import Parser
from elastic_trainer.config import CheckpointError, ConfigError, load_model_config
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.plan import Hardware, PlanError, load_hardware
from elastic_trainer.plan.layout import parse_degrees
from elastic_trainer.plan.report import format_table, plan_dict


def run_experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.experiment.config import load_experiment
    from elastic_trainer.experiment.main import Options
    from elastic_trainer.experiment.main import run_experiment as run

    exp = load_experiment(args.config, args.schedule, args.policy, args.profile)
    run(
        exp,
        Options(
            args.clock,
            args.time_scale,
            args.target_steps,
            Path(args.out),
            Path(args.work_dir),
            args.hosts,
            args.dry_run,
            tuple(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args),
        ),
    )
    return 0


def build_parser() -> Parser:
    return cli_parser.build_parser(__doc__.split("\n\n")[0])


def _train_args(args: argparse.Namespace) -> list[str]:
    """The `train` arguments given after `--` to a command that starts training elsewhere (launch, kubernetes)."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if train_args and not train_args[0].startswith("-"):
        raise ConfigError(f"unexpected {train_args[0]!r}: put `train` arguments after -- (see {args.command} --help)")
    return train_args


def run_kubernetes(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.launch.kubernetes import PyTorchJobSpec, render

    train_args = _train_args(args)
    spec = PyTorchJobSpec(
        image=args.image,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        gpus_per_replica=args.gpus_per_replica,
        checkpoint_claim=args.checkpoint_claim,
        name=args.name,
        replicas=args.replicas,
        mount_path=args.mount_path,
        max_restarts=args.max_restarts,
        rdzv_port=args.rdzv_port,
        grace_s=args.grace_s,
        train_args=tuple(train_args),
    )
    text = render(spec)
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"wrote {args.output}: PyTorchJob {spec.name}, {spec.min_replicas}..{spec.max_replicas} pods x "
            f"{spec.gpus_per_replica} GPUs, checkpoints in claim {spec.checkpoint_claim} at {spec.checkpoint_dir}"
        )
    else:
        sys.stdout.write(text)
    return 0


def run_launch(args: argparse.Namespace) -> int:
    from elastic_trainer.launch.commands import SshSettings
    from elastic_trainer.launch.driver import launch
    from elastic_trainer.launch.job_setup import JobSetup, LaunchOptions, launch_train_argv

    train_args = _train_args(args)
    train_argv, schedule = launch_train_argv(args.model, args.config, args.data, args.schedule, train_args)
    opts = LaunchOptions(
        hosts=args.hosts,
        gpus_per_host=args.gpus_per_host,
        detect_self_ip=args.detect_self_ip,
        schedule=schedule,
        run_dir=args.run_dir,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        ssh=SshSettings(args.ssh_port, args.ssh_identity, tuple(args.ssh_option), args.ssh_config),
        force_ssh=tuple(args.force_ssh),
        rdzv_port=args.rdzv_port,
        rdzv_conf=tuple(args.rdzv_conf),
        max_restarts=args.max_restarts,
        min_hosts=args.min_hosts,
        remote_root=args.remote_root,
        warm_start=not args.no_warm_start,
        notice_grace_s=args.notice_grace_s,
        hang_timeout_s=args.hang_timeout_s,
        train_argv=tuple(train_argv),
    )
    return launch(JobSetup(opts), dry_run=args.dry_run)


def run_checkpoint(args: argparse.Namespace) -> int:
    from elastic_trainer.checkpoint import offline

    if args.checkpoint_command == "inspect":
        folder, complete = offline.resolve(args.dir)
        summary = offline.summarize(folder, verify=not args.no_verify)
        if args.json:
            print(json.dumps({**summary, "complete": [str(p) for p in complete]}, indent=1))
        else:
            print(offline.format_summary(summary, complete))
        return 0 if not summary["integrity"].startswith("FAILED") else 1
    if args.checkpoint_command == "import-deepspeed":
        return run_import_deepspeed(args)
    out = offline.export_hf(args.dir, args.out)
    print(f"wrote {out}/config.json and model.safetensors (load with GPT2LMHeadModel.from_pretrained)")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from elastic_trainer.data import tokenizer
    from elastic_trainer.model import generate

    prompt = tokenizer.encode(args.prompt)
    generate.check(len(prompt), args.max_new_tokens, args.temperature, args.top_k)  # before loading the model
    model, _ = generate.from_checkpoint(args.checkpoint)
    tokens = generate.generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tokenizer.decode(tokens), flush=True)
    return 0


def run_import_deepspeed(args: argparse.Namespace) -> int:
    from elastic_trainer.interop import deepspeed

    state = deepspeed.read_deepspeed(args.src)
    found = deepspeed.settings_of(state)
    if not args.config:  # a run TOML states its own settings; otherwise DeepSpeed's are the defaults
        for key in ("global_batch", "grad_clip", "weight_decay"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(found, key) or None)
    model, train, _ = resolve.job_configs(args)
    deepspeed.import_deepspeed(args.src, args.out, model, train, state=state)
    source = f"--config {args.config}" if args.config else f"--model {args.model}"
    print(
        f"resume it in any layout: elastic-trainer train {source} --checkpoint-dir {args.out} --global-batch "
        f"{train.global_batch} --grad-clip {train.grad_clip} --weight-decay {train.weight_decay} plus this "
        f"import's --seq-len, --lr, schedule and --data (or `elastic-trainer launch --checkpoint-dir {args.out}`)"
    )
    return 0


def run_plan(args: argparse.Namespace) -> int:
    result = resolve.plan_table(args)
    try:
        compare = result.best_for(*parse_degrees(args.compare, "--compare")) if args.compare else None
    except PlanError as err:
        raise PlanError(f"--compare {args.compare}: {err}") from None
    if getattr(args, "run_dir", None) and not result.request.measured:
        print(
            f"[plan] --run-dir {args.run_dir}: no step time there was measured for this model, batch, sequence, "
            f"dtype, profile and compile setting on hosts of {result.request.topology.describe()}; all figures "
            "are predictions",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(plan_dict(result, compare), indent=1))
    else:
        print(format_table(result, args.top, compare))
    if args.explain and not args.json:
        from elastic_trainer.plan.explain import format_terms

        for c in [result.chosen] + ([compare] if compare not in (None, result.chosen) else []):
            print(format_terms(result.request, c, resolve.measured_phases(args, result.request, c.layout)))
    return 0


def calibrate_modes(hw, model, seq_len: int):
    """`hw` with each dp mode's optimizer and hooks figures measured at `model`'s shapes."""
    from elastic_trainer.parallel.calibrate_modes import fitted, measure_modes

    hw = fitted(hw, model, seq_len, measure_modes(model, seq_len))
    for mode in ("fsdp", "ddp", "zero1"):
        print(
            f"[calibrate] {model.name} (seq {seq_len}), {mode}: clipping + AdamW "
            f"{hw.optimizer_ns(mode):.2f} ns per local parameter; {hw.hooks_ns(mode):.2f} ns per stage parameter "
            f"and collective beyond the cheapest mode"
        )
    return hw


def calibrate_host(hw, model, device):
    """`hw` with the host's time per block and micro-batch in each dp mode, measured on this GPU at `model`."""
    from elastic_trainer.parallel.calibrate_modes import measure_host

    host = measure_host(model, device)
    for mode, ms in host.items():
        print(
            f"[calibrate] {model.name}, {mode}: the host issues a block's forward and backward in {ms:.2f} ms "
            f"per micro-batch"
        )
    return dataclasses.replace(hw, optimizer_shapes=model.name, **{f"{m}_host_block_ms": v for m, v in host.items()})


def run_calibrate(args: argparse.Namespace) -> int:
    import re
    from pathlib import Path

    from elastic_trainer.parallel.calibrate import calibrate
    from elastic_trainer.parallel.mesh import default_device
    from elastic_trainer.preflight import check_file_target

    check_file_target(args.output, "--output")  # before minutes of measuring, not after
    name = args.name or Path(args.output).stem
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"--name {name!r} is not a profile name (valid: letters, digits, '.', '_', '-')")
    base = load_hardware(args.base) if args.base else Hardware(name="base")
    ranks = [r.strip() for r in args.ranks.split(",") if r.strip()]
    if not ranks or not all(r.isascii() and r.isdigit() and 2 <= int(r) <= 64 for r in ranks):
        raise ConfigError(
            f"--ranks {args.ranks!r} must be rank counts from 2 to 64 separated by commas (for example 2,4,8)"
        )
    ranks = [int(r) for r in ranks]
    device = default_device()
    if args.compile:
        from elastic_trainer.parallel.compile import compiler_problem

        problem = compiler_problem(device.type)
        if problem:
            raise ConfigError(problem)
    if args.only_optimizer and not (args.model and args.base):
        raise ConfigError("--only-optimizer needs --model (what to measure) and --base (the other fields)")
    if args.only_optimizer and (base.device != "cpu" or args.compile):
        raise ConfigError(
            f"--only-optimizer measures CPU ranks: --base {args.base} is a {base.device} profile"
            if base.device != "cpu"
            else "--only-optimizer measures nothing compiled: drop --compile"
        )
    model = load_model_config(args.model) if args.model else None  # a bad name fails before the measuring
    if model is not None and args.seq_len > model.context_length:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds {model.name}'s context_length={model.context_length}")
    hw = (
        dataclasses.replace(base, name=name)
        if args.only_optimizer
        else calibrate(base, name, ranks, device, compiled=args.compile, model=model)
    )
    if model is not None and device.type == "cuda":
        hw = calibrate_host(hw, model, device)
    elif model is not None:
        hw = calibrate_modes(hw, model, args.seq_len)
    elif hw.optimizer_shapes:  # not measured here: they stand in for the common optimizer figure, so say so
        print(
            f"[calibrate] each dp mode's optimizer and excess figures are kept from the base profile (measured at "
            f"{hw.optimizer_shapes}); `--model M --only-optimizer` measures them at a job's shapes"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        "# Measured by `elastic-trainer calibrate` (elastic_trainer/parallel/calibrate.py).\n" + hw.to_toml()
    )
    print(f"[calibrate] wrote {args.output}")
    return 0


def run_train_command(args: argparse.Namespace) -> int:
    """Describe the job (resolve.train_spec) and check every input before the process group forms
    (preflight), then this process is a rank of it."""
    from elastic_trainer import preflight, rank

    env = preflight.check_environment()
    spec = resolve.train_spec(
        args,
        built_by="train",
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        hosts_known=env.world_size == env.local_world_size,
    )
    corpus = preflight.train_inputs(spec)
    if env.local_rank == 0:
        from elastic_trainer.data.corpus import say

        say(corpus)
    if args.check:
        layout = spec.phases[0].layout
        planned = layout.describe() if layout is not None else "planned at start for the hosts the ranks are on"
        print(
            f"[check] inputs are valid: {spec.model.name} on {env.world_size} rank(s) ({planned}); "
            f"{corpus.describe()}; {preflight.resume_summary(spec.checkpoint)}; nothing was started"
        )
        return 0
    return rank.finish_worker(rank.recorded(rank.run, env)(spec, None, env, corpus=corpus), env)


def run_prepare_data(args: argparse.Namespace) -> int:
    """`prepare-data`: the text of the sources into a prepared dataset (data/prepare.py); Ctrl-C keeps the
    complete shards and exits 130."""
    from pathlib import Path

    from elastic_trainer.data import prepare, read, sources, stream

    resolved = sources.resolve(args.sources, args.data_split)
    if resolved.tokens:
        raise ConfigError(
            f"{resolved.tokens[0].path} is already tokens ({resolved.tokens[0].kind}); --data takes it as it is"
        )
    out = Path(args.out)
    if out.is_file() or (
        out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file() and not (out / "shards").is_dir()
    ):
        raise ConfigError(f"--out {args.out} holds other files (valid: a new folder, or one prepare-data wrote)")
    read.sample(resolved.text, skip=args.skip_bad_records, text_field=args.text_field)
    try:
        manifest = prepare.prepare(
            resolved.text,
            out,
            text_field=args.text_field,
            skip_bad=args.skip_bad_records,
            workers=args.workers,
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
            announce=True,
        )
    except KeyboardInterrupt as e:
        print(f"prepare-data: {e or 'interrupted; run the same command again to continue'}", file=sys.stderr)
        return 130
    if args.verify:
        stream.prepared_files(out, manifest, verify="all")
    for note in resolved.notes:
        print(f"[prepare] {note}", file=sys.stderr)
    if resolved.validation:
        print(
            f"[prepare] a validation split is beside the sources ({resolved.validation[0].name}...): prepare it "
            "into its own folder for --val-data",
            file=sys.stderr,
        )
    print(
        f"{out}: {manifest['tokens']:,} tokens, {manifest['documents']:,} documents, {len(manifest['shards'])} "
        f"shards; train on it with --data {out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process's entry point: the CPU allocator's switch, and its restart where it trains
        from elastic_trainer.launch.allocator import check_switch, restart_keeping_freed_memory

        check_switch()  # also for the commands that start processes that train (launch, experiment)
        if sys.argv[1:2] in (["train"], ["torchrun"], ["calibrate"]):
            restart_keeping_freed_memory()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["torchrun"] and not {"-h", "--help"} & set(argv[1:2]):
            from elastic_trainer import rank
            from elastic_trainer.launch.agent import run_torchrun  # torchrun's flags are its parser's to read

            # its workers are gone: no interpreter teardown of torch (seconds, and a scheduler's second signal
            # could land in it), as the launcher's agents end
            return rank.finish_worker(run_torchrun(argv[1:]), TorchrunEnv(), force=True)
        if argv[:1] == ["train"]:
            args = cli_parser.train_args(argv[1:])
        else:
            args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (ConfigError, CheckpointError) as e:
        from elastic_trainer import rank

        env = TorchrunEnv.lenient()
        return rank.finish_worker(rank.report_bad_input(e, env), env)


COMMANDS = {
    "train": run_train_command,
    "launch": run_launch,
    "checkpoint": run_checkpoint,
    "generate": run_generate,
    "plan": run_plan,
    "calibrate": run_calibrate,
    "experiment": run_experiment,
    "kubernetes": run_kubernetes,
    "prepare-data": run_prepare_data,
}


if __name__ == "__main__":
    sys.exit(main())
