"""The dp modes' order at equal degrees, measured until it is told apart from noise or shown to be a tie.

run.py judges the modes of a group (layouts that differ only in dp mode) by medians of one or two rounds, each
mode a separate run minutes from the others, and calls two modes ordered when they are more than 3 % apart
(MODE_APART). On a shared 2-core machine a layout's speed drifts by more than that between minutes. Here the
ranks build one trainer per mode of the group and step them in turn (a cycle: one step of each mode, the order
rotating from cycle to cycle), so the steps compared are seconds apart and train the same samples. Each pair
is tested on its per-cycle ratios (the log of mode a's step over mode b's in the same cycle) by an exact
sign-flip (paired permutation) test of their mean against 0. A pair is *ordered* when p < 0.05 (6 cycles or
more: with n cycles the smallest p is 2 / 2**n); otherwise the measurement does not tell it from a tie. The
prediction agrees on an ordered pair when it puts the faster mode first; a tie has no order to match.

Runs of the same groups can be read as more cycles of one measurement: `--pool` joins their cycles group by group
and judges every pair again on all of them, under the prediction of `--hardware`; nothing is measured. A ratio
within a cycle cancels a slowdown all modes share, so runs at different speeds of the machine pool as they are;
pooling assumes the ratio itself is the same in each run.

    python benchmarks/planner/mode_order.py --model gpt3-small --ranks 4 --calibrate --out /tmp/modes-4
    python benchmarks/planner/mode_order.py --model gpt3-small --ranks 8 --hardware PROFILE.toml --degrees 2,1,4
    python benchmarks/planner/mode_order.py --pool RUN1.json RUN2.json --hardware PROFILE.toml --out /tmp/pooled
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":  # measured as run.py measures: glibc keeping freed memory, as the trainer's run
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import numpy as np  # noqa: E402
import run as bench  # noqa: E402  (this folder's run.py)
import torch  # noqa: E402

from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan import Request, load_hardware, plan  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402

SIGNIFICANCE = 0.05
EXACT_UP_TO = 16
"""Cycles up to which the sign-flip test counts all 2**n patterns; beyond, DRAWN patterns drawn (seed 0)."""
DRAWN = 200_000


def sign_flip_p(values: list[float]) -> float:
    """Two-sided p of a sign-flip test: the share of sign patterns whose mean is at least as far from 0 as the
    observed one (values: paired differences, one per cycle); exact up to EXACT_UP_TO values, beyond that
    (k + 1) / (DRAWN + 1) of DRAWN patterns drawn, the observed pattern counted once (never 0)."""
    x = np.asarray(values, dtype=float)
    observed = abs(x.mean())
    if len(x) <= EXACT_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(x))))
        return float(np.mean(np.abs((signs * x).mean(axis=1)) >= observed - 1e-12))
    signs = np.random.default_rng(0).choice((1.0, -1.0), size=(DRAWN, len(x)))
    return float((np.sum(np.abs((signs * x).mean(axis=1)) >= observed - 1e-12) + 1) / (DRAWN + 1))


def cycle_order(modes: int, cycle: int) -> list[int]:
    """The modes' order in a cycle: rotated by one every cycle, so each follows each other as often."""
    shift = cycle % modes
    return list(range(shift, modes)) + list(range(shift))


def interleaved_steps(
    rank: int, world: int, model, cfg: TrainConfig, layouts: list, tokens: np.ndarray, warmup: int, cycles: int
) -> list[list[float]]:
    """On one rank: a trainer per layout, `warmup` unmeasured steps of each, then `cycles` cycles of one step of
    each; the step times by layout."""
    trainers = [
        Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens) for layout in layouts
    ]
    for trainer in trainers:
        for _ in range(warmup):
            trainer.train_step()
    times: list[list[float]] = [[] for _ in layouts]
    for cycle in range(cycles):
        for i in cycle_order(len(layouts), cycle):
            times[i].append(trainers[i].train_step()["step_time_s"])
        if rank == 0:  # progress: rank 0's own times (the result takes each step's slowest rank)
            print(
                f"[modes]   cycle {cycle + 1}/{cycles}: "
                + ", ".join(f"{layout.dp_mode} {t[-1]:.3f} s" for layout, t in zip(layouts, times)),
                flush=True,
            )
    return times


