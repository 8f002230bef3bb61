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

import dataclasses
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.events import EVENTS_FILE, EventLog
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT
from elastic_trainer.elastic.handover import HOSTS_CHANGE, PHASE_END, WARM_ENV, Control
from elastic_trainer.elastic.report import summary_lines
from elastic_trainer.elastic.schedule import Phase, run_end
from elastic_trainer.launch import heartbeat, live_hosts
from elastic_trainer.launch.hosts import default_slots
from elastic_trainer.launch.job_setup import JobSetup
from elastic_trainer.launch.notices import NOTICE_GRACE_ENV, Notices
from elastic_trainer.launch.output import Output
from elastic_trainer.launch.warm import READY_WAIT_S, WARM_LEAD_S, builds_early, warm_refusal
from elastic_trainer.launch.worlds import PhaseOutcome, Processes, World
from elastic_trainer.launch.worlds import codes_line as _codes

POLL_S = 0.1
BAD_INPUT_GRACE_S = 3.0
"""After one agent exits with EXIT_BAD_INPUT, how long the others get to end by themselves: a rank that failed
before the process group formed leaves the others waiting for it."""


@dataclass
class Driver:
    job: JobSetup
    out: Output = field(init=False)
    events: EventLog = field(init=False)
    job_id: str = field(default_factory=lambda: f"et-{uuid.uuid4().hex[:8]}")
    _interrupts: int = 0
    _refusals: dict = field(default_factory=dict)
    """{phase: the line refusing its warm start, or ""}."""
    _launches: dict = field(default_factory=dict)
    """{phase: how many times its agents were started}."""
    _draining: list = field(default_factory=list)
    """Worlds that handed their state over and are still finishing."""
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
        self.processes = Processes(job, self.out)
        self.events = EventLog(job.run_dir / EVENTS_FILE, tags={"writer": "launch"})
        stop_signals = self._stop_signals()
        previous = {s: signal.signal(s, self._on_signal) for s in stop_signals}
        self.out.log_only(header)
        try:
            for line in corpus.lines if corpus is not None else []:
                self.say(f"data: {line}")
            if signal.SIGHUP in stop_signals and sys.stdout.isatty():
                self.say(
                    "closing this terminal stops the job after a save (continue with --resume); to keep it "
                    "running, start it as `nohup ./run.sh ... > run.log 2>&1 &` or inside tmux or screen"
                )
            if first is None:
                code = self._nothing_to_do()
            else:
                store = live_hosts.host_store(self.job, self.say)  # referenced until the phases are done
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

    def summary(self) -> None:
        """The phase table and the loss plot, from the run's metrics and events."""
        for line in summary_lines(self.job.run_dir, f"{self.job.model.name}: loss and ranks"):
            self.say(line)
        if self.job.train.skip_bad_records and (self.job.run_dir / "metrics.jsonl").exists():
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
        self.say(
            f"nothing to train: the newest checkpoint is step {step} of {steps}"
            + (" and the schedule ends there" if step < steps else "")
        )
        return 0

    def _phases(self, index: int, store) -> int:
        job = self.job
        self.control = Control(store, self.job_id)
        self.notices = Notices(job.opts.hosts, job.opts.gpus_per_host or default_slots(), list(job.hosts))
        successor: World | None = None
        clock = 0.0
        try:
            while index is not None:
                phase = job.phases[index]
                if phase.waits:
                    outcome = self.wait_phase(index, phase)
                else:
                    world = successor or self._launch(index, store)
                    world.began = world.began or clock or time.time()
                    outcome, successor = self._run(world, store)
                    clock = 0.0
                    if self._reformed(world, outcome, successor):
                        clock = world.began  # its hosts changed: the phase goes on (in `successor`, or again)
                        continue
                code = None if outcome.handed_over else self._after(index, outcome)
                if code is not None:
                    return code
                index = run_end(job.phases, index) + 1
                index = index if index < len(job.phases) else None
        finally:
            if successor is not None and (index is None or successor.index != index or self.failure):
                successor = self._settle(successor, "the job ended before its turn", terminate=True)
            self._drain(wait=True)
            self.processes.close()
        self.say(
            f"the schedule ended at step {job.checkpoint_step()} of {job.train.steps}; "
            "continue with --resume (and a schedule)"
        )
        return 0

    def _reformed(self, world: World, outcome: PhaseOutcome, successor: World | None) -> bool:
        """Whether `world` stopped for a change of its hosts with its phase not over: the phase goes on, in
        `successor` (which took the state) or started again on the new hosts (the state through the folder)."""
        if world.reform_by is None or outcome.interrupted:
            return False
        if outcome.handed_over:
            return successor.index == world.index
        until = self.job.spec.phases[world.index].until_step
        return self.job.checkpoint_step() < (until or self.job.train.steps) and bool(
            self.job.placements(self.job.phases[world.index])
        )

    def _after(self, index: int, outcome: PhaseOutcome) -> int | None:
        """The job's exit code when this phase's outcome ends it, else None (the next phase runs)."""
        job = self.job
        step = job.checkpoint_step()
        failed = {h: c for h, c in outcome.codes.items() if c != 0}
        if EXIT_BAD_INPUT in failed.values():
            error = self.out.errors[0] if self.out.errors else f"a rank reported bad input ({_codes(failed)})"
            self.say(f"phase {index + 1} ended on bad input; the newest checkpoint is step {step}")
            self.failure = f"{error} [phase {index + 1}; newest checkpoint: step {step}]"
            return EXIT_BAD_INPUT
        if failed and len(failed) == len(outcome.codes) and step < job.train.steps:
            self.say(
                f"phase {index + 1} failed on every host ({_codes(failed)}); the newest checkpoint is "
                f"step {step}: fix the cause above, then rerun with --resume"
            )
            return 1
        if failed:
            self.say(f"phase {index + 1}: {_codes(failed)}; the job went on without them")
        if step >= job.train.steps:
            self.say(f"finished: step {step} of {job.train.steps}")
            return 0
        if outcome.interrupted or job.stop_file.exists():  # interrupted here, or the user wrote the stop file
            self.say(f"stopped at step {step}; continue with --resume")
            return 0
        return None

    def _launch(self, index: int, store, warm: bool = False, early: bool = True, reform: str = "") -> World:
        """Start the agents of phase `index` on the job's hosts; `warm`: beside the running world, whose state
        it will take (and `early`: builds its model before it has the state; else after, where the two would not
        fit); `reform`: why the phase is re-formed on other hosts (rank 0 plans for the ones it gets)."""
        job = self.job
        phase = job.phases[index]
        placements = job.placements(phase)
        if not warm:
            job.stop_file.unlink(missing_ok=True)
        spec = job.agent_spec(index, phase, placements, store.port, self.job_id)
        self._launches[index] = self._launches.get(index, 0) + 1
        if self._launches[index] > 1:  # a rendezvous id is used once (a failed early start closed its round)
            spec = dataclasses.replace(spec, run_id=f"{spec.run_id}-{self._launches[index]}")
        where = ", ".join(f"{p.host.name}:{p.nproc}" for p in placements)
        self.say(
            (f"phase {index + 1} re-formed on {where}" if reform else job.phase_line(index))
            + (" (started beside the current world, to take its state in memory)" if warm else "")
        )
        self.say("[plan] made by rank 0 for the hosts it gets" if job.hosts_changed else job.plans[index][1])
        prefix = live_hosts.key_prefix(spec.run_id)
        live_hosts.publish(store, prefix, len(placements))
        env = {
            **Control.environment(f"{job.endpoint_host()}:{store.port}", self.job_id),
            NOTICE_GRACE_ENV: f"{job.opts.notice_grace_s:g}",
            heartbeat.ENV: f"{job.opts.hang_timeout_s:g}",
            **({WARM_ENV: "early" if early else "late"} if warm else {}),
        }
        agents = [self.processes.start(p, spec, env) for p in placements]
        self.processes.park(run_end(job.phases, index) + 1)
        self.events.emit(
            "launched",
            phase=index,
            gpus=sum(p.nproc for p in placements),
            run_id=spec.run_id,
            warm=warm,
            hosts=[[p.host.name, p.nproc] for p in placements],
            **({"reform": reform} if reform else {}),
        )
        world = World(
            index, spec.run_id, prefix, agents, [(p.host.name, p.nproc) for p in placements], time.time(), warm
        )
        world.watch = heartbeat.Watch(store, prefix, [a.host for a in agents], job.opts.hang_timeout_s)
        return world

    def _watch(self, world: World, store) -> None:
        """One look at a world's agents: a lost host, a bad-input exit (the others get a grace period)."""
        for a in world.agents:
            if a.host not in world.gone and a.proc.poll() not in (None, 0):
                world.gone.add(a.host)  # the survivors' rendezvous stops waiting for it
                left = live_hosts.lost(store, world.prefix)
                self.events.emit("host_lost", phase=world.index, host=a.host, code=a.proc.returncode, hosts_left=left)
                if a.proc.returncode != EXIT_BAD_INPUT and world.alive():
                    self.say(f"{_codes({a.host: a.proc.returncode})}: the other hosts go on without it")
        exited = {a.host for a in world.agents if a.proc.poll() is not None}  # done, or seen lost above
        for host, silent_s in world.watch.silent(exclude=world.gone | exited).items() if world.watch else ():
            world.gone.add(host)  # before the cut: the survivors' next round must not wait for it
            left = live_hosts.lost(store, world.prefix)
            world.watch.cut(host)
            self.processes.kill([a for a in world.agents if a.host == host])
            self.events.emit(
                "host_lost", phase=world.index, host=host, reason="frozen", silent_s=round(silent_s, 1), hosts_left=left
            )
            if world.alive():
                self.say(
                    f"agent on {host}: no heartbeat for {silent_s:.1f} s: cut off, the other hosts go on without it"
                )
        if world.bad_since is None and any(a.proc.poll() == EXIT_BAD_INPUT for a in world.agents):
            world.bad_since = time.time()
        if world.bad_since is not None and time.time() - world.bad_since > BAD_INPUT_GRACE_S:
            self._terminate(world)

    def _run(self, world: World, store) -> tuple[PhaseOutcome, World | None]:
        """Run `world` until its agents are gone, or until the world started beside it (for the next phase, or
        for this one on changed hosts) has taken its state (returned): `world` then writes its durable
        checkpoint and exits meanwhile (`_drain`)."""
        job, control = self.job, self.control
        duration = job.run_duration(world.index)
        following = run_end(job.phases, world.index) + 1
        successor, stop_requested, interrupted = None, False, False
        while world.alive():
            time.sleep(POLL_S)
            self._drain()
            self._watch(world, store)
            if successor is not None and "step" in (control.get(successor.key, "loaded") or {}):
                self._draining.append(world)
                return PhaseOutcome({}, stop_requested, interrupted, handed_over=True), successor
            if not stop_requested:
                successor = self._listen(world, successor, store)
            left = None if duration is None else duration - (time.time() - world.began)
            if (
                successor is None
                and world.reform_by is None
                and not stop_requested
                and self._may_warm(world, following, left)
            ):
                successor = self._launch(following, store, warm=True, early=builds_early(job, world.index, following))
                control.set(world.key, "next", successor.key)
            if successor is not None and not successor.alive():
                reformed = successor.index == world.index
                self.say(
                    f"phase {successor.index + 1}'s "
                    + ("world on the new hosts" if reformed else "early start")
                    + " failed; it starts again after this world has stopped"
                )
                if not reformed:
                    self._refusals[following] = "its early start failed"
                control.unset(world.key, "next")
                successor = self._settle(successor, "it failed")
            ready = successor is not None and control.get(successor.key, "ready") is not None
            due = left is not None and left <= 0 and (successor is None or ready or -left > READY_WAIT_S)
            reform = world.reform_by is not None and (successor is None or ready or time.time() > world.reform_by)
            if (due or reform or self._interrupts) and not stop_requested:
                stop_requested, interrupted = True, bool(self._interrupts)
                if interrupted and successor is not None:
                    control.unset(world.key, "next")
                    successor = self._settle(successor, "the job was interrupted", terminate=True)
                if interrupted:  # the user's stop: the stop file, which also holds a resumed job back
                    job.stop_file.touch()
                else:
                    control.set(
                        world.key,
                        "stop",
                        {"why": HOSTS_CHANGE, "leaving": world.leaving} if reform else {"why": PHASE_END},
                    )
                reason = "interrupt" if interrupted else "hosts changed" if reform else "phase end"
                self.events.emit("stop_requested", phase=world.index, reason=reason)
                self.say(
                    {
                        "interrupt": "interrupted: the ranks finish their step and save (Ctrl-C again to abort)",
                        "hosts changed": f"phase {world.index + 1}'s hosts changed: asking the ranks to stop",
                        "phase end": f"phase {world.index + 1} is over: asking the ranks to stop",
                    }[reason]
                )
            if self._interrupts > 1:
                self._terminate(world)
        codes = self._exited(world)
        if successor is not None and control.get(successor.key, "state") is None:
            control.set(successor.key, "state", {"none": "the stopping world exited without handing its state over"})
        return PhaseOutcome(codes, stop_requested, interrupted), successor

    def _listen(self, world: World, successor: World | None, store) -> World | None:
        """A change of the job's hosts (launch/notices.py): later phases are placed on the new hosts; when the
        current world's own hosts change, its phase is re-formed on them in a world started beside it (`world`
        stops once that one is ready; at once without warm starts). Returns the successor, as it now is."""
        change = self.notices.poll(self.control, self.say)
        if change is None:
            return successor
        job = self.job
        job.use_hosts(change.hosts)
        placements = job.placements(job.phases[world.index])
        self.say(f"hosts changed: {change.why}")
        self.events.emit(
            "hosts_changed", phase=world.index, why=change.why, hosts=[[h.name, h.slots] for h in change.hosts]
        )
        if successor is not None:  # started on the old hosts
            self.control.unset(world.key, "next")
            successor = self._settle(successor, "the job's hosts changed", terminate=True)
        if [(p.host.name, p.nproc) for p in placements] == world.placed:  # (back to) the hosts it has
            world.reform_by, world.leaving = None, []
            return None
        if not placements:
            self.say("no host is left: the ranks save and stop; continue with --resume once hosts are back")
            self._interrupts = max(self._interrupts, 1)
            return None
        by = change.deadline or time.time() + READY_WAIT_S  # an earlier notice's deadline still holds
        world.reform_by = by if world.reform_by is None else min(world.reform_by, by)
        world.leaving = sorted({h for h, _ in world.placed} - {p.host.name for p in placements})
        refusal = warm_refusal(job, world.index, world.index) if job.opts.warm_start else "no warm start"
        if refusal:
            self.say(f"{refusal}: the phase starts again on the new hosts after the ranks saved")
            return None
        successor = self._launch(
            world.index, store, warm=True, early=builds_early(job, world.index, world.index), reform=change.why
        )
        self.control.set(world.key, "next", successor.key)
        return successor

    def _drain(self, wait: bool = False) -> None:
        """The worlds that handed their state over and are finishing (durable checkpoint, exit): each one's
        exit recorded once it is gone (`wait`: wait for all of them)."""
        for world in list(self._draining):
            if wait:
                for a in world.agents:
                    a.proc.wait()
            if world.alive():
                continue
            self._draining.remove(world)
            failed = {h: c for h, c in self._exited(world).items() if c != 0}
            if failed:
                self.say(
                    f"phase {world.index + 1}, after handing its state over: {_codes(failed)} (its durable "
                    "checkpoint may be missing; the next periodic save covers it)"
                )

    def _may_warm(self, world: World, following: int, left: float | None) -> bool:
        """Whether to start the next phase's world now, beside `world` (a refusal is said once)."""
        job = self.job
        if following >= len(job.phases) or job.phases[following].waits or self._interrupts or not job.opts.warm_start:
            return False
        if left is not None and left > WARM_LEAD_S:
            return False
        if world.warm and self.control.get(world.key, "first_step") is None:
            return False  # a world that took a hand-over: its first step (the event's) is not to be slowed
        if following not in self._refusals:
            self._refusals[following] = warm_refusal(job, world.index, following)
            if self._refusals[following]:
                self.say(self._refusals[following])
        return not self._refusals[following]

    def _settle(self, world: World, why: str, terminate: bool = False) -> None:
        """A next world that will not take over: stop it (or see it gone) and release whoever waits on it."""
        if terminate:
            self._terminate(world)
        for a in world.agents:
            a.proc.wait()
        self.control.set(world.key, "loaded", {"gone": why})
        self._exited(world, warm=True)
        return None

    def _exited(self, world: World, **tags) -> dict[str, int]:
        """A world whose agents are gone: their output read to the end, the `exited` event; the exit codes."""
        for a in world.agents:
            a.pump.join()
        codes = {a.host: a.proc.returncode for a in world.agents}
        self.events.emit("exited", phase=world.index, codes=codes, **tags)
        return codes

    def wait_phase(self, index: int, phase: Phase) -> PhaseOutcome:
        """A phase without GPUs: nothing runs until its time is up (or the user stops the job)."""
        self.job.stop_file.unlink(missing_ok=True)
        self.say(self.job.phase_line(index))
        self.events.emit("waiting", phase=index, duration_s=phase.duration_s)
        end = time.time() + (phase.duration_s or 0.0)  # a steps schedule's 0-GPU phase: stop, then start again
        while time.time() < end and not self._interrupts and not self.job.stop_file.exists():
            time.sleep(POLL_S)
        return PhaseOutcome({}, stop_requested=False, interrupted=bool(self._interrupts))

    def _terminate(self, world: World) -> None:
        self.processes.terminate(world.agents)


def launch(job: JobSetup, dry_run: bool = False) -> int:
    """Run the job (or print what would run); the exit code of `elastic-trainer launch`."""
    if dry_run:
        for line in [*job.describe(), *job.dry_run()]:
            print(f"[launch] {line}")
        return 0
    return Driver(job).run()
