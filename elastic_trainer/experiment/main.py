"""`elastic-trainer experiment`: the dynamic-resources experiment from settings to results.

For each hardware profile: plan every policy (profile.py), print the plan, run every policy through the
runtime (runner.py), write a CSV per policy, the plot and the profile's entry of summary.json (results.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.config import ConfigError
from elastic_trainer.experiment import results
from elastic_trainer.experiment.config import Experiment
from elastic_trainer.experiment.profile import ProfilePlan, plan_profile
from elastic_trainer.experiment.results import choice_text
from elastic_trainer.experiment.runner import run_real, run_simulated
from elastic_trainer.experiment.simclock import simulate


@dataclass
class Options:
    clock: str = "simulated"
    time_scale: float | None = None
    """simulated: steps per simulated step (None: from target_steps); real: how much shorter each phase is."""
    target_steps: int = 64
    out: Path = Path("benchmarks/dynamic_resources/results")
    work: Path = Path("runs/experiment")
    hosts: str = "hosts.txt"
    dry_run: bool = False
    train_args: tuple[str, ...] = ()
    """More `train` arguments for every run (e.g. --data, --data-cache)."""


def describe(exp: Experiment, plan: ProfilePlan) -> list[str]:
    """The plan of one profile: each policy's choice per GPU count, steps, ideal and downtime."""
    r = plan.reconfiguration
    handover = ", ".join(f"{k} GPUs {v:.1f} s" for k, v in r["handover_s"].items())
    lines = [
        f"{plan.profile}: {exp.target.model.name}, global batch {exp.target.global_batch} x "
        f"{exp.target.seq_len}; one simulated step = {plan.scale:.1f} target steps; a reconfiguration hands "
        f"{r['state_gb']} GB over through host memory: write at {r['shm_write_gbs_per_rank']:g} GB/s per rank + "
        f"exchange between hosts at {r['inter_host_gbs']:g} GB/s + read at {r['shm_read_gbs_per_rank']:g} GB/s "
        f"per rank + {r['handover_setup_s']:g} s set-up ({handover or 'none'}); after a wait: save + "
        f"{r['restart_s']:g} s restart + load at {r['storage_gbs_per_host']:g} GB/s per host (about "
        f"{r['typical_restart_s']:g} s)"
    ]
    for name, p in plan.policies.items():
        seen = {}
        for c in p.choices:
            seen.setdefault(c.held, c)
        per = "; ".join(f"{held}: {c.describe()}" for held, c in sorted(seen.items(), reverse=True))
        lines.append(
            f"  {name}: {p.timeline.count} steps (ideal {p.ideal.count}), downtime "
            f"{p.timeline.downtime_s:.0f} s | {per}"
        )
    return lines


def _simulated(exp: Experiment, plan: ProfilePlan, opts: Options, say) -> tuple[dict, dict, dict]:
    walls = run_simulated(exp, plan, opts.work / plan.profile, opts.train_args, say=say)
    rows = {
        n: results.simulated_rows(opts.work / plan.profile / n, p.choices, p.timeline) for n, p in plan.policies.items()
    }
    ideal = {n: p.ideal.count for n, p in plan.policies.items()}
    return rows, ideal, walls


def clock_durations(exp: Experiment, opts: Options) -> list[float]:
    """The phases' lengths on the run's clock: full length when simulated, shortened by --time-scale when real."""
    return exp.durations if opts.clock == "simulated" else [d / (opts.time_scale or 1.0) for d in exp.durations]


def _real(exp: Experiment, plan: ProfilePlan, opts: Options, say) -> tuple[dict, dict, dict]:
    durations = clock_durations(exp, opts)
    cap = 4 * max(simulate(durations, p.choices, 1.0).count for p in plan.policies.values()) + 100
    walls = run_real(exp, plan, opts.work / plan.profile, opts.hosts, durations, cap, opts.train_args, say=say)
    rows, ideal = {}, {}
    for n, p in plan.policies.items():
        rows[n] = results.real_rows(opts.work / plan.profile / n, p.choices, durations)
        ideal[n] = measured_ideal(durations, p, rows[n])
    return rows, ideal, walls


def measured_step_times(rows: list[dict]) -> dict[str, float]:
    """Per layout of a real-clock run: the median wall time between consecutive steps in it with no
    reconfiguration between them."""
    import statistics

    times: dict[str, list[float]] = {}
    for a, b in zip(rows, rows[1:]):
        if b["layout"] == a["layout"] and b["downtime_s"] == 0:
            times.setdefault(b["layout"], []).append(b["time_s"] - a["time_s"])
    return {layout: statistics.median(t) for layout, t in times.items()}


