"""The life of one rank: read the job spec, join the process group, settle one layout with every rank, run the
job sequence (train.job) and exit with the restart contract's code (elastic.exit_codes).

    python -m elastic_trainer.rank --job RUN_DIR/job.json [--phase N]

The launcher's agents fork their workers into `worker` (launch/agent.py) and spawned or plain-torchrun
workers run this module; `elastic-trainer train` calls `run` in its own process. A rank never sees the flags
the job was described with: the spec was built and checked once (resolve.train_spec, launch.job_setup).

Rank 0 takes the spec's layout for the phase when the hosts it really got are the hosts the spec was planned
for, and plans again (saying why) when they differ, when the hardware was left to detection on the hosts, or
when earlier starts of the job measured step times on hosts of these sizes (plan/measured.py).
When no layout fits all the ranks (or the job's use_gpus prefers fewer), the first `used` ranks train and the
others wait idle (parallel/active.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass

from elastic_trainer import IMPORTED_AT
from elastic_trainer.config import CheckpointError, ConfigError
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT, PEER_STOP_ENV, error_line, exit_code
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.job_spec import JobSpec, PhaseSpec
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.topology import Topology
from elastic_trainer.test_hooks import count


@dataclass(frozen=True)
class Decision:
    """The layout every rank of this start runs, as rank 0 settled it."""

    layout: Layout
    line: str
    source: str
    """spec (the job spec's plan for these hosts), given (fixed by the user or the schedule), planned (here)."""
    reason: str
    """Why rank 0 planned ("" when it took the spec's layout)."""
    start: str
    """This start's id (its records, events and the idle ranks' store keys)."""
    held: int
    hosts: tuple[int, ...] = ()
    """The ranks on each host the layout was settled for."""

    @property
    def idle(self) -> int:
        return self.held - self.layout.world_size


def decide(spec: JobSpec, phase: PhaseSpec, topology: Topology, start: str) -> Decision:
    """Rank 0's choice of layout for these hosts (a ConfigError when a fixed layout does not fit them)."""
    from elastic_trainer import resolve

    held, hosts = topology.world_size, topology.sizes
    if phase.layout is not None and phase.pinned:
        layout = resolve.checked(phase.layout, spec, held)
        resolve.check_hosts(layout, spec.model, topology)
        return Decision(layout, f"[plan] given: {layout.describe()}", "given", "", start, held, hosts)
    layout = phase.layout
    hardware = spec.hardware or resolve.resolve_hardware(None)
    learned = resolve.learned(spec, hardware, topology)  # step times earlier starts measured on these hosts
    if (
        layout is not None
        and spec.hardware is not None
        and topology.same_hosts(phase.hosts)
        and topology.first(layout.world_size).within(layout.tp)
        and not learned
    ):
        idle = held - layout.world_size
        line = phase.plan_line or (
            f"[plan] as planned by {spec.built_by} for {topology.describe()}: "
            f"{layout.describe()}" + (f"; {idle} of the {held} GPUs idle" if idle else "")
        )
        return Decision(layout, line, "spec", "", start, held, hosts)
    if learned:
        reason = "with the step times and memory this job measured on these hosts"
    elif spec.hardware is None:
        reason = "the job's hardware is detected on the hosts"
    elif phase.hosts is None:
        reason = "the hosts were not known when the job was described"
    else:
        reason = f"planned for {Topology(phase.hosts).describe()}, got {topology.describe()}"
    layout, _, line = resolve.plan_for_hosts(spec, hardware, topology, learned)
    return Decision(layout, f"{line} [{reason}]", "planned", reason, start, held, hosts)


@dataclass
class Start:
    """One start of this rank: what each part of its life reads, gathered once by `run`."""

    spec: JobSpec
    phase: PhaseSpec
    env: TorchrunEnv
    device: object
    """torch.device of this rank."""
    stop: object
    """The StopRequest (signals, the stop file)."""
    events: object
    """The EventLog (rank 0 writes)."""
    tags: dict
    """phase, restart and this start's id: every record and event of the start carries them."""
    corpus: object
    """The train and validation token streams."""


def run(
    spec: JobSpec,
    phase_index: int | None,
    env: TorchrunEnv,
    *,
    started: float = IMPORTED_AT,
    forked: bool = False,
    corpus=None,
) -> int:
    """Join the process group, settle one layout, run the job; the exit code."""
    import torch.distributed as dist

    from elastic_trainer.elastic import StopRequest
    from elastic_trainer.elastic.events import EventLog
    from elastic_trainer.parallel import active, default_device, init_process_group

    spec = for_restart(spec, env)
    if corpus is None:
        corpus = load_corpus(spec, env)
    if env.under_torchrun:
        from elastic_trainer.elastic.lifetime import die_with_parent

        die_with_parent()  # a killed agent (a lost host) takes its workers with it; the survivors re-form
    device = default_device(env.local_rank)
    init_process_group(device, env.distributed)
    phase = spec.phase(phase_index)
    tags = {k: v for k, v in (("phase", phase.index), ("restart", env.restart_count)) if v is not None}
    tags["start"] = uuid.uuid4().hex[:8]  # this start's records and events (only rank 0 writes them)
    rank0 = dist.get_rank() == 0
    start = Start(
        spec,
        phase,
        env,
        device,
        StopRequest(spec.stop_file),
        EventLog(spec.events_file, enabled=rank0, tags=tags),
        tags,
        corpus,
    )
    store, decision, status, reason, idle_code = None, None, "stopped", None, None
    try:
        start.events.emit("processes_up", started=started, world_size=dist.get_world_size())
        decision = _settle(start)
        if decision.idle:
            store, idle_code = _narrow(decision, device, start.stop)
        if idle_code is None:
            status, reason = _train(start, decision, store)
    finally:
        start.stop.close()
        start.events.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if idle_code is not None:
        code = idle_code
    else:
        code = exit_code(status, reason, under_torchrun=env.under_torchrun, peer_stop=os.environ.get(PEER_STOP_ENV))
        if store is not None and rank0:
            active.release(store, decision.start, code, decision.idle)
    if forked and start.stop.reason == "SIGTERM":
        # The agent is stopping its workers: it will not collect a forked worker's return value (the worker
        # would wait for that until killed), and the state is saved.
        finish_worker(0, env, force=True)
    return code


def for_restart(spec: JobSpec, env: TorchrunEnv) -> JobSpec:
    """A worker group restarted by its agent goes on from the newest save: `--resume never` or `--resume PATH`
    meant the job's first start (never: the first save would refuse the restart; PATH: a step already passed)."""
    ckpt = spec.checkpoint
    if not env.restart_count or ckpt is None or ckpt.resume == "auto":
        return spec
    return dataclasses.replace(spec, checkpoint=dataclasses.replace(ckpt, resume="auto"))


def _settle(start: Start) -> Decision:
    """The hosts of every rank gathered, rank 0's decision agreed by all, said and recorded."""
    import torch.distributed as dist

    from elastic_trainer.parallel.agree import agree, gather_topology

    topology = gather_topology(start.env.group_rank)
    decision = agree(lambda: decide(start.spec, start.phase, topology, start.tags["start"]))
    if dist.get_rank() == 0:
        print(decision.line, flush=True)
    start.events.emit(
        "planned",
        layout=decision.layout.to_dict(),
        hosts=list(topology.sizes),
        source=decision.source,
        reason=decision.reason,
        idle=decision.idle,
        held=decision.held,
    )
    return decision


def _narrow(decision: Decision, device, stop):
    """Leave the world to the first `used` ranks; the store and, on an idle rank, its exit code (once the
    trainers are done; a stop file does not end the wait, a signal does)."""
    import torch.distributed as dist

    from elastic_trainer.parallel import active

    rank, used = dist.get_rank(), decision.layout.world_size
    store = active.narrow(used, decision.start, device)
    if rank < used:
        return store, None
    return store, active.wait_idle(store, decision.start, lambda: stop.reason is not None) or 0


def _train(start: Start, decision: Decision, store) -> tuple[str, str | None]:
    """The job sequence in the settled layout: (status, reason). When it raises on the trainers' rank 0 with
    GPUs idle (`store` set), the idle ranks are released with a failure too."""
    import torch.distributed as dist

    from elastic_trainer.train import MetricsLog, run_job

    spec, train, layout = start.spec, start.spec.train, decision.layout
    rank0 = dist.get_rank() == 0
    try:
        _say_host_ranks(dist.get_rank(), dist.get_world_size(), start.env)
        board = None
        if rank0 and train.tensorboard:
            from elastic_trainer.train.tensorboard import TensorBoardLog

            board = TensorBoardLog(train.tensorboard, train.metrics_file)
        log = MetricsLog(
            train.metrics_file,
            enabled=rank0,
            log_every=train.log_every,
            total_steps=train.steps,
            tags=start.tags,
            board=board,
        )
        # this start's step time, recorded before its save or hand-over: the next world may plan with it
        on_stop = None
        if rank0 and decision.hosts:
            on_stop = functools.partial(_record_measured, spec, layout, decision.hosts, device_type=start.device.type)
        result = run_job(
            spec.model,
            train,
            layout,
            start.device,
            ckpt=spec.checkpoint,
            stop=start.stop,
            until=start.phase.until_step,
            log=log,
            events=start.events,
            tokens=start.corpus.train,
            val_tokens=start.corpus.val,
            handover=_handover(start.phase, start.env),
            on_stop=on_stop,
        )
        log.close()
    except BaseException as e:
        if store is not None and rank0:
            from elastic_trainer.parallel import active

            bad = isinstance(e, (ConfigError, CheckpointError))
            active.release(store, decision.start, EXIT_BAD_INPUT if bad else 1, 0)
        raise
    if rank0 and train.skip_bad_records:
        from elastic_trainer.data.corpus import skipped_note

        print(f"[data] {skipped_note(train)}", flush=True)
    return result.status, result.reason


def _record_measured(
    spec: JobSpec, layout: Layout, hosts: tuple[int, ...], records: list[dict], device_type: str
) -> None:
    """This start's steady step time for the job's later plans (plan/measured.py). Whatever goes wrong here
    costs the job nothing but the lesson: the training is done."""
    from elastic_trainer.resolve import record_measured

    try:
        record_measured(spec, layout, hosts, records, device_type)
    except Exception as e:  # noqa: BLE001 (best effort by design)
        print(f"[plan] this start's step time was not recorded: {e}", file=sys.stderr, flush=True)


def _handover(phase: PhaseSpec, env: TorchrunEnv):
    """The launcher's channel for this world (its rendezvous id; None outside the launcher); `warm` when the launcher
    started this world beside the current one (ELASTIC_TRAINER_WARM, set for its agents) and it has not
    loaded its state yet (a restart after that resumes as any restart does)."""
    import torch.distributed as dist

    from elastic_trainer.elastic.handover import WARM_ENV, Control, Handover

    control = Control.from_environment() if phase.index is not None and env.run_id else None
    if control is None:
        return None
    mode = os.environ.get(WARM_ENV)
    warm = mode in ("early", "late") and control.get(env.run_id, "loaded") is None
    return Handover(control, env.run_id, warm, late=mode == "late", ranks=dist.get_world_size())


def load_corpus(spec: JobSpec, env: TorchrunEnv):
    """The job's train and validation streams, memory-mapped from what the job's describer prepared (the
    spec's `prepared_data`: no raw file is read or checked here). A host that cannot see it prepares its own
    copy from the raw files (its first rank, with progress; the others wait on the lock)."""
    from elastic_trainer.data.corpus import load, visible

    quiet = env.local_rank != 0
    if spec.prepared_data and visible(spec.prepared_data + spec.prepared_val):
        return load(spec.train, quiet=quiet, prepared=spec.prepared_data, prepared_val=spec.prepared_val)
    return load(spec.train, quiet=quiet)


def _say_host_ranks(rank: int, world: int, env: TorchrunEnv) -> None:
    """Under torchrun, one line per host: which global ranks it holds (torchrun numbers a host's ranks
    consecutively)."""
    if env.local_rank == 0 and env.group_rank is not None and env.under_torchrun and rank < world:
        import socket

        last = min(rank + env.local_world_size, world) - 1
        print(f"[ranks] {socket.gethostname()} (host {env.group_rank}): ranks {rank}-{last} of {world}", flush=True)


# -- the process's end ---------------------------------------------------------------------------------------


def finish_worker(code: int, env: TorchrunEnv, force: bool = False) -> int:
    """A torchrun worker whose files are closed and process groups destroyed ends here without Python's
    interpreter teardown, which takes ~2 s of 8 ranks on 2 cores and delays every reconfiguration."""
    if force or env.under_torchrun:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def recorded(fn, env: TorchrunEnv):
    """Under torchrun, record an uncaught exception in the error file its agent reads, so a failing rank
    names itself (rank, host, traceback) in the agent's and the launcher's log."""
    if not env.under_torchrun:
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def report_bad_input(error: Exception, env: TorchrunEnv, quiet: bool = False) -> int:
    """One line on stderr, exit code 2. Under torchrun the line also goes into the rank's error file (what
    torchrun and our agent report as the root cause), and only each host's local rank 0 prints it: every
    rank checks the same inputs and would print the same line. `quiet`: a worker forked by our agent prints
    nothing; the agent prints the line of the first rank that failed (launch/agent.py). The file is written
    after the line is printed: the agent takes a line in local rank 0's file as printed."""
    line = error_line(str(error) or type(error).__name__)
    if not quiet and (env.local_rank == 0 or not env.under_torchrun):
        print(line, file=sys.stderr, flush=True)
    if env.error_file:
        try:
            with open(env.error_file, "w") as f:
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
                        }
                    },
                    f,
                )
        except OSError:
            pass
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None, *, started: float | None = None, forked: bool = False) -> int:
    """`--job PATH [--phase N]`: the spec read once, then `run`. `forked`: a worker forked by our agent, which
    ends through multiprocessing's own exit."""
    from elastic_trainer.cli_parser import NON_NEGATIVE, Parser

    parser = Parser(prog="python -m elastic_trainer.rank", description="one rank of a described job")
    parser.add_argument("--job", required=True, help="the job spec (job.json)")
    parser.add_argument("--phase", type=NON_NEGATIVE, help="the schedule phase this start runs")
    env = TorchrunEnv.lenient()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        env = TorchrunEnv.read()
        spec = JobSpec.read(args.job)
        count("read_spec")
        code = recorded(run, env)(spec, args.phase, env, started=started or IMPORTED_AT, forked=forked)
    except (ConfigError, CheckpointError) as e:
        code = report_bad_input(e, env, quiet=forked)
    return code if forked else finish_worker(code, env)


if __name__ == "__main__":
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()  # a worker torchrun started as a process of its own
    sys.exit(main())
