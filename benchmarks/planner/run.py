"""Planner quality: run every valid layout the planner enumerates, measure it, compare with its prediction.

For each rank count, the planner (calibrated `cpu` profile) lists every valid layout of the benchmark model
(recompute off: it only trades time for memory, and memory is plentiful here). Each layout trains a few
steps on forked local gloo ranks, one thread each, on synthetic tokens; a step's time is the slowest rank's,
the layout's time the fastest of its measured steps (the least disturbed by other work on a shared machine).

That screening ranks all layouts (Spearman correlation of predicted and measured step time), but its minimum
over dozens of noisy 2-step measurements is biased low (the winner's curse): the top layouts lie within
~10 % of each other and a single step varies by about as much. So the finalists -- the planner's choice and
the `--finalists` fastest screened layouts -- are measured again in `--rounds` interleaved rounds of
`--final-steps` steps each (after `--final-warmup` unmeasured ones), and compared by their median step
time. Reported per rank count: measured throughput of the planner's choice / best finalist's (target >= 0.95),
from the finals, and the screening's Spearman correlation.

    python benchmarks/planner/run.py                       # 4 and 8 ranks, about 25 minutes on 2 cores
    python benchmarks/planner/run.py --screening benchmarks/planner/results.json   # finals only
    python benchmarks/planner/run.py --ranks 4 --limit 3   # a quick check of the harness
    python benchmarks/planner/run.py --model gpt3-small --calibrate --out ...   # this machine's profile, now
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # the ranks measured as the trainer's run, with glibc keeping freed memory
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan import Request, load_hardware, plan  # noqa: E402
from elastic_trainer.train import Trainer  # noqa: E402

HERE = Path(__file__).resolve().parent
FIELDS = [
    "ranks",
    "dp",
    "tp",
    "pp",
    "micro_batch",
    "num_microbatches",
    "dp_mode",
    "predicted_s",
    "measured_s",
    "measured_tokens_per_s",
    "predicted_rank",
    "measured_rank",
    "step_s",
]


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(HERE / "bench-model.toml"), help="model preset or TOML file")
    p.add_argument("--ranks", default="4,8", help="rank counts to plan and measure")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hardware", default="cpu", help="hardware profile the planner uses (name or TOML file)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="first run `elastic-trainer calibrate --base HARDWARE --model MODEL` on this machine (about "
        "40 s on 2 cores) and plan with the profile it writes (OUT-profile.toml)",
    )
    p.add_argument("--steps", type=int, default=2, help="measured steps per layout")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per layout")
    p.add_argument("--limit", type=int, default=0, help="measure only the first N layouts per rank count")
    p.add_argument(
        "--sample",
        type=int,
        default=0,
        help="screen the predicted top N plus N drawn at random from the rest (0: every layout)",
    )
    p.add_argument("--finalists", type=int, default=4, help="fastest screened layouts measured again")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the finals")
    p.add_argument("--final-steps", type=int, default=3, help="measured steps per finalist and round")
    p.add_argument(
        "--final-warmup",
        type=int,
        default=2,
        help="unmeasured steps per finalist and round (a CPU rank's heap grows over its first 3 steps)",
    )
    p.add_argument(
        "--mode-rounds",
        type=non_negative,
        default=0,
        help="interleaved rounds (of the finals' steps) measuring again each group of layouts that differ "
        "only in dp mode, judged by their medians (0: by the screening)",
    )
    p.add_argument("--screening", help="reuse the screened layouts of this results .json (finals only)")
    p.add_argument("--out", default=str(HERE / "results"), help="prefix of the .json and .csv written")
    args = p.parse_args(argv)
    args.screened = screened_layouts(p, args.screening) if args.screening else None
    return args


def screened_layouts(parser: argparse.ArgumentParser, path: str) -> list[dict]:
    """The screened rows of an earlier results .json; a file that is not one: one line and exit 2 (before any
    calibration or measurement)."""
    try:
        layouts = json.loads(Path(path).read_text())["layouts"]
        if not isinstance(layouts, list) or not all(isinstance(r, dict) and "ranks" in r for r in layouts):
            raise ValueError("its layouts are not rows of this benchmark")
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--screening {path}: not a results .json of this benchmark ({type(e).__name__}: {e})")
    return layouts


def step_times(rank: int, world: int, model, cfg: TrainConfig, layout, tokens: np.ndarray) -> list[float]:
    trainer = Trainer(model, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    return [trainer.train_step()["step_time_s"] for _ in range(cfg.steps)]


def measure(model, cfg: TrainConfig, layout, tokens, warmup: int) -> tuple[float, list[float]]:
    per_rank = run_ranks(step_times, layout.world_size, model, cfg, layout, tokens, timeout=900)
    steps = [max(r[i] for r in per_rank) for i in range(cfg.steps)][warmup:]
    return min(steps), steps


def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (nan for fewer than 2 layouts)."""
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(ranks_of(a), ranks_of(b))[0, 1])


