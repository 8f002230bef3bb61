"""Everything the launcher settles before it starts anything: hosts, schedule, the job's configs, a plan for
every phase, paths, the rendezvous endpoint and each host's command. Bad input of any kind is a one-line
ConfigError here, before a file is written or a process started (so a dry run checks exactly what a run would).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer import resolve
from elastic_trainer.cli_parser import train_args
from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.events import EVENTS_FILE, read_jsonl
from elastic_trainer.elastic.schedule import Phase, load_schedule, phase_at, run_end, step_ends
from elastic_trainer.job_spec import JOB_FILE, JobSpec, PhaseSpec
from elastic_trainer.launch import live_hosts
from elastic_trainer.launch.commands import (
    AGENT_ENV,
    HOST_ENV,
    RDZV_CONF,
    AgentSpec,
    Placement,
    SshSettings,
    allocate,
    host_command,
)
from elastic_trainer.launch.hosts import HostsError, default_slots, interface_ipv4, is_local, read_hosts
from elastic_trainer.launch.relay import LOG_ENV
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.topology import Topology

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# `train` flags the launcher sets itself, per phase
OWNED_FLAGS = (
    "--checkpoint-dir",
    "--metrics-file",
    "--events-file",
    "--stop-file",
    "--until-step",
    "--phase",
    "--resume",
)
FORWARDED_ENV_PREFIXES = ("ELASTIC_TRAINER_", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_", "HF_")


@dataclass
class LaunchOptions:
    hosts: str = "hosts.txt"
    gpus_per_host: int | None = None
    detect_self_ip: str | None = None
    schedule: str | None = None
    run_dir: str = "runs/default"
    checkpoint_dir: str | None = None
    resume: bool = False
    ssh: SshSettings = field(default_factory=SshSettings)
    force_ssh: tuple[str, ...] = ()
    rdzv_port: int = 0
    rdzv_conf: tuple[str, ...] = ()
    max_restarts: int = 3
    min_hosts: int = 1
    remote_root: str | None = None
    warm_start: bool = True
    """Start the next phase's world beside the current one and hand the state over in memory (launch/warm.py)."""
    notice_grace_s: float = 30.0
    """Seconds between a scheduler's SIGTERM to a host's agent and its SIGKILL (launch/notices.py)."""
    hang_timeout_s: float = 10.0
    """Seconds without a host's heartbeat before the launcher cuts it off (launch/heartbeat.py); 0: never."""
    train_argv: tuple[str, ...] = ()
    """`train` arguments for every rank (model, data and training settings)."""


DEFAULT_RUN = "default"
"""configs/runs/default.toml: the job ./run.sh runs with no arguments."""


def launch_train_argv(
    model: str | None, config: str | None, data: list[str] | None, schedule: str | None, train_args: list[str]
) -> tuple[list[str], str | None]:
    """The `train` arguments every rank gets (paths made absolute: remote hosts start in the project folder)
    and the schedule: --schedule, else the run config's [launch] schedule; 'none' means no schedule."""
    from elastic_trainer.config import configs_dir, load_run_config

    if model is None and config is None:
        config = str(configs_dir() / "runs" / f"{DEFAULT_RUN}.toml")
    if config is not None:
        argv = ["--config", str(Path(config).resolve())]
        schedule = schedule or load_run_config(config).launch.get("schedule")
    else:
        argv = ["--model", str(Path(model).resolve()) if Path(model).suffix else model]
    if data:
        argv += ["--data", *(d if d == "sotu" else str(Path(d).resolve()) for d in data)]
    return [*argv, *train_args], None if schedule in (None, "none") else schedule


def _owned(argv: tuple[str, ...]) -> str | None:
    return next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in OWNED_FLAGS), None)


