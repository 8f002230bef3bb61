"""`elastic-trainer`: the commands (their flags are defined in cli_parser.py).

    elastic-trainer train --model gpt-tiny --layout 2,1,2 --micro-batch 2 --global-batch 8 --steps 20

Run it as one plain process for layout 1,1,1, or under torchrun for more ranks (our wrapper checks the inputs
once before any worker starts and forks the workers; plain torchrun ... -m elastic_trainer.cli works too):

    elastic-trainer torchrun --standalone --nproc-per-node 4 train --layout 2,1,2 ...

Without --layout, train plans the layout for its world size. The planner on its own, and the command that
measures this machine for it:

    elastic-trainer plan --model gpt3-xl --gpus 16 --gpus-per-host 8 --hardware h100-80g --global-batch 128
    elastic-trainer calibrate --output configs/hardware/cpu.toml

Bad input (flags, config files, environment, data, output paths, the checkpoint to resume; see preflight.py)
fails with one line naming the flag or file and what would be valid, exit code 2, before any process group
forms or any file is written. Divergence (a non-finite loss or gradient norm) is bad input too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

from elastic_trainer import IMPORTED_AT, cli_parser, resolve
from elastic_trainer.cli_parser import Parser
from elastic_trainer.config import CheckpointConfig, CheckpointError, ConfigError, ModelConfig, TrainConfig, env_int
from elastic_trainer.plan import Hardware, PlanError, load_hardware
from elastic_trainer.plan.layout import Layout, parse_degrees
from elastic_trainer.plan.report import format_table, plan_dict

EXIT_BAD_INPUT = 2

def run_experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.experiment.config import load_experiment
    from elastic_trainer.experiment.main import Options, run_experiment as run

    exp = load_experiment(args.config, args.schedule, args.policy, args.profile)
    run(exp, Options(args.clock, args.time_scale, args.target_steps, Path(args.out), Path(args.work_dir),
                     args.hosts, args.dry_run, tuple(args.train_args[1:] if args.train_args[:1] == ["--"]
                                                     else args.train_args)))
    return 0


def build_parser() -> Parser:
    return cli_parser.build_parser(__doc__.split("\n\n")[0])


def world_size_from_env() -> int:
    return env_int("WORLD_SIZE", 1, minimum=1)


def run_train(args: argparse.Namespace, model: ModelConfig, train: TrainConfig, layout: Layout | None,
              layout_table: dict, ckpt: CheckpointConfig | None = None, started: float = IMPORTED_AT,
              forked: bool = False, tokens=None) -> int:
    """Join the process group, settle one layout for the job (planned on rank 0 for the real hosts unless
    given), then the job sequence (train.job)."""
    import torch.distributed as dist

    from elastic_trainer.elastic import StopRequest, exit_code
    from elastic_trainer.elastic.events import EventLog
    from elastic_trainer.parallel import default_device, init_process_group
    from elastic_trainer.parallel.agree import agree, gather_topology
    from elastic_trainer.train import MetricsLog, run_job

    if "TORCHELASTIC_RUN_ID" in os.environ:
        from elastic_trainer.elastic.lifetime import die_with_parent

        die_with_parent()  # a killed agent (a lost host) takes its workers with it; the survivors re-form
    device = default_device()
    init_process_group(device)
    stop = StopRequest(args.stop_file)
    rank0 = dist.get_rank() == 0
    tags = {k: v for k, v in (("phase", args.phase), ("restart", _restart_count())) if v is not None}
    tags["start"] = uuid.uuid4().hex[:8]  # this start's records and events (only rank 0 writes them)
    events = EventLog(args.events_file, enabled=rank0, tags=tags)
    try:
        events.emit("processes_up", started=started, world_size=dist.get_world_size())
        topology = gather_topology()
        if layout is None:
            layout, line = agree(lambda: resolve.plan_for_hosts(args, model, train, layout_table, topology))
            if rank0:
                print(line, flush=True)
        resolve.check_hosts(layout, model, topology)
        events.emit("planned", layout=layout.to_dict(), hosts=list(topology.sizes))
        _say_host_ranks(dist.get_rank(), dist.get_world_size())
        log = MetricsLog(train.metrics_file, enabled=rank0, log_every=train.log_every, total_steps=train.steps,
                         tags=tags)
        result = run_job(model, train, layout, device, ckpt=ckpt, stop=stop, until=args.until_step, log=log,
                         events=events, tokens=tokens)
        log.close()
        if rank0 and train.skip_bad_records:
            from elastic_trainer.data.corpus import skipped_note

            print(f"[data] {skipped_note(train.data, train.data_cache)}", flush=True)
    finally:
        stop.close()
        events.close()
        dist.destroy_process_group()
    if forked and stop.reason == "SIGTERM":
        # The agent is stopping its workers: it will not collect a forked worker's return value (the worker
        # would wait for that until killed), and the state is saved.
        _finish_worker(0, force=True)
    return exit_code(result.status, result.reason)


def _say_host_ranks(rank: int, world: int) -> None:
    """Under torchrun, one line per host: which global ranks it holds (torchrun numbers a host's ranks
    consecutively)."""
    local, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if local == "0" and size and size.isascii() and size.isdigit() and "GROUP_RANK" in os.environ:
        import socket

        print(f"[ranks] {socket.gethostname()} (host {os.environ['GROUP_RANK']}): ranks {rank}-{rank + int(size) - 1} "
              f"of {world}", flush=True)


def _restart_count() -> int | None:
    """torchrun's count of worker-group restarts (None outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value and value.isascii() and value.isdigit() else None