def measured_ideal(durations: list[float], policy, rows: list[dict]) -> int:
    """Steps the policy's choices would run with instant reconfiguration at the step times measured for them
    (the median per layout; the planner's prediction for a layout that never ran)."""
    measured = measured_step_times(rows)
    return simulate(
        durations, policy.choices, 1.0, step_time=lambda c: measured.get(choice_text(c), c.step_time_s)
    ).count


def step_time_sources(policy, rows: list[dict], clock: str) -> dict[str, dict]:
    """Per layout the policy chose: the planner's step time for it (`plan_s`, with where the planner had it
    from), the one measured in this run (real clock; None where the layout ran fewer than two steps in a row)
    and which of them the ideal and the simulated clock used (`used`)."""
    measured = measured_step_times(rows) if clock == "real" else {}
    out = {}
    for c in policy.choices:
        if c.candidate is None:
            continue
        text = choice_text(c)
        got = measured.get(text)
        out[text] = {
            "plan_s": round(c.step_time_s, 6),
            "plan_source": c.candidate.source,
            "measured_s": None if got is None else round(got, 6),
            "used": "measured" if got is not None else "predicted",
        }
    return out


def run_profile(exp: Experiment, profile: str, opts: Options, say=print) -> dict:
    scale = opts.time_scale if opts.clock == "simulated" else None
    plan = plan_profile(exp, profile, scale, opts.target_steps)
    for line in describe(exp, plan):
        say(f"[experiment] {line}")
    if opts.dry_run:
        return {}
    t0 = time.time()
    rows, ideal, walls = (_simulated if opts.clock == "simulated" else _real)(exp, plan, opts, say)
    opts.out.mkdir(parents=True, exist_ok=True)
    for name, r in rows.items():
        results.write_csv(opts.out / f"{profile}-{name}.csv", r)
    policies = results.summarize(rows, ideal, opts.clock)
    for name, entry in policies.items():
        entry["wall_s"] = round(walls[name], 1)
        entry["step_times"] = step_time_sources(plan.policies[name], rows[name], opts.clock)
        used = [v["used"] for v in entry["step_times"].values()]
        say(
            f"[experiment] {profile} {name}: step times of {used.count('measured')} layout(s) measured in this run, "
            f"{used.count('predicted')} predicted by the planner"
        )
        if "static" in rows and name != "static":
            entry["loss_vs_static"] = results.loss_match(rows[name], rows["static"])
    results.plot(
        opts.out / f"{profile}.png",
        f"{exp.target.model.name} on {profile} ({opts.clock} clock)",
        rows,
        clock_durations(exp, opts),
        exp.gpus,
    )
    say(f"[experiment] {profile}: done in {time.time() - t0:.0f} s; results in {opts.out}")
    return {
        "clock": opts.clock,
        "hardware": profile,
        "time_scale": round(plan.scale, 3) if opts.clock == "simulated" else opts.time_scale or 1.0,
        "common_step": results.common_step(rows),
        "reconfiguration_model": plan.reconfiguration,
        "wall_s": round(time.time() - t0, 1),
        "policies": policies,
    }


def check_hosts(exp: Experiment, opts: Options) -> None:
    """The real clock's hosts file must hold the schedule's largest allocation (before anything runs)."""
    from elastic_trainer.launch.hosts import default_slots, read_hosts

    slots = sum(h.slots for h in read_hosts(opts.hosts, default_slots()))
    if slots < max(exp.gpus):
        raise ConfigError(f"{opts.hosts} has {slots} slots; the schedule {exp.schedule} needs {max(exp.gpus)}")


def run_experiment(exp: Experiment, opts: Options, say=print) -> dict:
    if opts.clock not in ("simulated", "real"):
        raise ConfigError(f"--clock {opts.clock!r} is not one of simulated, real")
    if opts.clock == "real":
        check_hosts(exp, opts)
    summary_path = opts.out / "summary.json"
    summary = {}
    if summary_path.exists() and not opts.dry_run:  # other profiles' results stay
        import json

        summary = json.loads(summary_path.read_text())
    for profile in exp.profiles:
        entry = run_profile(exp, profile, opts, say)
        if entry:
            summary[profile] = entry
            results.write_summary(summary_path, summary)
    if not opts.dry_run:
        say(f"[experiment] summary: {summary_path}")
    return summary