class JobSetup:
    def __init__(self, opts: LaunchOptions):
        self.opts = opts
        if opts.gpus_per_host is not None and opts.gpus_per_host < 1:
            raise HostsError(f"--gpus-per-host {opts.gpus_per_host} must be a positive integer")
        self.hosts = read_hosts(opts.hosts, opts.gpus_per_host or default_slots())
        names = {h.name for h in self.hosts}
        unknown = [n for n in opts.force_ssh if n not in names]
        if unknown:
            raise HostsError(f"--force-ssh {unknown[0]!r} is not a host of {opts.hosts}")
        self.total_slots = sum(h.slots for h in self.hosts)
        self.hosts_changed = False
        """The hosts are no longer the file's as the job started (launch/notices.py): phases take what there is."""
        self.phases = load_schedule(opts.schedule) if opts.schedule else [Phase(self.total_slots)]
        if "--check" in opts.train_argv:
            raise ConfigError(
                "--check is train's; `launch --dry-run` checks the whole job and prints each phase's plan and command"
            )
        owned = _owned(opts.train_argv)
        if owned:
            raise ConfigError(
                f"{owned} is set by launch for every phase; use launch's own options "
                "(--checkpoint-dir, --run-dir, --resume, --schedule)"
            )
        self.run_dir = Path(opts.run_dir).resolve()
        self.checkpoint_dir = Path(opts.checkpoint_dir or self.run_dir / "checkpoints").resolve()
        self.stop_file = self.run_dir / "stop"
        self.job_file = self.run_dir / JOB_FILE
        self.iface = interface_ipv4(opts.detect_self_ip) if opts.detect_self_ip else None
        base = self._describe_job(train_args(list(opts.train_argv)))
        self.plans = [self._plan(base, i, p) for i, p in enumerate(self.phases)]
        self.spec = dataclasses.replace(base, phases=tuple(phase for phase, _ in self.plans))
        self.model, self.train = self.spec.model, self.spec.train

    def _describe_job(self, args) -> JobSpec:
        """The job as every rank will run it, without its phases: configs, checkpoints, outputs, hardware (given,
        or this machine's when every host is this machine; else detected by rank 0 on the hosts)."""
        spec = resolve.describe_job(
            args,
            built_by="launch",
            detect_hardware=self._all_local_if_placed(),
            checkpoint=(str(self.checkpoint_dir), "auto"),
            events_file=str(self.run_dir / EVENTS_FILE),
            stop_file=str(self.stop_file),
            metrics_file=str(self.run_dir / "metrics.jsonl"),
        )
        if spec.layout.degrees is not None and any(p.layout for p in self.phases):
            raise ConfigError(
                f"the schedule {self.opts.schedule} pins layouts per phase; drop --layout (or the run "
                "config's [layout] degrees)"
            )
        return spec

    # -- checks and plans -------------------------------------------------------------------------------

    def placements(self, phase: Phase) -> list[Placement]:
        """The phase's ranks over the hosts; once the hosts changed, as many of them as there are slots."""
        gpus = min(phase.gpus, sum(h.slots for h in self.hosts)) if self.hosts_changed else phase.gpus
        if phase.waits or gpus == 0:
            return []
        return [
            Placement(h, n, is_local(h.name) and h.name not in self.opts.force_ssh)
            for h, n in allocate(self.hosts, gpus, self.opts.hosts)
        ]

    def use_hosts(self, hosts: list) -> None:
        """The hosts from now on (a notice or an edit of the hosts file): later starts are placed on them."""
        self.hosts, self.hosts_changed = list(hosts), True

    def pinned_layout(self, spec: JobSpec, phase: Phase) -> Layout | None:
        """The layout the phase (or the flags) pins, completed as the ranks complete --layout."""
        if phase.layout is None:
            return resolve.given_layout(spec)
        return resolve.layout_of(spec, phase.layout, phase.micro_batch)

    def _plan(self, spec: JobSpec, index: int, phase: Phase) -> tuple[PhaseSpec, str]:
        """The phase as the ranks will run it, with the layout rank 0 takes for these hosts, and the plan's line."""
        where = (
            f"schedule phase {index + 1} ({phase.gpus} GPUs)"
            if self.opts.schedule
            else f"all {phase.gpus} GPUs of {self.opts.hosts}"
        )
        until = step_ends(self.phases)[run_end(self.phases, index)] if phase.steps is not None else None
        if phase.waits:
            return PhaseSpec(index, until), "[plan] no GPUs: the job waits"
        try:
            topology = Topology(tuple(p.nproc for p in self.placements(phase)))
            layout = self.pinned_layout(spec, phase)
            if layout is not None:
                layout = resolve.checked(layout, spec, topology.world_size)
                resolve.check_hosts(layout, spec.model, topology)
                return PhaseSpec(index, until, topology.sizes, layout, True), f"[plan] given: {layout.describe()}"
            if spec.hardware is None:  # the bad settings still fail here, planned with this machine's profile
                resolve.plan_for_hosts(spec, resolve.resolve_hardware(None), topology)
                return (
                    PhaseSpec(index, until, topology.sizes),
                    "[plan] made by rank 0 at start for the hosts' GPUs (give --hardware to plan here)",
                )
            layout, _, line = resolve.plan_for_hosts(spec, spec.hardware, topology)
            return PhaseSpec(index, until, topology.sizes, layout), line
        except ConfigError as e:
            raise type(e)(f"{where}: {e}") from None

    # -- the run's state --------------------------------------------------------------------------------

    def newest_checkpoint(self) -> tuple[Path, dict] | None:
        from elastic_trainer.checkpoint.storage import complete_checkpoints, read_meta

        found = complete_checkpoints(self.checkpoint_dir) if self.checkpoint_dir.is_dir() else []
        return (found[0], read_meta(found[0])) if found else None

    def checkpoint_step(self) -> int:
        """Step of the newest complete checkpoint (0 when there is none)."""
        newest = self.newest_checkpoint()
        return newest[1]["step"] if newest else 0

    def first_phase(self) -> int | None:
        """Where a (re)started job begins: a steps schedule from the checkpoint's step, a time schedule at the
        phase that was running when it stopped (in full), no schedule at its one phase."""
        newest = self.newest_checkpoint()
        if self.opts.resume and newest is None:
            raise ConfigError(f"--resume: no complete checkpoint in {self.checkpoint_dir}")
        if newest is not None:  # another model or trajectory: say so now, not from every rank later
            from elastic_trainer.checkpoint.state import check_compatible
            from elastic_trainer.data.corpus import content_id

            check_compatible(newest[1], self.model, self.train, str(newest[0]), content_id(self.train))
        step = newest[1]["step"] if newest else 0
        if step >= self.train.steps:
            return None
        if self.phases[0].steps is not None:
            return phase_at(self.phases, step)
        launched = [e for e in read_jsonl(self.run_dir / EVENTS_FILE) if e["event"] == "launched"]
        return launched[-1]["phase"] if launched and step > 0 else 0

    def check_inputs(self) -> None:
        """What the ranks would check before their process group forms, once here before anything starts: the
        run and checkpoint folders, the data cache, the data (every text file's start sampled)."""
        from elastic_trainer import preflight
        from elastic_trainer.data import read
        from elastic_trainer.data.corpus import default_cache_dir
        from elastic_trainer.data.sources import resolve

        preflight.check_dir_target(self.run_dir, "--run-dir")
        preflight.check_dir_target(self.checkpoint_dir, "--checkpoint-dir")
        preflight.check_dir_target(self.train.data_cache or default_cache_dir(), "the data cache (--data-cache)")
        preflight.check_tracing(self.train)
        for data in (self.train.data, self.train.val_data):
            if data:
                resolved = resolve(data, self.train.data_split, validation=data is self.train.val_data)
                read.sample(
                    resolved.text + resolved.validation,
                    skip=self.train.skip_bad_records,
                    text_field=self.train.text_field,
                )

    def prepare_data(self):
        """Prepare the job's data once, here, into the data cache the hosts read (progress on stderr); the
        corpus, whose content digest the newest checkpoint must match."""
        from elastic_trainer.data.corpus import prepare_for_job, with_data

        corpus = prepare_for_job(self.train, sampled=True)  # check_inputs read every text file's start
        self.spec = with_data(self.spec, corpus)
        newest = self.newest_checkpoint()
        if newest:
            from elastic_trainer.checkpoint.state import check_compatible

            check_compatible(newest[1], self.model, self.train, str(newest[0]), corpus.data_id)
        return corpus

    # -- what each host runs ----------------------------------------------------------------------------

    def _all_local_if_placed(self) -> bool:
        """`all_local`, False when a phase cannot be placed (its plan says so, naming the phase)."""
        try:
            return self.all_local
        except HostsError:
            return False

    @functools.cached_property
    def all_local(self) -> bool:
        """Every host of every phase is this machine (fixed by the hosts, schedule and --force-ssh)."""
        return all(p.local for phase in self.phases for p in self.placements(phase))

    def endpoint_host(self) -> str:
        """Where agents reach the launcher's rendezvous store: --detect-self-ip's address, loopback when every
        host is this machine, else this machine's name."""
        if self.iface:
            return self.iface
        return "127.0.0.1" if self.all_local else socket.gethostname()

    def endpoint_warning(self) -> str | None:
        """A warning when remote hosts would be sent to a name that resolves to loopback here."""
        if self.iface or self.all_local:
            return None
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            return None
        if address.startswith("127."):
            return (
                f"warning: this machine's name {socket.gethostname()!r} resolves to {address} here; if the "
                "other hosts cannot reach it by that name, give --detect-self-ip IFACE"
            )
        return None

    def agent_env(self) -> dict[str, str]:
        import os

        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        env.setdefault("OMP_NUM_THREADS", "1")
        iface = self.opts.detect_self_ip or ("lo" if self.all_local else None)
        if iface:
            env.setdefault("GLOO_SOCKET_IFNAME", iface)
            env.setdefault("NCCL_SOCKET_IFNAME", iface)
        return env

    def agent_spec(
        self, index: int, phase: Phase, placements: list[Placement], port: int | str, job_id: str = "et-job"
    ) -> AgentSpec:
        conf = dict(RDZV_CONF)
        for item in self.opts.rdzv_conf:
            key, _, value = item.partition("=")
            conf[key] = value
        return AgentSpec(
            run_id=f"{job_id}-p{index}",
            endpoint=f"{self.endpoint_host()}:{port}",
            max_nodes=len(placements),
            min_nodes=min(self.opts.min_hosts, len(placements)),
            max_restarts=self.opts.max_restarts,
            rdzv_conf=conf,
            worker_argv=("--job", str(self.spec_file(job_id)), "--phase", str(index)),
        )

    def spec_file(self, job_id: str) -> Path:
        """The spec the ranks of launch `job_id` read: a file of its own per launch (job.json is the newest's
        copy for people), so no host's cached view of a replaced file can hand it another launch's spec."""
        return self.run_dir / "jobs" / f"{job_id}.json"

    @property
    def remote_root(self) -> str:
        return self.opts.remote_root or str(PROJECT_ROOT)

    @property
    def remote_python(self) -> str:
        return f"{self.remote_root}/.venv/bin/python"

    def host_log(self, host: str) -> Path:
        """Everything one host's agent and ranks print, written on that host (launch/relay.py)."""
        return self.run_dir / "hosts" / f"{host}.log"

    def command(
        self, placement: Placement, spec: AgentSpec | None, extra_env: dict[str, str] | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """(argv to run here, environment additions) of one host's agent."""
        env = {
            **self.agent_env(),
            LOG_ENV: str(self.host_log(placement.host.name)),
            HOST_ENV: placement.host.name,
            **({live_hosts.ENV: live_hosts.key_prefix(spec.run_id)} if spec else {}),
            **(extra_env or {}),
        }
        if spec is None:  # a parked agent (driver._park): the host's environment, its command line comes later
            return [sys.executable, "-m", "elastic_trainer.launch.agent"], {**AGENT_ENV, **env}
        return host_command(
            placement,
            spec,
            env,
            python=sys.executable,
            remote_root=self.remote_root,
            remote_python=self.remote_python,
            ssh=self.opts.ssh,
        )

    # -- what the user reads first ----------------------------------------------------------------------

    def describe(self) -> list[str]:
        """Where the hosts, data, data cache, checkpoints and logs are."""
        from elastic_trainer.data.corpus import default_cache_dir, resolve_files

        files = resolve_files(self.train.data)
        data = (
            "the sotu package's State of the Union speeches"
            if self.train.data == ("sotu",)
            else ", ".join(self.train.data)
        )
        cache = self.train.data_cache or default_cache_dir()
        hosts = " ".join(f"{h.name}:{h.slots}" for h in self.hosts)
        warning = self.endpoint_warning()
        return [
            f"hosts ({self.opts.hosts}): {hosts} = {self.total_slots} slots",
            *([warning] if warning else []),
            f"model {self.model.name}, global batch {self.train.global_batch} x {self.train.seq_len} tokens, "
            f"until step {self.train.steps}",
            f"data: {data} ({len(files)} file(s), from {files[0].parent})",
            f"data cache: {cache} (prepared here once; hosts that cannot see it prepare their own copy)",
            f"checkpoints: {self.checkpoint_dir} (every host must see this folder)",
            f"job spec: {self.job_file} (what every rank reads, from a copy per launch in jobs/; hardware "
            + (f"{self.spec.hardware.name})" if self.spec.hardware else "detected on the hosts by rank 0)"),
            f"logs: {self.run_dir}/launch.log, hosts/HOST.log (each host's own, also after this launcher "
            f"is gone), metrics.jsonl, {EVENTS_FILE}; stop gracefully with `touch {self.stop_file}`",
        ]

    def starts(self, first: int = 0) -> list[int]:
        """The phases at which the job starts (or waits) from phase `first` on: one per run of `same_run` phases."""
        out, index = [], first
        while index < len(self.phases):
            out.append(index)
            index = run_end(self.phases, index) + 1
        return out

    def run_duration(self, index: int) -> float | None:
        """Seconds the start at phase `index` runs (through the phases it runs through); None: steps or none."""
        if self.phases[index].duration_s is None:
            return None
        return sum(p.duration_s for p in self.phases[index : run_end(self.phases, index) + 1])

    def phase_line(self, index: int) -> str:
        phase, last = self.phases[index], run_end(self.phases, index)
        name = f"phase {index + 1}" + (f"-{last + 1}" if last > index else "") + f"/{len(self.phases)}"
        if phase.waits:
            return (
                f"{name}: no GPUs for {phase.duration_s:g} s: the job waits"
                if phase.duration_s
                else f"{name}: no GPUs: the job stops and starts again"
            )
        what = (
            f"for {step_ends(self.phases)[last] - step_ends(self.phases)[index] + phase.steps} steps "
            f"(until step {step_ends(self.phases)[last]})"
            if phase.steps
            else f"for {self.run_duration(index):g} s"
            if phase.duration_s
            else f"until step {self.train.steps}"
        )
        where = ", ".join(f"{p.host.name}:{p.nproc}" for p in self.placements(phase))
        return f"{name}: {phase.gpus} GPUs on {where} {what}"

    def dry_run(self) -> list[str]:
        """Each phase's plan and the exact command each host would start (the rendezvous port is chosen at
        start unless --rdzv-port is given)."""
        import shlex

        port = self.opts.rdzv_port or "PORT"
        first, step = self.first_phase(), self.checkpoint_step()  # the checkpoint is checked as a run would
        self.check_inputs()
        start = "nothing to train" if first is None else f"would start at phase {first + 1}"
        lines = [f"newest checkpoint: step {step}; {start}" if step else f"no checkpoint yet; {start}"]
        for index in self.starts():
            phase = self.phases[index]
            lines.append(self.phase_line(index))
            if phase.waits:
                continue
            placements = self.placements(phase)
            spec = self.agent_spec(index, phase, placements, port)
            lines.append(f"  {self.plans[index][1]}")
            for p in placements:
                argv, env = self.command(p, spec)
                prefix = shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " if env else ""
                lines.append(f"  {p.host.name} ({'here' if p.local else 'ssh'}): {prefix}{shlex.join(argv)}")
        return lines
