"""The agent of one host: TorchElastic's agent, as the torchrun command line configures it, in a process that
dies with its parent (the launcher, or remote.sh on another host), so no agent outlives its job.

    python -m elastic_trainer.launch.agent TORCHRUN-ARGS... -m elastic_trainer.rank --job RUN_DIR/job.json --phase N

When the workers run `elastic_trainer.rank`, the agent imports the training stack once and forks its workers
(TorchElastic's `start_method="fork"` with a function entrypoint) instead of starting fresh interpreters: each
new interpreter spends ~2.4 s of CPU importing torch, DTensor, FSDP, DCP and the pipeline schedules, which
on a host with few cores per rank was most of a reconfiguration's downtime. Everything else (rendezvous,
restarts, membership changes, error files) is TorchElastic's, with one change: a worker that exits with the
bad-input code (2: a wrong input, or a diverged run) is not restarted, since a restart would fail the same
way; the agent exits with that code, the worker's one-line error on top instead of torchrun's report. Any
other entrypoint runs exactly as under torchrun. The agent never touches CUDA, so forked workers can still
use it.

`elastic-trainer torchrun [TORCHRUN FLAGS] train ...` is this agent for users: it checks the train inputs
once before any worker starts.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from elastic_trainer.elastic.exit_codes import ERROR_MARK, EXIT_BAD_INPUT, FINAL_CODES, error_line
from elastic_trainer.elastic.handover import CONTROL_ENV
from elastic_trainer.elastic.lifetime import die_with_parent
from elastic_trainer.launch.allocator import restart_keeping_freed_memory
from elastic_trainer.launch.forked import (
    NVML_CHECK_ENV,
    START_ENV,
    refuse_poisoned_cuda,  # noqa: F401
    signals_as_after_exec,
)

WORKER_MODULE = "elastic_trainer.rank"
LAUNCHER_GONE = signal.SIGUSR2
"""What stops a launcher's agent as SIGTERM stops any other (its ranks save, it exits 143): the launcher's death
(the kernel's parent-death signal here, remote.sh's on another host) and the launcher's own stop."""
EXIT_BARRIER_S = 30.0
"""How long a launcher's agent whose workers finished waits for the other agents (TorchElastic: 300 s, for an
agent that hosts the store; an agent stopped by SIGTERM never arrives)."""


def preload() -> None:
    """Import what every worker imports, so forked workers start with it loaded (no CUDA calls here)."""
    import torch.distributed.pipelining  # noqa: F401  (torch._dynamo)

    import elastic_trainer.data  # noqa: F401
    import elastic_trainer.parallel.agree  # noqa: F401
    import elastic_trainer.rank  # noqa: F401
    import elastic_trainer.train  # noqa: F401


def worker(*argv: str) -> int:
    """A forked worker: `python -m elastic_trainer.rank ARGV`; a non-zero code fails the worker as a process
    exit would."""
    from elastic_trainer import rank
    from elastic_trainer.launch.relay import whole_lines

    signals_as_after_exec()
    whole_lines()  # this host's ranks share one pipe
    refuse_poisoned_cuda()
    code = rank.main(list(argv), started=time.time(), forked=True)
    if code:
        raise SystemExit(code)
    return code


_events = None
"""The run's event log as this agent writes it (set by run_agent when the workers train with --events-file)."""
_rdzv_endpoint = ""


def _emit(event: str, **fields) -> None:
    if _events is not None:
        _events.emit(event, **fields)


def _open_events(entry_args: list[str]) -> None:
    """Agents record their side of a restart (when they saw the workers fail, when the rendezvous completed) in
    the events file the ranks write, tagged writer=agent and the host."""
    global _events
    from elastic_trainer.elastic.events import EventLog

    def flag(name: str) -> str | None:
        return entry_args[entry_args.index(name) + 1] if name in entry_args[:-1] else None

    job, phase = flag("--job"), flag("--phase")
    path = None
    if job:
        from elastic_trainer.config import ConfigError
        from elastic_trainer.job_spec import JobSpec

        try:
            spec = JobSpec.read(job)
        except ConfigError:
            spec = None  # the ranks say what is wrong with it
        if spec is not None:
            path = spec.events_file
            if phase is None:  # `elastic-trainer torchrun ... train --phase N`: the spec's phase
                phase = None if spec.phases[0].index is None else str(spec.phases[0].index)
    if path and _events is None:
        import socket

        from elastic_trainer.launch.commands import HOST_ENV

        tags = {"writer": "agent", "host": os.environ.get(HOST_ENV) or socket.gethostname(), "pid": os.getpid()}
        if phase is not None and phase.isdigit():
            tags["phase"] = int(phase)
        _events = EventLog(path, tags=tags)