def screened_ranks(n: int, sample: int, seed: int = 0) -> list[int]:
    """1-based predicted ranks to screen: all n, or the top `sample` plus `sample` drawn at random from the rest."""
    if not sample or n <= 2 * sample:
        return list(range(1, n + 1))
    rest = np.random.default_rng(seed).choice(np.arange(sample + 1, n + 1), size=sample, replace=False)
    return list(range(1, sample + 1)) + sorted(int(r) for r in rest)


def prediction_errors(rows: list[dict]) -> dict:
    """Median and largest |predicted - measured| / measured over the screened layouts."""
    errors = sorted(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows)
    return {"median_abs_error": round(float(np.median(errors)), 4), "max_abs_error": round(errors[-1], 4)}


def mode_key(r: dict) -> tuple:
    """(dp, tp, pp, micro-batch, dp mode): a layout of the benchmark (its accumulation follows from them)."""
    return r["dp"], r["tp"], r["pp"], r["micro_batch"], r["dp_mode"]


def mode_groups(rows: list[dict]) -> list[list[dict]]:
    """The layouts that differ only in dp mode (equal degrees and micro-batch), groups of 2+."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(mode_key(r)[:-1], []).append(r)
    return [g for _, g in sorted(groups.items()) if len(g) > 1]


MODE_APART = 0.03
"""Two modes' measured medians closer than this (relative) are not ordered by one run here: the same layout's
median moved by about as much between the rounds of the mode runs (benchmarks/planner/README.md)."""


def apart_pairs(predicted: list[str], seconds: dict[str, float]) -> list[dict]:
    """The pairs of modes measured more than MODE_APART apart, faster first, each with whether the prediction
    orders it so."""
    out = []
    for a, b in itertools.combinations(sorted(seconds, key=seconds.get), 2):
        if seconds[b] > seconds[a] * (1 + MODE_APART):
            out.append({"faster": a, "slower": b, "predicted": predicted.index(a) < predicted.index(b)})
    return out


def order_counts(orders: list[dict]) -> str:
    """'X of Y equal degrees (Z of W pairs measured more than 3 % apart)'."""
    pairs = [p for o in orders for p in o["apart"]]
    return (
        f"{sum(o['match'] for o in orders)} of {len(orders)} equal degrees ({sum(p['predicted'] for p in pairs)} "
        f"of {len(pairs)} pairs measured more than {MODE_APART:.0%} apart)"
    )


def mode_orders(rows: list[dict], remeasured: dict[tuple, float] | None = None) -> list[dict]:
    """At equal degrees and micro-batch, the dp modes ordered by prediction and by measurement: the screening's,
    or `remeasured` (median seconds by mode_key) where given."""
    out = []
    for g in mode_groups(rows):
        seconds = {r["dp_mode"]: (remeasured or {}).get(mode_key(r), r["measured_s"]) for r in g}
        predicted = [r["dp_mode"] for r in sorted(g, key=lambda r: r["predicted_s"])]
        measured = sorted(seconds, key=seconds.get)
        out.append(
            {
                "degrees": [g[0]["dp"], g[0]["tp"], g[0]["pp"]],
                "micro_batch": g[0]["micro_batch"],
                "predicted": predicted,
                "measured": measured,
                "match": predicted == measured,
                "apart": apart_pairs(predicted, seconds),
                "measured_s": {m: round(t, 4) for m, t in seconds.items()},
                "measured_by": "mode rounds" if remeasured else "screening",
                "predicted_s": {r["dp_mode"]: r["predicted_s"] for r in g},
            }
        )
    return out


def candidate_row(world: int, rank: int, c) -> dict:
    """A candidate's layout and prediction, as the rows record them (rank: its 1-based place in the plan)."""
    return {
        "ranks": world,
        "dp": c.dp,
        "tp": c.tp,
        "pp": c.pp,
        "micro_batch": c.micro_batch,
        "num_microbatches": c.num_microbatches,
        "dp_mode": c.dp_mode,
        "predicted_s": round(c.step_time_s, 4),
        "predicted_rank": rank,
    }