def measure_group(model, args, layouts: list, tokens: np.ndarray) -> list[list[float]]:
    """The group's step times by layout: each step the slowest rank's."""
    cfg = TrainConfig(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        steps=args.warmup + args.cycles,
        seed=0,
        dtype="fp32",
        warmup_steps=1,
    )
    per_rank = run_ranks(
        interleaved_steps, layouts[0].world_size, model, cfg, layouts, tokens, args.warmup, args.cycles, timeout=7200
    )
    return [[max(r[i][c] for r in per_rank) for c in range(args.cycles)] for i in range(len(layouts))]


def judge_pair(a: str, b: str, steps: dict[str, list[float]], predicted_s: dict[str, float]) -> dict:
    """Modes a and b of one group: their per-cycle ratio, whether the cycles order them, which is faster, and
    whether the prediction puts that one first (None for a tie)."""
    logs = [float(np.log(x / y)) for x, y in zip(steps[a], steps[b])]
    p = sign_flip_p(logs)
    ratio = float(np.exp(np.mean(logs)))  # a over b, geometric mean over cycles
    faster, slower = (a, b) if ratio < 1 else (b, a)
    ordered = p < SIGNIFICANCE
    return {
        "faster": faster,
        "slower": slower,
        "ratio": round(max(ratio, 1 / ratio), 4),
        "faster_in_cycles": sum((x < 0) == (ratio < 1) for x in logs),
        "cycles": len(logs),
        "p": round(p, 4),
        "ordered": ordered,
        "predicted": (predicted_s[faster] < predicted_s[slower]) if ordered else None,
    }


def judge_group(steps: dict[str, list[float]], predicted_s: dict[str, float]) -> list[dict]:
    """Every pair of the group's modes, judged on the cycles."""
    return [judge_pair(a, b, steps, predicted_s) for a, b in itertools.combinations(sorted(steps), 2)]


def group_result(
    degrees: list[int], micro_batch: int, steps: dict[str, list[float]], predicted_s: dict[str, float]
) -> dict:
    """A group's entry in a result: each mode's steps and their median, the predicted order, the judged pairs."""
    return {
        "degrees": degrees,
        "micro_batch": micro_batch,
        "predicted": sorted(predicted_s, key=predicted_s.get),
        "predicted_s": predicted_s,
        "steps_s": {m: [round(s, 4) for s in t] for m, t in steps.items()},
        "median_s": {m: round(float(np.median(t)), 4) for m, t in steps.items()},
        "pairs": judge_group(steps, predicted_s),
    }


def counts(groups: list[dict]) -> str:
    """'K of N ordered pairs in the predicted order (T of M pairs a tie ...)'."""
    pairs = [p for g in groups for p in g["pairs"]]
    ordered = [p for p in pairs if p["ordered"]]
    return (
        f"{sum(p['predicted'] for p in ordered)} of {len(ordered)} ordered pairs in the predicted order "
        f"({len(pairs) - len(ordered)} of {len(pairs)} pairs a tie at p >= {SIGNIFICANCE})"
    )


SHAPE = ("model", "ranks", "global_batch", "seq_len")
"""What runs pooled must share (besides their groups)."""


def result_model(result: dict, model_file: str | None = None) -> ModelConfig:
    """A result's model: the preset it names, or `model_file` (a TOML file) when that is the model named."""
    try:
        return load_model_config(result["model"])
    except ConfigError:
        if model_file is None:
            raise
        model = load_model_config(model_file)
        if model.name != result["model"]:
            raise ConfigError(
                f"the runs' model {result['model']!r} is no preset and --model {model_file} is "
                f"{model.name!r}: give the model file the runs used as --model"
            ) from None
        return model


def predicted_times(result: dict, hw, model_file: str | None = None) -> dict[tuple, float]:
    """The step time `hw` predicts for each layout of a result's plan, by (dp, tp, pp, micro_batch, dp_mode)."""
    model = result_model(result, model_file)
    req = Request(
        model,
        result["ranks"],
        result["global_batch"],
        result["seq_len"],
        hw,
        result["ranks"],
        dtype="fp32",
        recompute=(False,),
    )
    return {
        (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.micro_batch, c.layout.dp_mode): c.time.total
        for c in plan(req).candidates
    }


def group_key(group: dict) -> tuple:
    return tuple(group["degrees"]), group["micro_batch"], tuple(sorted(group["steps_s"]))


