"""The launcher's driver: the only code here that starts processes.

`elastic-trainer launch` (what ./run.sh calls) reads the hosts file and the schedule, checks and plans every
phase before anything starts, hosts the rendezvous store, and runs the job phase by phase: per phase one
torchrun agent per host (directly on this machine, through ssh elsewhere), their output prefixed with the
host and copied to RUN_DIR/launch.log. A phase ends when its steps are done (the ranks stop themselves at
--until-step) or its time is up (the driver writes the stop file; the ranks finish their step, save and
exit); the next phase starts with its own GPU count, and every start re-plans and reshards from the newest
checkpoint. Within a phase torchrun handles membership: a lost host makes the survivors restart their
workers in the smaller world, which re-plans and resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from dataclasses import dataclass, field

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.exit_codes import ERROR_MARK, EXIT_BAD_INPUT
from elastic_trainer.elastic.events import EVENTS_FILE, EventLog, read_jsonl
from elastic_trainer.elastic.schedule import Phase, run_end
from elastic_trainer.elastic.report import format_rows, phase_rows, plot
from elastic_trainer.launch import live_hosts
from elastic_trainer.launch.commands import AgentSpec, Placement
from elastic_trainer.launch.job_setup import JobSetup

POLL_S = 0.1
BAD_INPUT_GRACE_S = 3.0
"""After one agent exits with EXIT_BAD_INPUT, how long the others get to end by themselves: a rank that failed
before the process group formed leaves the others waiting for it."""


@dataclass
class Agent:
    host: str
    proc: subprocess.Popen
    pump: threading.Thread


@dataclass
class PhaseOutcome:
    codes: dict[str, int]
    stop_requested: bool
    interrupted: bool = False


class Output:
    """Prefixed lines from every agent to stdout and the launch log, one line at a time."""

    def __init__(self, path: Path):
        self._lock = threading.Lock()
        self._log = open(path, "a", buffering=1)
        self.errors: list[str] = []
        """The ranks' one-line errors (without the mark), each once, in order of arrival."""
        self.terminal_gone = False
        """Standard output failed (a closed terminal or a reader that went away): the log goes on alone."""

    def line(self, text: str) -> None:
        with self._lock:
            self._log.write(text + "\n")
            if self.terminal_gone:
                return
            try:
                print(text, flush=True)
            except OSError:  # EIO from a hung-up terminal, EPIPE from a dead pipe reader
                self.terminal_gone = True
                sys.stdout = open(os.devnull, "w")  # nothing left for the interpreter to flush at exit

    def log_only(self, lines: list[str]) -> None:
        """Lines already printed (before the log existed) into the log."""
        with self._lock:
            for text in lines:
                self._log.write(text + "\n")

    def pump(self, host: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode(errors="replace").rstrip()
            if ERROR_MARK in text:
                error = text.split(ERROR_MARK, 1)[1]
                with self._lock:
                    if error not in self.errors:
                        self.errors.append(error)
            self.line(f"[{host}] {text}")
        stream.close()

    def close(self) -> None:
        self._log.close()


@dataclass
class Driver:
    job: JobSetup
    out: Output = field(init=False)
    events: EventLog = field(init=False)
    job_id: str = field(default_factory=lambda: f"et-{uuid.uuid4().hex[:8]}")
    _interrupts: int = 0
    failure: str | None = None
    """A rank's bad-input error that ended the job (raised as the launcher's own one-line error)."""

    def say(self, text: str) -> None:
        self.out.line(f"[launch] {text}")

    def run(self) -> int:
        job = self.job
        first = job.first_phase()  # raises on --resume without a checkpoint, before anything is written
        job.check_inputs()
        header = [f"[launch] {line}" for line in job.describe()]
        for line in header:  # first, before the data is prepared (which may take a while, with progress)
            print(line, flush=True)
        corpus = job.prepare_data() if first is not None else None
        job.run_dir.mkdir(parents=True, exist_ok=True)
        job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        job.spec.write(job.spec_file(self.job_id))
        job.spec.write(job.job_file)
        self.out = Output(job.run_dir / "launch.log")
        self.events = EventLog(job.run_dir / EVENTS_FILE, tags={"writer": "launch"})
        stop_signals = self._stop_signals()
        previous = {s: signal.signal(s, self._on_signal) for s in stop_signals}
        self.out.log_only(header)
        try:
            for line in corpus.lines if corpus is not None else []:
                self.say(f"data: {line}")
            if signal.SIGHUP in stop_signals and sys.stdout.isatty():
                self.say("closing this terminal stops the job after a save (continue with --resume); to keep it "
                         "running, start it as `nohup ./run.sh ... > run.log 2>&1 &` or inside tmux or screen")
            if first is None:
                code = self._nothing_to_do()
            else:
                store = self._start_store()  # referenced until the phases are done: it is the rendezvous
                code = self._phases(first, store)
            self.summary()
            if self.failure:
                raise ConfigError(self.failure)
            return code
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.events.close()
            self.out.close()

    def _start_store(self):
        """The rendezvous store, hosted here for the whole job: no agent hosts it, so any host may be lost."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.job.endpoint_host() if self.job.iface else "0.0.0.0", self.job.opts.rdzv_port,
                             is_master=True, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise ConfigError(f"cannot host the rendezvous on port {self.job.opts.rdzv_port} ({e}); "
                              "choose another with --rdzv-port") from None
        self.say(f"rendezvous: {self.job.endpoint_host()}:{store.port} (c10d, hosted by this launcher)")
        return store

    def summary(self) -> None:
        """The phase table and the loss plot, from the run's metrics and events."""
        records = read_jsonl(self.job.run_dir / "metrics.jsonl")
        if not records:
            return
        rows = phase_rows(records, read_jsonl(self.job.run_dir / EVENTS_FILE))
        self.say("phases:\n" + format_rows(rows))
        try:
            path = plot(records, str(self.job.run_dir / "loss.png"), f"{self.job.model.name}: loss and ranks")
            self.say(f"loss plot: {path}")
        except ImportError:
            self.say("loss plot skipped: matplotlib is not installed")
        if self.job.train.skip_bad_records:
            from elastic_trainer.data.corpus import skipped_note

            self.say(skipped_note(self.job.train))

    @staticmethod
    def _stop_signals() -> tuple[int, ...]:
        """Signals that stop the job with a save: Ctrl-C, a scheduler's SIGTERM, and SIGHUP (the terminal or
        ssh session that started the launcher closed), unless SIGHUP is ignored (nohup): then it keeps running."""
        hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
        return (signal.SIGINT, signal.SIGTERM, *hangup)

    def _on_signal(self, signum, frame) -> None:
        # a second Ctrl-C or SIGTERM aborts the save; a hang-up (which may come with the first) never does
        self._interrupts = max(self._interrupts, 1) if signum == signal.SIGHUP else self._interrupts + 1

    def _nothing_to_do(self) -> int:
        step, steps = self.job.checkpoint_step(), self.job.train.steps
        self.say(f"nothing to train: the newest checkpoint is step {step} of {steps}"
                 + (" and the schedule ends there" if step < steps else ""))
        return 0

    def _phases(self, index: int, store) -> int:
        job = self.job
        while index is not None:
            phase = job.phases[index]
            if phase.waits:
                outcome = self.wait_phase(index, phase)
            else:
                outcome = self.run_phase(index, phase, store)
            step = job.checkpoint_step()
            failed = {h: c for h, c in outcome.codes.items() if c != 0}
            if EXIT_BAD_INPUT in failed.values():
                error = self.out.errors[0] if self.out.errors else f"a rank reported bad input ({_codes(failed)})"
                self.say(f"phase {index + 1} ended on bad input; the newest checkpoint is step {step}")
                self.failure = f"{error} [phase {index + 1}; newest checkpoint: step {step}]"
                return EXIT_BAD_INPUT
            if failed and len(failed) == len(outcome.codes) and step < job.train.steps:
                self.say(f"phase {index + 1} failed on every host ({_codes(failed)}); the newest checkpoint is "
                         f"step {step}: fix the cause above, then rerun with --resume")
                return 1
            if failed:
                self.say(f"phase {index + 1}: {_codes(failed)}; the job went on without them")
            if step >= job.train.steps:
                self.say(f"finished: step {step} of {job.train.steps}")
                return 0
            stopped_by_user = job.stop_file.exists() and not outcome.stop_requested  # not the launcher's file
            if outcome.interrupted or stopped_by_user:
                self.say(f"stopped at step {step}; continue with --resume")
                return 0
            index = run_end(job.phases, index) + 1
            index = index if index < len(job.phases) else None
        self.say(f"the schedule ended at step {step} of {job.train.steps}; "
                 "continue with --resume (and a schedule)")
        return 0

    def run_phase(self, index: int, phase: Phase, store) -> PhaseOutcome:
        job = self.job
        placements = job.placements(phase)
        job.stop_file.unlink(missing_ok=True)
        spec = job.agent_spec(index, phase, placements, store.port, self.job_id)
        self.say(job.phase_line(index))
        self.say(job.plans[index][1])
        prefix = live_hosts.key_prefix(spec.run_id)
        live_hosts.publish(store, prefix, len(placements))
        agents = [self._start(p, spec) for p in placements]
        gone: set[str] = set()
        launched = time.time()
        self.events.emit("launched", phase=index, gpus=phase.gpus, run_id=spec.run_id,
                         hosts=[[p.host.name, p.nproc] for p in placements])
        stop_requested, interrupted, bad_since = False, False, None
        duration = job.run_duration(index)
        while any(a.proc.poll() is None for a in agents):
            time.sleep(POLL_S)
            for a in agents:
                if a.host not in gone and a.proc.poll() not in (None, 0):
                    gone.add(a.host)  # the survivors' rendezvous stops waiting for it
                    left = live_hosts.lost(store, prefix)
                    self.events.emit("host_lost", phase=index, host=a.host, code=a.proc.returncode, hosts_left=left)
                    if a.proc.returncode != EXIT_BAD_INPUT and any(b.proc.poll() is None for b in agents):
                        self.say(f"{_codes({a.host: a.proc.returncode})}: the other hosts go on without it")
            if bad_since is None and any(a.proc.poll() == EXIT_BAD_INPUT for a in agents):
                bad_since = time.time()
            if bad_since is not None and time.time() - bad_since > BAD_INPUT_GRACE_S:
                self._terminate(agents)
            due = duration is not None and time.time() - launched >= duration
            if (due or self._interrupts) and not stop_requested:
                job.stop_file.touch()
                stop_requested, interrupted = True, bool(self._interrupts)
                self.events.emit("stop_requested", phase=index, reason="interrupt" if interrupted else "phase end")
                self.say("interrupted: the ranks finish their step and save (Ctrl-C again to abort)"
                         if interrupted else f"phase {index + 1} is over: asking the ranks to save and stop")
            if self._interrupts > 1:
                self._terminate(agents)
        for a in agents:
            a.pump.join()
        codes = {a.host: a.proc.returncode for a in agents}
        self.events.emit("exited", phase=index, codes=codes)
        return PhaseOutcome(codes, stop_requested, interrupted)

    def wait_phase(self, index: int, phase: Phase) -> PhaseOutcome:
        """A phase without GPUs: nothing runs until its time is up (or the user stops the job)."""
        self.job.stop_file.unlink(missing_ok=True)
        self.say(self.job.phase_line(index))
        self.events.emit("waiting", phase=index, duration_s=phase.duration_s)
        end = time.time() + (phase.duration_s or 0.0)  # a steps schedule's 0-GPU phase: stop, then start again
        while time.time() < end and not self._interrupts and not self.job.stop_file.exists():
            time.sleep(POLL_S)
        return PhaseOutcome({}, stop_requested=False, interrupted=bool(self._interrupts))

    def _start(self, placement: Placement, spec: AgentSpec) -> Agent:
        argv, env = self.job.command(placement, spec)
        # stdin stays an open pipe: a remote host's bootstrap stops its agent when the pipe closes
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        pump = threading.Thread(target=self.out.pump, args=(placement.host.name, proc.stdout), daemon=True)
        pump.start()
        return Agent(placement.host.name, proc, pump)

    def _terminate(self, agents: list[Agent]) -> None:
        for a in agents:
            if a.proc.poll() is None:
                a.proc.terminate()  # the local agent stops its workers; ssh closes, remote.sh stops the agent
                a.proc.stdin.close()


def _codes(codes: dict[str, int]) -> str:
    def describe(code: int) -> str:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    return ", ".join(f"agent on {host}: {describe(code)}" for host, code in codes.items())


def launch(job: JobSetup, dry_run: bool = False) -> int:
    """Run the job (or print what would run); the exit code of `elastic-trainer launch`."""
    if dry_run:
        for line in [*job.describe(), *job.dry_run()]:
            print(f"[launch] {line}")
        return 0
    return Driver(job).run()