LAYOUT_KEYS = ("dp", "tp", "pp", "micro_batch", "num_microbatches", "dp_mode")


def repredicted(world: int, screened: list[dict], cands) -> list[dict]:
    """Screened rows (of an earlier run) placed in this plan: each takes its layout's prediction and rank here
    (the profile or the model may have changed since); a layout this plan no longer lists is left out."""
    place = {tuple(getattr(c, k) for k in LAYOUT_KEYS): i for i, c in enumerate(cands)}
    rows = []
    for r in screened:
        i = place.get(tuple(r[k] for k in LAYOUT_KEYS))
        if i is None:
            print(
                f"[bench] {world} ranks: screened layout {[r[k] for k in LAYOUT_KEYS]} is not in this plan: left out",
                flush=True,
            )
        else:
            rows.append({**r, **candidate_row(world, i + 1, cands[i])})
    return rows


def screen(
    world: int, args, model, req, cands, tokens, ranks: list[int] | None = None
) -> tuple[list[dict], list[dict]]:
    """The candidates of the given 1-based predicted ranks (all of them by default), a few steps each: (the
    measured rows, the layouts whose run failed: a rank killed by the kernel for the host's memory, a finding
    the screen goes on after). Both are written to OUT-screening.json after every layout."""
    cfg = TrainConfig(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        steps=args.warmup + args.steps,
        seed=0,
        dtype="fp32",
        warmup_steps=1,
    )
    measure(model, cfg, cands[0].layout, tokens, args.warmup)  # unmeasured: the first run of a process is slow
    rows, failed = [], []
    for i in [r - 1 for r in ranks] if ranks else range(len(cands)):
        c = cands[i]
        t0 = time.perf_counter()
        row = candidate_row(world, i + 1, c)
        try:
            measured, steps = measure(model, cfg, c.layout, tokens, args.warmup)
            rows.append(
                {
                    **row,
                    "measured_s": round(measured, 4),
                    "measured_tokens_per_s": round(req.tokens / measured, 1),
                    "step_s": [round(s, 4) for s in steps],
                }
            )
            result = f"predicted {c.step_time_s:.3f} s, measured {measured:.3f} s"
        except RuntimeError as e:
            failed.append({**row, "error": str(e).splitlines()[0]})
            result = f"FAILED {failed[-1]['error']}"
        Path(args.out + "-screening.json").write_text(json.dumps({"layouts": rows, "failed": failed}, indent=1))
        print(
            f"[bench] {world} ranks {i + 1}/{len(cands)} {c.layout.describe()}: {result} "
            f"({time.perf_counter() - t0:.0f} s wall)",
            flush=True,
        )
    for r, rank in zip(rows, ranks_of([r["measured_s"] for r in rows])):
        r["measured_rank"] = rank
    return rows, failed


def finals(
    world: int, args, model, req, finalists: list, tokens, rounds: int = 0, label: str = "final"
) -> dict[int, list[float]]:
    """Median-ready step times of each finalist (by predicted rank), measured in interleaved rounds (`rounds`,
    or --rounds)."""
    rounds = rounds or args.rounds
    cfg = TrainConfig(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        steps=args.final_warmup + args.final_steps,
        seed=0,
        dtype="fp32",
        warmup_steps=1,
    )
    times: dict[int, list[float]] = {rank: [] for rank, _ in finalists}
    for round_ in range(rounds):
        shift = round_ % len(finalists)
        for rank, cand in finalists[shift:] + finalists[:shift]:  # a different order every round
            _, steps = measure(model, cfg, cand.layout, tokens, args.final_warmup)
            times[rank] += steps
            print(
                f"[{label}] {world} ranks, round {round_ + 1}/{rounds}, predicted #{rank} "
                f"{cand.layout.describe()}: {', '.join(f'{s:.3f}' for s in steps)} s",
                flush=True,
            )
    return times