def pooled(results: list[dict], hw, model_file: str | None = None, sources: list[str] | None = None) -> dict:
    """Results of the same groups as one measurement: each group's cycles joined, in the order the results are
    given, and every pair judged again on all of them, against `hw`'s prediction (the runs' own were calibrated
    apart). Groups are matched by degrees, micro-batch and modes, in the first result's order."""
    first = results[0]
    keys = sorted(group_key(g) for g in first["groups"])
    for r in results[1:]:
        if any(r[k] != first[k] for k in SHAPE) or sorted(group_key(g) for g in r["groups"]) != keys:
            raise ValueError(
                "cannot pool runs of different groups: "
                + "; ".join(
                    ", ".join(f"{k} {x[k]}" for k in SHAPE)
                    + ", groups "
                    + " ".join(
                        f"{','.join(map(str, d))} micro {mb} ({'/'.join(m)})"
                        for d, mb, m in sorted(group_key(g) for g in x["groups"])
                    )
                    for x in (first, r)
                )
            )
    predicted = predicted_times(first, hw, model_file)
    by_key = [{group_key(g): g for g in r["groups"]} for r in results]
    groups = []
    for parts in ([runs[group_key(g)] for runs in by_key] for g in first["groups"]):
        steps = {m: [s for part in parts for s in part["steps_s"][m]] for m in parts[0]["steps_s"]}
        layouts = {m: (*parts[0]["degrees"], parts[0]["micro_batch"], m) for m in steps}
        missing = [m for m, layout in layouts.items() if layout not in predicted]
        if missing:
            raise ValueError(
                f"profile {hw.name} plans no {' or '.join(missing)} at degrees "
                f"{parts[0]['degrees']} micro {parts[0]['micro_batch']}: cannot predict the group"
            )
        predicted_s = {m: round(predicted[layout], 4) for m, layout in layouts.items()}
        groups.append(group_result(parts[0]["degrees"], parts[0]["micro_batch"], steps, predicted_s))
    return {
        **{k: first[k] for k in SHAPE},
        "hardware": hw.name,
        "pooled": sources or len(results),
        "cycles": sum(r["cycles"] for r in results),
        "significance": SIGNIFICANCE,
        "summary": counts(groups),
        "groups": groups,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(bench.HERE / "bench-model.toml"), help="model preset or TOML file")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hardware", default="cpu", help="hardware profile the planner uses (name or TOML file)")
    p.add_argument("--calibrate", action="store_true", help="calibrate first, as run.py --calibrate")
    p.add_argument("--cycles", type=int, default=16, help="measured cycles of one step per mode (6 or more)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per mode before the cycles")
    p.add_argument("--degrees", help="only the groups of these degrees, DP,TP,PP (default: every group)")
    p.add_argument("--out", help="prefix of the .json written (default: results-modes here; with --pool, none)")
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="RESULT",
        help="results of the same groups (.json this script "
        "wrote) judged as one measurement under --hardware; nothing is measured",
    )
    args = p.parse_args(argv)
    if args.pool:
        return pool_args(p, args)
    args.out = args.out or str(bench.HERE / "results-modes")
    if args.cycles < 6:
        p.error(f"--cycles {args.cycles}: 6 or more (with fewer no pair can be ordered at p < {SIGNIFICANCE})")
    try:
        args.wanted = [int(d) for d in args.degrees.split(",")] if args.degrees else None
    except ValueError:
        args.wanted = []
    if args.wanted is not None and (len(args.wanted) != 3 or min(args.wanted) < 1):
        p.error(f"--degrees {args.degrees}: three positive integers DP,TP,PP, e.g. 2,1,2")
    try:  # before any calibration or measurement
        load_model_config(args.model)
        if not args.calibrate:
            load_hardware(args.hardware)
    except ConfigError as e:
        p.error(str(e))
    return args