def _agent_class() -> None:
    """Make TorchElastic's agent (as `elastic_launch` builds it, in this process only) skip its restarts once a
    worker exits with EXIT_BAD_INPUT, and record its restarts in the run's events."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import WorkerState

    base = launcher_api.LocalElasticAgent
    if getattr(base, "_elastic_trainer", False):
        return

    class Agent(base):
        _elastic_trainer = True

        def __init__(self, spec, *args, **kwargs):
            super().__init__(spec, *args, **kwargs)
            if os.environ.get(CONTROL_ENV):  # the launcher hosts the store: no agent must outlive the others
                self._exit_barrier_timeout = EXIT_BARRIER_S
            from elastic_trainer.launch import live_hosts

            why = live_hosts.from_environment(spec.rdzv_handler, _rdzv_endpoint)
            if why:
                print(
                    f"[agent] warning: the rendezvous waits its last call after a lost host: {why}",
                    file=sys.stderr,
                    flush=True,
                )
            from elastic_trainer.launch import heartbeat

            self._heartbeat = heartbeat.start_for_agent(self, _rdzv_endpoint)

        def _restarts(self) -> int:
            return self._worker_group.spec.max_restarts - self._remaining_restarts

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and any(
                f.exitcode == EXIT_BAD_INPUT for f in result.failures.values()
            ):
                self._remaining_restarts = 0
            return result

        def _start_workers(self, worker_group):
            if self._heartbeat is not None:
                self._heartbeat.acknowledge()
            return super()._start_workers(worker_group)

        def _restart_workers(self, worker_group):
            state = worker_group.state
            reason = "a host joined" if state == WorkerState.HEALTHY else f"workers {state.name.lower()}"
            _emit("workers_restarting", reason=reason, restart=self._restarts())
            return super()._restart_workers(worker_group)

        def _rendezvous(self, worker_group):
            began = time.time()
            super()._rendezvous(worker_group)
            _emit(
                "rendezvous_done",
                began=began,
                hosts=worker_group.group_world_size,
                group_rank=worker_group.group_rank,
                restart=self._restarts(),
            )

    launcher_api.LocalElasticAgent = Agent
    # TorchElastic logs a failed worker with the traceback of its own exit-code check; for bad input the
    # worker's one line is the whole story
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_quiet_bad_input)


def _quiet_bad_input(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    if getattr(error, "exit_code", None) in FINAL_CODES:
        return False
    return not any(f"(exitcode: {code})" in record.getMessage() for code in FINAL_CODES)


def _message(failure) -> str:
    message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
    return str(message or "")


def _failure_line(error, workers_print: bool = True) -> tuple[int, str | None]:
    """(exit code, the one line to print or None) of TorchElastic's ChildFailedError. `workers_print`: local
    rank 0 printed its line itself (spawned workers); forked ones leave it to the agent."""
    _, failure = error.get_first_failure()
    if failure.exitcode != EXIT_BAD_INPUT:
        return failure.exitcode, None
    if not workers_print:  # the failures name only the ranks that failed before the agent stopped the rest
        lines = [_message(f) for f in (failure, *error.failures.values()) if _message(f)]
        return EXIT_BAD_INPUT, lines[0] if lines else None
    # local rank 0 printed its line already (rank.report_bad_input): print another rank's line only when local
    # rank 0 did not fail the same way (the first failure is whichever rank's error file came first). Local
    # rank 0 writes its error file after printing, so a line in it was printed even when the agent stopped
    # rank 0 (after another rank failed) before it could exit with the code.
    printed = any(
        f.local_rank == 0 and (f.exitcode == EXIT_BAD_INPUT or _message(f).startswith(ERROR_MARK))
        for f in error.failures.values()
    )
    return EXIT_BAD_INPUT, (_message(failure) or None) if not printed else None


def _rendezvous_defaults(args) -> None:
    """What the torchrun command does to its arguments before launching (torch.distributed.run.run): a
    --standalone job, or a single-host job without a rendezvous, gets a private c10d rendezvous on a free
    local port; the static backend's port defaults to 29500."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    single_host = (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    )
    if args.standalone or single_host:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def agent_config(argv: list[str]):
    """A torchrun command line checked (one line on an error) and turned into TorchElastic's launch config,
    entrypoint and arguments; `python -m elastic_trainer.rank` workers become forked ones."""
    from torch.distributed.run import config_from_args, get_args_parser

    from elastic_trainer.cli_parser import UsageError

    parser = get_args_parser()

    def one_line(message: str):
        raise UsageError(f"torchrun: {message} (see torchrun --help)")

    parser.error = one_line
    args = parser.parse_args(argv)
    _rendezvous_defaults(args)
    forking = os.environ.get(START_ENV, "fork") == "fork"
    if forking:
        # TorchElastic's LaunchConfig asks torch.cuda.is_available() (for its NUMA defaults), and the CUDA
        # runtime's device count poisons fork: every forked worker then failed "Cannot re-initialize CUDA in
        # forked subprocess" (an H100 lease, 2026-11-26). torch's switch makes the check ask NVML instead.
        os.environ[NVML_CHECK_ENV] = "1"
    try:
        config, entrypoint, entry_args = config_from_args(args)
    except ValueError as e:
        raise UsageError(f"torchrun: {' '.join(str(e).split())}") from None
    if forking and args.module and args.training_script == WORKER_MODULE and not args.no_python:
        config.start_method = "fork"
        entrypoint, entry_args = worker, list(args.training_script_args)
    return config, entrypoint, entry_args


