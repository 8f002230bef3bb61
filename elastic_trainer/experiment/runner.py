"""Running the experiment: every policy through the elastic runtime (`elastic-trainer launch`, one subprocess
per policy and profile, its output in the run folder's launch.log), then the results (results.py).

- simulated clock: the small model trains on this machine's ranks, one rank per GPU, in the degrees each
  policy chose for the target; each phase runs the steps the simulated clock gives it;
- real clock: the target job itself on the hosts file's GPUs, phases of wall time (`--time-scale` shortens
  them), layouts pinned by the policy (ours: all the GPUs held, re-planned by the runtime at every start with
  `--use-gpus fastest`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.schedule import Phase, dump_schedule
from elastic_trainer.experiment.config import Experiment, JobSpec
from elastic_trainer.experiment.profile import PolicyPlan, ProfilePlan, runtime_schedule


def train_args(job: JobSpec, steps: int) -> list[str]:
    return [
        "--seq-len",
        str(job.seq_len),
        "--global-batch",
        str(job.global_batch),
        "--steps",
        str(steps),
        "--lr",
        repr(job.lr),
        "--warmup-steps",
        str(job.warmup_steps),
        "--log-every",
        "10",
        *(["--seed", str(job.seed)] if job.seed is not None else []),
        *(["--dp-mode", job.dp_mode] if job.dp_mode else []),
    ]


def launch(
    run_dir: Path,
    hosts: str,
    model: str,
    schedule: list[Phase],
    args: list[str],
    launch_args: tuple[str, ...] = (),
    say=print,
) -> float:
    """One run of the runtime from scratch in `run_dir`; its wall seconds. Raises ConfigError when it fails."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sched = run_dir / "schedule.json"
    sched.write_text(dump_schedule(schedule))
    argv = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "launch",
        "--hosts",
        hosts,
        "--run-dir",
        str(run_dir),
        "--schedule",
        str(sched),
        "--model",
        model,
        *launch_args,
        "--",
        *args,
    ]
    t0 = time.time()
    with open(run_dir / "experiment.log", "w") as log:
        code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0:
        tail = (run_dir / "experiment.log").read_text().strip().splitlines()[-3:]
        raise ConfigError(f"the run in {run_dir} failed (exit {code}): {' | '.join(tail)}")
    return time.time() - t0


def run_simulated(
    exp: Experiment, plan: ProfilePlan, work: Path, extra: tuple[str, ...] = (), say=print
) -> dict[str, float]:
    """Train the small model through every policy's runtime schedule; wall seconds per policy."""
    ranks = max(max((c.used for c in p.choices), default=1) for p in plan.policies.values())
    hosts = work / "hosts.txt"
    hosts.parent.mkdir(parents=True, exist_ok=True)
    hosts.write_text(f"# the simulated clock's ranks: one per GPU of the target\nlocalhost slots={ranks}\n")
    walls = {}
    for name, policy in plan.policies.items():
        schedule = runtime_schedule(exp.small, policy)
        say(
            f"[experiment] {plan.profile} / {name}: {policy.timeline.count} steps in "
            f"{sum(1 for p in schedule if p.gpus)} phase(s) on up to {ranks} ranks"
        )
        walls[name] = launch(
            work / name, str(hosts), exp.small.model.name, schedule, [*train_args(exp.small, plan.cap), *extra], say=say
        )
        say(f"[experiment] {plan.profile} / {name}: done in {walls[name]:.0f} s")
    return walls


def real_schedule(policy: PolicyPlan, durations: list[float]) -> list[Phase]:
    """Time phases of the policy's choices: waits hold 0 GPUs; ours holds every GPU of the phase and the runtime
    re-plans it with the job's `--use-gpus fastest` (plan.use_gpus: the same choice of GPUs to leave idle)."""
    out = []
    for choice, seconds in zip(policy.choices, durations):
        if choice.waits:
            out.append(Phase(0, duration_s=seconds))
        elif policy.name == "ours":
            out.append(Phase(choice.held, duration_s=seconds))
        else:
            c = choice.candidate
            out.append(Phase(choice.used, duration_s=seconds, layout=c.degrees, micro_batch=c.micro_batch))
    return out


def run_real(
    exp: Experiment,
    plan: ProfilePlan,
    work: Path,
    hosts: str,
    durations: list[float],
    steps: int,
    extra: tuple[str, ...] = (),
    say=print,
) -> dict[str, float]:
    """The target job through every policy on the hosts file's GPUs, phases of `durations` wall seconds."""
    walls = {}
    for name, policy in plan.policies.items():
        say(f"[experiment] {plan.profile} / {name}: {len(durations)} phase(s), {sum(durations):.0f} s of schedule")
        args = [*train_args(exp.target, steps), "--hardware", plan.profile, *extra]
        if name == "ours":
            args += ["--use-gpus", "fastest"]
        walls[name] = launch(work / name, hosts, exp.target.model.name, real_schedule(policy, durations), args, say=say)
        say(f"[experiment] {plan.profile} / {name}: done in {walls[name]:.0f} s")
    return walls
