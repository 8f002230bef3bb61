"""One training job on an initialized process group: build -> load -> fit -> close.

The CLI (one process, or each torchrun rank the elastic launcher starts) and the tests train through `Job`
(or `run_job`, the whole sequence in one call), so there is one sequence to get right (the step, planner and
reshard benchmarks time single pieces: a step, a save, a cold load):

1. build the mesh, the checkpointer and the trainer; when a checkpoint will be loaded the weights are only
   allocated, not initialized (a rescale pays for the load, not for an initialization it throws away);
2. load the newest good checkpoint, resharded into this layout (or initialize from the seed if none loads);
3. fit: steps until `until` (default: the run's last step), with periodic saves and stop requests agreed by
   all ranks after every step; a stop or the end of `until` saves before returning; a non-finite loss or
   gradient norm raises `Diverged` on every rank without saving; with validation data, the validation loss
   after every `eval_every`-th step and the last one goes into that step's record (`evaluation_due`);
4. close: join an asynchronous save and release the checkpoint process group.

Rank 0 writes each stage as an event (`elastic.events`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic_trainer.checkpoint import Checkpointer, CheckpointError, LoadStats, SaveStats, storage
from elastic_trainer.config import CheckpointConfig, ModelConfig, TrainConfig
from elastic_trainer.elastic.events import EventLog
from elastic_trainer.elastic.exit_codes import PEER_REASON
from elastic_trainer.elastic.handover import HOSTS_CHANGE, PHASE_END, Handover
from elastic_trainer.elastic.stop import StopRequest
from elastic_trainer.parallel.compile import report as compile_report
from elastic_trainer.parallel.compile import report_line
from elastic_trainer.parallel.mesh import build_mesh
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import heap
from elastic_trainer.train.loop import Diverged, Trainer
from elastic_trainer.train.metrics import MetricsLog
from elastic_trainer.train.profile import StepProfiler


@dataclass
class JobResult:
    status: str
    """finished (the run's last step is done) or stopped (a stop request, or `until` before the end)."""
    step: int
    layout: Layout
    records: list[dict] = field(default_factory=list)
    """Step records of this job's fit."""
    load: LoadStats | None = None
    saves: list[SaveStats] = field(default_factory=list)
    reason: str | None = None
    """Why it stopped (None when it finished): the local request, "until step N", or elastic.PEER_REASON."""


RELEASE_WAIT_S = 120.0
"""How long a world that handed its state over keeps its copy in memory (and its server) for the next world
to load; without word from it by then, the copy stays for a restart to find and the world exits."""


def _step_of(folder) -> int:
    return int(storage.STEP_DIR.match(folder.name).group(1))


def _quiet(*args, **kwargs) -> None:
    pass


class Job:
    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        layout: Layout,
        device: torch.device,
        *,
        ckpt: CheckpointConfig | None = None,
        tokens: np.ndarray | None = None,
        val_tokens=None,
        log: MetricsLog | None = None,
        events: EventLog | None = None,
        handover: Handover | None = None,
        stop: StopRequest | None = None,
        on_stop=None,
    ):
        """`val_tokens`: the validation token stream (as `tokens`), or None for no validation loss. `handover`:
        the launcher's channel for a planned reconfiguration (a warm world waits on it for its state after it is
        built, before it loads; `stop` ends that wait). `on_stop(records)`: called with this start's step
        records when it stops training, before its save or hand-over."""
        self.log = log or MetricsLog(None, enabled=False)
        self.events = events or EventLog(None, enabled=False)
        self.handover, self.layout, self.on_stop = handover, layout, on_stop
        self.stop_reason: str | None = None
        """Why the last fit stopped (None: it finished, or has not run)."""
        self.records: list[dict] = []
        self.loaded, self.checkpointer, self.trainer = None, None, None
        self.cancelled = False
        """A warm world asked to stop before it got a state, or a restart after the hand-over: it trains nothing."""
        self.log.info(
            f"[train] {model_cfg.name} ({model_cfg.num_params() / 1e6:.1f} M parameters) on "
            f"{layout.world_size} rank(s), {device.type}: {layout.describe()}; global batch "
            f"{train_cfg.global_batch} x {train_cfg.seq_len} tokens, until step {train_cfg.steps}"
        )
        if self._handed_over(handover):
            return
        mesh = build_mesh(layout, device.type)
        self.profiler = StepProfiler(
            train_cfg.profile_steps,
            train_cfg.metrics_file,
            dist.get_rank() if dist.is_initialized() else 0,
            device.type,
        )
        self.checkpointer = Checkpointer(ckpt, log=print if self.log.enabled else _quiet) if ckpt else None
        resume = ckpt.resume if ckpt else "never"
        build = functools.partial(
            Trainer, model_cfg, train_cfg, layout, mesh, device, tokens=tokens, val_tokens=val_tokens
        )
        live = None
        if handover is not None and handover.warm:
            if not handover.late:
                self.trainer = build(initialize=True)
            live = self._wait_for_state(stop)
            if self.cancelled:
                return
        found = self.checkpointer.candidates(resume) if self.checkpointer and resume != "never" else []
        in_memory = self.checkpointer.in_memory(live) if self.checkpointer and resume == "auto" else []
        rebuilt = self.trainer is not None and not (found or in_memory)  # a warmed-up trainer trained a step
        if self.trainer is None or rebuilt:
            self.trainer = None
            heap.release()  # the dropped trainer's objects (a warm world settled them) can be freed
            self.trainer = build(initialize=not (found or in_memory))
        if in_memory and (not found or in_memory[0].step >= _step_of(found[0])):
            self.loaded = self._load_memory(in_memory[0])
        # one of `found` or an error: never the seed's weights, which would bury damaged checkpoints under new ones
        if self.loaded is None and found:
            self.loaded = self.checkpointer.load_first(self.trainer, found, strict=resume != "auto")
        if self.loaded is None and in_memory:  # never train on weights that were only allocated
            raise RuntimeError(
                f"the in-memory state {in_memory[0].name} could not be read and there is no "
                "durable checkpoint; a restart will find the one its writer is saving"
            )
        if self.checkpointer is not None:
            self.checkpointer.prepare_fresh_run(resume if self.trainer.step == 0 else "auto")
        self._settle(rebuilt, bool(in_memory))
        load = dataclasses.asdict(self.loaded) if self.loaded else None
        if load:
            load.pop("meta")
        self.events.emit("state_loaded", step=self.trainer.step, layout=layout.to_dict(), load=load)
        if live is not None and dist.get_rank() == 0:
            handover.loaded(self.trainer.step)  # the stopping world may release its copy

    def _handed_over(self, handover: Handover | None) -> bool:
        """Whether this world has already handed over to the next one: its workers failed afterwards and their
        agent restarted them. They train nothing (the next world trains on; a second trainer beside it would
        write the same steps again) and exit as stopped."""
        if handover is None or handover.warm:
            return False
        given, step = handover.handed_over() if dist.get_rank() == 0 else (False, None)
        agreed = torch.tensor([float(given), -1.0 if step is None else float(step)])
        dist.broadcast(agreed, src=0)  # a CPU tensor: gloo, also beside NCCL
        if not agreed[0]:
            return False
        step = int(agreed[1]) if agreed[1] >= 0 else None
        self.cancelled = True
        self.stop_reason = (
            f"the next world took this world's state of step {step}"
            if step is not None
            else "the next world loads the newest checkpoint"
        )
        self.events.emit("already_handed_over", step=step)
        self.log.info(f"[train] nothing to do after this restart: {self.stop_reason}")
        return True

    def _settle(self, rebuilt: bool, tried_memory: bool) -> None:
        """The world's objects out of the garbage collector's walks (train/heap.py), after a full collection only
        where big garbage may be left in reference cycles: a dropped trainer, a failed read from memory (its
        traceback). A full collection costs a rank 0.1-0.25 s on the 2-core machine, on the way to its first step."""
        from_memory = self.loaded is not None and str(self.loaded.path).startswith("memory:")
        heap.settle(collect=rebuilt or (tried_memory and not from_memory))

    def _wait_for_state(self, stop: StopRequest | None) -> dict | None:
        """A warm world, built (unless it builds late): warm up, say it is ready, plan its own hand-over's write
        (while the old world ends its step and writes its state: saying so first keeps that off a phase that
        ends at a step), wait for the stopping world's state (its record when it is in memory, else None).
        Asked to stop meanwhile, the job is cancelled."""
        t0 = time.time()
        if self.trainer is not None:
            self.trainer.warm_up()
        dist.barrier()
        self.events.emit("next_world_ready", warm_up_s=time.time() - t0, built=self.trainer is not None)
        if dist.get_rank() == 0:
            self.handover.ready()
        if self.trainer is not None and self.checkpointer is not None:
            self.checkpointer.prepare_memory(self.trainer)  # this world's own hand-over (checkpoint/planned.py)
        heap.settle()  # no collection: little is left in reference cycles, and the old world needs the cores
        state = self.handover.wait_state(lambda: stop is not None and stop.local())
        if state is None:
            self.cancelled, self.stop_reason = True, (stop.reason if stop else None) or "cancelled"
            return None
        return state.get("record")

    def _load_memory(self, found) -> LoadStats | None:
        """Load an in-memory state; when that fails, the newest durable checkpoint is used (None)."""
        try:
            loaded, stats = self.checkpointer.load_memory(self.trainer, found)
        except CheckpointError as e:
            self.log.info(
                f"[checkpoint] the in-memory state {found.name} could not be read ({e}); loading the "
                "newest durable checkpoint instead"
            )
            return None
        self.events.emit(
            "handover_done", step=found.step, handover=dataclasses.asdict(stats), fetch_gbs=stats.fetch_gbs
        )
        return loaded

    def fit(self, stop: StopRequest | None = None, until: int | None = None) -> str:
        """Train until global step `until` (default and at most the run's last step), saving as the
        checkpoint config says. Returns "finished" or "stopped" (after saving)."""
        if self.cancelled:
            return "stopped"
        trainer, checkpointer = self.trainer, self.checkpointer
        last = trainer.cfg.steps if until is None else min(until, trainer.cfg.steps)
        reason, asked, allocating = None, None, False
        while trainer.step < last and reason is None:
            self.profiler.before(trainer.step + 1)
            try:
                record = trainer.train_step()
            except Diverged as e:
                raise self._diverged(e) from None
            self.profiler.after(trainer.step)
            if evaluation_due(trainer.step, trainer.cfg, trainer.val_batches):
                record.update(self._evaluate())
            self.log.write(record)
            self.records.append(record)
            if len(self.records) == 1:
                compiled = compile_report() if trainer.cfg.compile else {}
                self.events.emit(
                    "first_step_done",
                    step=trainer.step,
                    step_time_s=record["step_time_s"],
                    layout=trainer.layout.to_dict(),
                    **({"compile": compiled} if compiled else {}),
                )
                if compiled and dist.get_rank() == 0:
                    print(report_line(compiled, len(trainer.engine.model.layers)), flush=True)
                if self.handover is not None and dist.get_rank() == 0:
                    self.handover.first_step_done()
            asked, coming = self._asked(allocating)
            stop_now, save_due, coming = _agree(stop, checkpointer, trainer.step, asked is not None, coming)
            if coming and not allocating:  # the next world is on its way: its hand-over's memory, meanwhile
                allocating = checkpointer.allocate_memory() or True
            if stop_now:
                reason = (stop.reason if stop is not None else None) or (asked or {}).get("why") or PEER_REASON
            elif save_due:
                checkpointer.save(trainer)
            if (
                not stop_now
                and trainer.step < last
                and checkpointer is not None
                and checkpointer.snapshot_due(trainer.step)
            ):
                checkpointer.snapshots.take(trainer)  # the copy here, the write in the background
        self.profiler.close()  # a run that stops inside the window: the steps it traced
        if not self.records and self.handover is not None and dist.get_rank() == 0:
            self.handover.first_step_done()  # nothing to train: whoever waits for a first step waits no more
        if reason is None and trainer.step < trainer.cfg.steps:
            reason = f"until step {last}"
        if self.on_stop is not None:
            self.on_stop(self.records)
        if reason is not None:
            self.events.emit(
                "stopping",
                step=trainer.step,
                reason=reason,
                last_step_end=self._last_step_end(),
                layout=trainer.layout.to_dict(),
            )
            self.log.info(f"[train] stopped after step {trainer.step} ({reason})")
        if checkpointer is not None:
            successor, leaving = self._successor(reason, asked)
            if successor is not None:
                self._hand_over(successor, leaving)
            elif checkpointer.last_saved_step != trainer.step:
                checkpointer.save(trainer, blocking=True)
            checkpointer.wait()
            saved = checkpointer.history[-1] if checkpointer.history else None
            if saved is not None and saved.step == trainer.step and successor is None:
                self.events.emit("saved", step=trainer.step, save=dataclasses.asdict(saved))
        if reason is None:
            self.events.emit("finished", step=trainer.step)
        self.stop_reason = reason
        return "finished" if reason is None else "stopped"

    def _asked(self, allocating: bool) -> tuple[dict | None, bool]:
        """Rank 0: (the launcher's stop request, whether a next world has been started since `allocating`
        was last false); (None, False) elsewhere."""
        if self.handover is None or dist.get_rank() != 0:
            return None, False
        coming = not allocating and self.checkpointer is not None and self.handover.successor() is not None
        return self.handover.stop_request(), coming

    def _successor(self, reason: str | None, asked: dict | None) -> tuple[str | None, bool]:
        """(the warm world waiting for this state, whether a host of this world leaves the job: `asked`, the
        launcher's stop request rank 0 read), when this stop is a planned phase end (rank 0 asks the launcher;
        every rank gets its answer). A user's stop or a signal saves to disk as always."""
        if self.handover is None or reason is None:
            return None, False
        planned = reason in (PHASE_END, HOSTS_CHANGE) or reason.startswith("until step")
        ask = dist.get_rank() == 0 and planned
        answer = [(self.handover.successor(), bool(asked and asked["leaving"])) if ask else (None, False)]
        dist.broadcast_object_list(answer, src=0, group=self.checkpointer.pg)
        return answer[0]

    def _hand_over(self, successor: str, leaving: bool) -> None:
        """Write the state into memory and tell the waiting world; once it has loaded and taken its first step
        (so that nothing here slows that step), write the durable checkpoint from the copy in memory and release
        the copy. Without word from the next world by RELEASE_WAIT_S, the copy stays for a restart to find.
        `leaving`: a host of this world goes away (a scheduler's notice): the durable checkpoint comes first,
        so that nothing depends on that host living until the next world has loaded."""
        trainer, checkpointer, rank0 = self.trainer, self.checkpointer, dist.get_rank() == 0
        self.events.emit("handover_started", step=trainer.step, successor=successor, hosts_leave=leaving)
        try:
            written = checkpointer.write_memory(trainer)
        except (CheckpointError, CheckpointException) as e:  # on every rank alike (DCP gathers the failures)
            self.log.info(
                f"[checkpoint] the state could not be written to memory ({str(e).splitlines()[0]}); "
                "saving it to the checkpoint folder instead"
            )
            checkpointer.save(trainer, blocking=True)
            if rank0:
                self.handover.hand_over(successor, None, "writing it to memory failed")
            return
        self.events.emit(
            "saved",
            step=trainer.step,
            save={
                "step": trainer.step,
                "where": "memory",
                "bytes": written.bytes,
                "stall_s": written.seconds,
                "total_s": written.seconds,
                "path": str(written.folder),
                "planned": written.planned,
                "allocated_ahead": written.ahead or None,
            },
        )
        if rank0:
            self.handover.hand_over(successor, written.record)
        durable = checkpointer.persist(written) if leaving else None
        if durable is not None:
            self.events.emit("durable_saved", step=trainer.step, save=dataclasses.asdict(durable))
        deadline = time.monotonic() + RELEASE_WAIT_S
        loaded = self.handover.wait_loaded(successor, lambda: time.monotonic() > deadline)
        took = loaded is not None and "step" in loaded
        if took and not leaving:
            self.handover.wait_first_step(successor, lambda: time.monotonic() > deadline)
        if written.server is not None:
            written.server.stop()
        if durable is None:
            durable = checkpointer.persist(written, release=took)
            self.events.emit("durable_saved", step=trainer.step, save=dataclasses.asdict(durable))
        elif took:
            checkpointer.release(written)

    def _diverged(self, error: Diverged) -> Diverged:
        """Nothing is saved: the last checkpoint stays the newest (an asynchronous save of an earlier, good
        step is finished). The error to raise, naming that checkpoint."""
        newest = None
        if self.checkpointer is not None:
            self.checkpointer.wait()
            saved = next((s for s in reversed(self.checkpointer.history) if s.path), None)
            if saved is not None:
                newest = f"step {saved.step} ({saved.path})"
            elif self.checkpointer.last_saved_step is not None:  # the one this run resumed from
                newest = f"step {self.checkpointer.last_saved_step} (resumed from)"
        self.events.emit(
            "diverged",
            step=error.step,
            loss=str(error.loss),
            grad_norm=str(error.grad_norm),
            last_saved_step=self.checkpointer.last_saved_step if self.checkpointer else None,
        )
        return Diverged(error.step, error.loss, error.grad_norm, newest)

    def _evaluate(self) -> dict:
        """The validation loss of the weights after this step, for its record. The record's time moves to the
        end of the evaluation: it is the job's time, not downtime before a reconfiguration that follows
        (elastic/report.py counts a segment from its first record's time less its step and eval times)."""
        t0 = time.perf_counter()
        val_loss = self.trainer.evaluate()
        return {
            "val_loss": val_loss,
            "val_samples": self.trainer.val_samples,
            "eval_time_s": time.perf_counter() - t0,
            "time": time.time(),
        }

    def _last_step_end(self) -> float | None:
        return self.records[-1]["time"] if self.records else None

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        heap.release()  # a process that runs another job after this one frees this one's objects

    def result(self, status: str) -> JobResult:
        saves = self.checkpointer.history if self.checkpointer else []
        step = self.trainer.step if self.trainer is not None else 0  # a cancelled warm world that builds late
        return JobResult(status, step, self.layout, self.records, self.loaded, saves, self.stop_reason)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_job(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    layout: Layout,
    device: torch.device,
    *,
    ckpt: CheckpointConfig | None = None,
    stop: StopRequest | None = None,
    until: int | None = None,
    tokens: np.ndarray | None = None,
    val_tokens=None,
    log: MetricsLog | None = None,
    events: EventLog | None = None,
    handover: Handover | None = None,
    on_stop=None,
) -> JobResult:
    """The whole sequence: build -> load -> fit -> close (`on_stop`: see Job)."""
    with Job(
        model_cfg,
        train_cfg,
        layout,
        device,
        ckpt=ckpt,
        tokens=tokens,
        val_tokens=val_tokens,
        log=log,
        events=events,
        handover=handover,
        stop=stop,
        on_stop=on_stop,
    ) as job:
        status = job.fit(stop, until)
    return job.result(status)


def evaluation_due(step: int, cfg: TrainConfig, val_batches: int) -> bool:
    """After (1-based) step `step`: every eval_every-th step and the run's last, when there is validation
    data. A function of the step alone, so a resumed run evaluates where the uninterrupted one did."""
    if not val_batches:
        return False
    return step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


def _agree(
    stop: StopRequest | None,
    checkpointer: Checkpointer | None,
    step: int,
    phase_end: bool = False,
    coming: bool = False,
) -> tuple[bool, bool, bool]:
    """One all-reduce: does any rank want to stop; is a periodic save due (rank 0's clock decides); has rank 0
    seen the next world started?"""
    local_stop = phase_end or (stop is not None and stop.local())
    local_save = (
        checkpointer is not None
        and checkpointer.due(step)
        and (dist.get_rank() == 0 or not checkpointer.cfg.save_interval_s)
    )
    flags = torch.tensor([float(local_stop), float(local_save), float(coming)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo, also beside NCCL
    return bool(flags[0]), bool(flags[1]), bool(flags[2])