def pool_args(p: argparse.ArgumentParser, args):
    """--pool's arguments checked: no measuring options, each result readable and finished, the profile and the
    model known (a model that is no preset: --model names its file)."""
    for flag, given in (("--calibrate", args.calibrate), ("--degrees", args.degrees)):
        if given:
            p.error(f"{flag} measures; --pool only judges results already measured")
    args.results = []
    for name in args.pool:
        try:
            result = json.loads(Path(name).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--pool {name}: {e}")
        if not (
            isinstance(result, dict)
            and {*SHAPE, "cycles", "groups"} <= set(result)
            and isinstance(result["groups"], list)
            and all(isinstance(g, dict) and {"degrees", "micro_batch", "steps_s"} <= set(g) for g in result["groups"])
        ):
            p.error(
                f"--pool {name}: not a finished mode_order.py result (needs {', '.join(SHAPE)}, cycles, and "
                "groups with degrees, micro_batch and steps_s)"
            )
        args.results.append(result)
    args.model_file = args.model  # used only where the runs' model is no preset (the default: the bench model)
    try:
        result_model(args.results[0], args.model_file)
        load_hardware(args.hardware)
    except ConfigError as e:
        p.error(str(e))
    return args


def report(groups: list[dict]) -> None:
    """Each group's medians and its pairs' verdicts."""
    for g in groups:
        print(
            f"[modes] {g['degrees']} micro {g['micro_batch']}: medians "
            + ", ".join(f"{m} {t:.3f} s" for m, t in g["median_s"].items()),
            flush=True,
        )
        for p in g["pairs"]:
            verdict = (
                "a tie"
                if not p["ordered"]
                else "in the predicted order"
                if p["predicted"]
                else "NOT in the predicted order"
            )
            print(
                f"[modes]     {p['faster']} ahead of {p['slower']} by {p['ratio'] - 1:.1%}, in "
                f"{p['faster_in_cycles']} of {p['cycles']} cycles (p {p['p']:.4f}): {verdict}",
                flush=True,
            )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.pool:
        try:
            result = pooled(args.results, load_hardware(args.hardware), args.model_file, args.pool)
        except ValueError as e:
            print(f"mode_order.py: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        report(result["groups"])
        if args.out:
            Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"[modes] {len(args.pool)} runs pooled, {result['cycles']} cycles per group, profile "
            f"{result['hardware']}: {result['summary']}",
            flush=True,
        )
        return result
    hardware = bench.calibrated(args) if args.calibrate else args.hardware
    model, hw = load_model_config(args.model), load_hardware(hardware)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 200_000).astype(np.int64)
    req = Request(model, args.ranks, args.global_batch, args.seq_len, hw, args.ranks, dtype="fp32", recompute=(False,))
    cands = plan(req).candidates
    rows = [bench.candidate_row(args.ranks, i + 1, c) for i, c in enumerate(cands)]
    every = bench.mode_groups(rows)
    groups = [g for g in every if args.wanted in (None, [g[0]["dp"], g[0]["tp"], g[0]["pp"]])]
    if not groups:
        found = sorted({",".join(str(r[k]) for k in ("dp", "tp", "pp")) for g in every for r in g[:1]})
        print(
            f"mode_order.py: error: no group of dp modes at degrees {args.degrees} in this plan (groups at: "
            f"{' '.join(found) or 'none'}); nothing measured",
            file=sys.stderr,
        )
        raise SystemExit(2)
    print(
        f"[modes] {model.name}, {args.ranks} ranks, profile {hw.name}: {len(groups)} groups of dp modes, "
        f"{args.warmup} warm-up steps and {args.cycles} cycles each",
        flush=True,
    )
    t0, out = time.perf_counter(), []
    for g in groups:
        t1 = time.perf_counter()
        times = measure_group(model, args, [cands[r["predicted_rank"] - 1].layout for r in g], tokens)
        steps = {r["dp_mode"]: t for r, t in zip(g, times)}
        predicted_s = {r["dp_mode"]: r["predicted_s"] for r in g}
        out.append(group_result([g[0]["dp"], g[0]["tp"], g[0]["pp"]], g[0]["micro_batch"], steps, predicted_s))
        print(f"[modes] group measured in {time.perf_counter() - t1:.0f} s wall", flush=True)
        report(out[-1:])
        Path(args.out + ".json").write_text(json.dumps({"groups": out}, indent=1) + "\n")  # progress kept
    result = {
        "model": model.name,
        "ranks": args.ranks,
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "hardware": hw.name,
        "calibrated": hardware if args.calibrate else None,
        "cycles": args.cycles,
        "warmup": args.warmup,
        "significance": SIGNIFICANCE,
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": counts(out),
        "groups": out,
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[modes] {result['summary']} ({result['wall_s']:.0f} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