def parse_train_command(argv: list[str]) -> tuple[argparse.Namespace, ModelConfig, TrainConfig, Layout | None,
                                                   dict]:
    """`train` arguments as the launcher forwards them to every rank, resolved to configs (the layout, if
    given, is checked per phase). ConfigError on bad input."""
    args = build_parser().parse_args(["train", *argv])
    return (args, *resolve.train_job(args))


def _train_args(args: argparse.Namespace) -> list[str]:
    """The `train` arguments given after `--` to a command that starts training elsewhere (launch, kubernetes)."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if train_args and not train_args[0].startswith("-"):
        raise ConfigError(f"unexpected {train_args[0]!r}: put `train` arguments after -- "
                          f"(see {args.command} --help)")
    return train_args


def run_kubernetes(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.launch.kubernetes import PyTorchJobSpec, render

    train_args = _train_args(args)
    spec = PyTorchJobSpec(image=args.image, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                          gpus_per_replica=args.gpus_per_replica, checkpoint_claim=args.checkpoint_claim,
                          name=args.name, replicas=args.replicas, mount_path=args.mount_path,
                          max_restarts=args.max_restarts, rdzv_port=args.rdzv_port, grace_s=args.grace_s,
                          train_args=tuple(train_args))
    text = render(spec)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: PyTorchJob {spec.name}, {spec.min_replicas}..{spec.max_replicas} pods x "
              f"{spec.gpus_per_replica} GPUs, checkpoints in claim {spec.checkpoint_claim} at {spec.checkpoint_dir}")
    else:
        sys.stdout.write(text)
    return 0


def run_launch(args: argparse.Namespace) -> int:
    from elastic_trainer.launch.commands import SshSettings
    from elastic_trainer.launch.driver import launch
    from elastic_trainer.launch.job_setup import LaunchOptions, JobSetup, launch_train_argv

    train_args = _train_args(args)
    train_argv, schedule = launch_train_argv(args.model, args.config, args.data, args.schedule, train_args)
    opts = LaunchOptions(hosts=args.hosts, gpus_per_host=args.gpus_per_host, detect_self_ip=args.detect_self_ip,
                         schedule=schedule, run_dir=args.run_dir, checkpoint_dir=args.checkpoint_dir,
                         resume=args.resume, ssh=SshSettings(args.ssh_port, args.ssh_identity, tuple(args.ssh_option),
                                                  args.ssh_config),
                         force_ssh=tuple(args.force_ssh), rdzv_port=args.rdzv_port, rdzv_conf=tuple(args.rdzv_conf),
                         max_restarts=args.max_restarts, min_hosts=args.min_hosts, remote_root=args.remote_root,
                         train_argv=tuple(train_argv))
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


def run_import_deepspeed(args: argparse.Namespace) -> int:
    from elastic_trainer.checkpoint import deepspeed

    state = deepspeed.read_deepspeed(args.src)
    found = deepspeed.settings_of(state)
    if not args.config:  # a run TOML states its own settings; otherwise DeepSpeed's are the defaults
        for key in ("global_batch", "grad_clip", "weight_decay"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(found, key) or None)
    model, train, _ = resolve.job_configs(args)
    folder = deepspeed.import_deepspeed(args.src, args.out, model, train, state=state)
    source = f"--config {args.config}" if args.config else f"--model {args.model}"
    print(f"resume it in any layout: elastic-trainer train {source} --checkpoint-dir {args.out} --global-batch "
          f"{train.global_batch} --grad-clip {train.grad_clip} --weight-decay {train.weight_decay} plus this "
          f"import's --seq-len, --lr, schedule and --data (or `elastic-trainer launch --checkpoint-dir {args.out}`)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    model, train, layout_table = resolve.job_configs(args)
    result = resolve.planned(args, layout_table,
                             resolve.plan_request(args, model, train, layout_table, args.gpus, args.gpus_per_host))
    try:
        compare = result.best_for(*parse_degrees(args.compare, "--compare")) if args.compare else None
    except PlanError as err:
        raise PlanError(f"--compare {args.compare}: {err}") from None
    if args.json:
        print(json.dumps(plan_dict(result, compare), indent=1))
    else:
        print(format_table(result, args.top, compare))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.parallel.calibrate import calibrate
    from elastic_trainer.parallel.mesh import default_device

    import re

    from elastic_trainer.preflight import check_file_target

    check_file_target(args.output, "--output")  # before minutes of measuring, not after
    name = args.name or Path(args.output).stem
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"--name {name!r} is not a profile name (valid: letters, digits, '.', '_', '-')")
    base = load_hardware(args.base) if args.base else Hardware(name="base")
    ranks = [r.strip() for r in args.ranks.split(",") if r.strip()]
    if not ranks or not all(r.isascii() and r.isdigit() and 2 <= int(r) <= 64 for r in ranks):
        raise ConfigError(f"--ranks {args.ranks!r} must be rank counts from 2 to 64 separated by commas "
                          "(for example 2,4,8)")
    ranks = [int(r) for r in ranks]
    hw = calibrate(base, name, ranks, default_device())
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("# Measured by `elastic-trainer calibrate` (elastic_trainer/parallel/calibrate.py).\n"
                                 + hw.to_toml())
    print(f"[calibrate] wrote {args.output}")
    return 0


def _finish_worker(code: int, force: bool = False) -> int:
    """A torchrun worker whose files are closed and process groups destroyed ends here without Python's
    interpreter teardown, which takes ~2 s of 8 ranks on 2 cores and delays every reconfiguration."""
    if force or "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _recorded(fn):
    """Under torchrun, record an uncaught exception in the error file its agent reads, so a failing rank
    names itself (rank, host, traceback) in the agent's and the launcher's log."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def run_train_command(args, started: float, forked: bool) -> int:
    """Check every input before the process group forms (resolve, then preflight), then train."""
    from elastic_trainer import preflight

    preflight.check_environment()
    ckpt = resolve.checkpoint_config(args)
    model, train, layout, layout_table = resolve.resolve_train_args(args, world_size_from_env())
    tokens = preflight.train_inputs(args, model, train, ckpt)
    if args.check:
        planned = layout.describe() if layout is not None else "planned at start for the hosts the ranks are on"
        print(f"[check] inputs are valid: {model.name} on {world_size_from_env()} rank(s) ({planned}); data "
              f"{len(tokens):,} tokens; {preflight.resume_summary(ckpt)}; nothing was started")
        return 0
    code = _recorded(run_train)(args, model, train, layout, layout_table, ckpt, started, forked, tokens)
    return code if forked else _finish_worker(code)