def run_agent(configured) -> int:
    """TorchElastic's agent for a torchrun command line's `agent_config`: 0 when the workers succeeded,
    EXIT_BAD_INPUT after a worker's one-line bad-input error (not restarted), 128 + N after signal N stopped
    the agent (its ranks got it too, and saved); any other failure raises TorchElastic's ChildFailedError."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from elastic_trainer.cli_parser import UsageError

    global _rdzv_endpoint
    config, entrypoint, entry_args = configured
    if entrypoint is worker:
        preload()
    _rdzv_endpoint = config.rdzv_endpoint
    _agent_class()
    _open_events([str(a) for a in entry_args])
    if os.environ.get(CONTROL_ENV):  # the launcher's agent: SIGTERM is a notice, LAUNCHER_GONE the stop
        from elastic_trainer.launch.notices import take_sigterm_as_notice

        take_sigterm_as_notice(config, LAUNCHER_GONE)
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)  # raises when the workers failed
    except ValueError as e:  # a rendezvous setting TorchElastic rejects before any worker starts
        raise UsageError(f"torchrun: {' '.join(str(e).split())}") from None
    except SignalException as e:
        # A scheduler's stop (Slurm's requeue, preemption or time limit; a Kubernetes pod's end): TorchElastic
        # has passed the signal to the ranks and waited for them; they saved after their current step. The same
        # signal again (a scheduler cancelling the step sends its own) must not interrupt the rest of the exit.
        signal.signal(e.sigval, signal.SIG_IGN)
        name = signal.Signals(e.sigval).name
        print(
            f"[agent] stopped by {name}: the ranks were asked to save after their current step",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        code, line = _failure_line(e, workers_print=entrypoint is not worker)
        if code != EXIT_BAD_INPUT:
            raise
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


def run_torchrun(argv: list[str]) -> int:
    """`elastic-trainer torchrun [TORCHRUN FLAGS] train [TRAIN FLAGS]`: torchrun's flags checked, then the job
    described once (the spec, its inputs checked: one line, exit 2), then the agent with forked workers that
    read the spec."""
    import shutil
    import tempfile

    from elastic_trainer import preflight, resolve
    from elastic_trainer.cli_parser import UsageError, train_args

    if "train" not in argv:
        raise UsageError(
            "elastic-trainer torchrun needs `train` and its flags after torchrun's flags (for example "
            "elastic-trainer torchrun --standalone --nproc-per-node 4 train --model gpt-tiny)"
        )
    split = argv.index("train")
    flags, train_argv = argv[:split], argv[split + 1 :]
    if any(f in ("-m", "--module", "--no-python", "--no_python") for f in flags):
        raise UsageError("elastic-trainer torchrun runs `train` itself: drop -m/--no-python and the script")
    folder = tempfile.mkdtemp(prefix="elastic-trainer-job-")
    try:
        job = os.path.join(folder, "job.json")
        config, entrypoint, entry_args = agent_config([*flags, "-m", WORKER_MODULE, "--job", job])
        preflight.check_environment()
        per_host, fixed = int(config.nproc_per_node), config.min_nodes == config.max_nodes
        args = train_args(train_argv)
        # no hardware detection here: it would initialize CUDA in the agent, and its forked workers could not
        spec = resolve.train_spec(
            args,
            built_by="torchrun",
            world_size=per_host * config.max_nodes if fixed else None,
            local_world_size=per_host,
            hosts_known=config.max_nodes == 1,
            detect_hardware=False,
        )
        from elastic_trainer.data.corpus import say, with_data

        corpus = preflight.train_inputs(spec)
        say(corpus)
        spec = with_data(spec, corpus)
        if args.check:
            print(
                f"[check] inputs are valid: {spec.model.name} on {per_host} rank(s) per host, "
                f"{config.min_nodes}..{config.max_nodes} host(s); {corpus.describe()}; "
                f"{preflight.resume_summary(spec.checkpoint)}; nothing was started"
            )
            return 0
        spec.write(job)
        return run_agent((config, entrypoint, entry_args))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


PARKED = "--parked"
"""`python -m elastic_trainer.launch.agent --parked`: an agent started ahead of its world (launch/driver.py)."""


def unpark() -> list[str] | None:
    """A parked agent imports the training stack now, while the job trains, then waits for its command line and
    the environment of its world: one JSON line on stdin, {"argv": [...], "env": {...}}. None when stdin
    closes first (the launcher needs it no more)."""
    import json

    preload()
    line = sys.stdin.readline()
    if not line:
        return None
    order = json.loads(line)
    os.environ.update(order["env"])
    return list(order["argv"])


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # this process's entry point: its workers inherit the allocator (launch/allocator.py)
        restart_keeping_freed_memory()
    # SIGTERM, not SIGKILL: TorchElastic turns it into stopping the workers (which save if they can).
    die_with_parent(signal.SIGTERM)
    from elastic_trainer.config import ConfigError
    from elastic_trainer.launch.relay import start_relay

    argv = sys.argv[1:] if argv is None else argv
    if argv == [PARKED]:
        argv = unpark()
        if argv is None:
            os._exit(0)
    if os.environ.get(CONTROL_ENV):  # the launcher's agent: its SIGTERM is a scheduler's (launch/notices.py)
        die_with_parent(LAUNCHER_GONE)

    relay = start_relay()  # under the launcher: the ranks' output outlives the launcher
    if relay is not None and relay.log_error:
        print(f"[agent] warning: {relay.log_error}; the output goes to the launcher only", file=sys.stderr, flush=True)
    try:
        code = run_agent(agent_config(argv))
    except ConfigError as e:
        print(error_line(str(e)), file=sys.stderr)
        code = EXIT_BAD_INPUT
    except BaseException:  # TorchElastic's report of failed workers, or a bug: its traceback, through the relay
        import traceback

        traceback.print_exc()
        code = 1
    # Its workers are gone and its output flushed; skip the interpreter's teardown of torch (about a second on
    # a busy host), which would only delay the next phase's start.
    sys.stdout.flush()
    sys.stderr.flush()
    if relay is not None:
        relay.close()
    os._exit(code)


if __name__ == "__main__":
    main()