def bench_ranks(world: int, args, model, hw, tokens, screened: list[dict] | None) -> tuple[list[dict], dict]:
    req = Request(model, world, args.global_batch, args.seq_len, hw, world, dtype="fp32", recompute=(False,))
    result = plan(req)
    cands = result.candidates[: args.limit] if args.limit else result.candidates
    rows, failed = (
        (repredicted(world, screened, cands), [])
        if screened is not None
        else screen(world, args, model, req, cands, tokens, screened_ranks(len(cands), args.sample))
    )
    by_rank = {r["predicted_rank"]: r for r in rows}
    fastest = sorted(rows, key=lambda r: r["measured_s"])[: args.finalists]
    picks = sorted({1, *(r["predicted_rank"] for r in fastest)})
    final = finals(world, args, model, req, [(rank, cands[rank - 1]) for rank in picks], tokens)
    medians = {rank: float(np.median(t)) for rank, t in final.items()}
    best = min(medians, key=medians.get)
    remeasured = {}
    for g in mode_groups(rows) if args.mode_rounds else []:  # group by group, so drift touches a group's modes alike
        times = finals(
            world,
            args,
            model,
            req,
            [(r["predicted_rank"], cands[r["predicted_rank"] - 1]) for r in g],
            tokens,
            args.mode_rounds,
            "modes",
        )
        remeasured.update({mode_key(r): float(np.median(times[r["predicted_rank"]])) for r in g})

    def describe(rank):
        return {k: by_rank.get(rank, candidate_row(world, rank, cands[rank - 1]))[k] for k in FIELDS[1:8]}

    summary = {
        "ranks": world,
        "layouts": len(rows),
        "chosen": {**describe(1), "median_s": round(medians[1], 4)},
        "best_final": {**describe(best), "median_s": round(medians[best], 4), "predicted_rank": best},
        "chosen_over_best": round(medians[best] / medians[1], 4),
        "screening_chosen_over_best": (
            round(min(r["measured_s"] for r in rows) / by_rank[1]["measured_s"], 4) if 1 in by_rank else None
        ),  # an earlier screening, re-predicted
        "valid_layouts": len(cands),
        "failed": failed,
        **prediction_errors(rows),
        "mode_orders": mode_orders(rows, remeasured),
        "finals": {str(rank): [round(s, 4) for s in t] for rank, t in final.items()},
        "spearman": round(spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]), 4),
    }
    return rows, summary


def calibrated(args) -> str:
    """Path of the profile `elastic-trainer calibrate` writes for this run: this machine measured now, each dp
    mode at the benchmark's model and sequence length, the rest kept from --hardware."""
    out = args.out + "-profile.toml"
    cmd = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "calibrate",
        "--base",
        args.hardware,
        "--model",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--output",
        out,
    ]
    print("[bench] " + " ".join(["elastic-trainer", *cmd[3:]]), flush=True)
    code = subprocess.run(cmd).returncode
    if code:  # calibrate printed its own error above; its exit code (2: bad input) is the benchmark's
        print(f"[bench] calibrate exited {code}: nothing benchmarked (its message is above)", file=sys.stderr)
        raise SystemExit(code)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    hardware = calibrated(args) if args.calibrate else args.hardware
    model, hw = load_model_config(args.model), load_hardware(hardware)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 200_000).astype(np.int64)
    print(
        f"[bench] {model.name} ({model.num_params() / 1e6:.1f} M parameters), global batch {args.global_batch} x "
        f"{args.seq_len}, hardware profile {hw.name}, {args.warmup} warm-up + {args.steps} measured steps",
        flush=True,
    )
    t0 = time.perf_counter()
    previous = args.screened
    rows, summaries = [], []
    for world in [int(r) for r in args.ranks.split(",")]:
        screened = [r for r in previous if r["ranks"] == world] if previous is not None else None
        r, s = bench_ranks(world, args, model, hw, tokens, screened)
        rows += r
        summaries.append(s)
        orders = s["mode_orders"]
        print(
            f"[bench] {world} ranks: chosen/best finalist throughput {s['chosen_over_best']:.3f} (target >= 0.95; "
            f"screening alone {s['screening_chosen_over_best'] or float('nan'):.3f}), Spearman {s['spearman']:.3f} "
            f"over {s['layouts']} of {s['valid_layouts']} layouts, prediction error median {s['median_abs_error']:.1%} "
            f"(largest {s['max_abs_error']:.1%}), dp modes in the measured order at "
            f"{order_counts(orders)}",
            flush=True,
        )
    result = {
        "model": model.name,
        "params": model.num_params(),
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "hardware": hw.name,
        "calibrated": hardware if args.calibrate else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "finals": {
            "finalists": args.finalists,
            "rounds": args.rounds,
            "steps": args.final_steps,
            "warmup": args.final_warmup,
            "mode_rounds": args.mode_rounds,
        },
        "screening_from": args.screening,
        "failed": [f for s in summaries for f in s["failed"]],
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": summaries,
        "layouts": rows,
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "step_s": " ".join(map(str, r["step_s"]))})
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