def report_bad_input(error: Exception) -> int:
    """One line on stderr, exit code 2. Under torchrun the line also goes into the rank's error file (what
    torchrun and our agent report as the root cause), and only each host's local rank 0 prints it: every
    rank checks the same inputs and would print the same line."""
    message = " ".join(str(error).split()) or type(error).__name__
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        _write_error_file(error_file, message)
    if os.environ.get("LOCAL_RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ:
        print(f"elastic-trainer: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def _write_error_file(path: str, message: str) -> None:
    import time

    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": f"elastic-trainer: error: {message}",
                                   "extraInfo": {"py_callstack": f"elastic-trainer: error: {message}",
                                                 "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def main(argv: list[str] | None = None, *, started: float | None = None, forked: bool = False) -> int:
    """`started`: when this worker's process began (a forked one: at the fork; default: the package import);
    `forked`: a worker forked by the launcher's agent, which ends through multiprocessing's own exit."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["torchrun"] and not {"-h", "--help"} & set(argv[1:2]):
            from elastic_trainer.launch.agent import run_torchrun  # torchrun's flags are its parser's to read

            # its workers are gone: no interpreter teardown of torch (seconds, and a scheduler's second signal
            # could land in it), as the launcher's agents end
            return _finish_worker(run_torchrun(argv[1:]), force=True)
        args = build_parser().parse_args(argv)
        if args.command == "train":
            return run_train_command(args, started or IMPORTED_AT, forked)
        if args.command == "launch":
            return run_launch(args)
        if args.command == "checkpoint":
            return run_checkpoint(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "calibrate":
            return run_calibrate(args)
        if args.command == "experiment":
            return run_experiment(args)
        if args.command == "kubernetes":
            return run_kubernetes(args)
    except (ConfigError, CheckpointError) as e:
        code = report_bad_input(e)
        return code if forked else _finish_worker(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
