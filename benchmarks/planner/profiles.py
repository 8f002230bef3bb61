"""The same measured layouts, predicted by other hardware profiles: Spearman, prediction error, the dp modes'
order at equal degrees and the layout each profile would choose among those measured, from a results .json
of run.py (its screening measurements; nothing is run again).

    python benchmarks/planner/profiles.py benchmarks/planner/results-gpt3-small-4.json cpu \\
        benchmarks/planner/cpu-gpt3-small.toml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as bench  # noqa: E402  (this folder's run.py)

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.plan import Request, load_hardware  # noqa: E402
from elastic_trainer.plan.candidates import evaluate  # noqa: E402
from elastic_trainer.plan.hardware import Hardware  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402


def model_of(result: dict):
    """The results' model: a preset, or this folder's benchmark model (bench-model.toml)."""
    bench_model = load_model_config(str(Path(__file__).resolve().parent / "bench-model.toml"))
    return bench_model if result["model"] == bench_model.name else load_model_config(result["model"])


def repredicted(result: dict, world: int, profile: str | Hardware) -> list[dict]:
    """The screened rows of `world` ranks with `profile`'s predictions (a profile's name or file, or one loaded)."""
    model, hw = model_of(result), profile if isinstance(profile, Hardware) else load_hardware(profile)
    req = Request(model, world, result["global_batch"], result["seq_len"], hw, world, dtype="fp32")
    rows = []
    for r in result["layouts"]:
        if r["ranks"] == world:
            layout = Layout(r["dp"], r["tp"], r["pp"], r["micro_batch"], r["num_microbatches"], dp_mode=r["dp_mode"])
            rows.append({**r, "predicted_s": evaluate(req, layout).time.total})
    return rows


def judged(result: dict, world: int, rows: list[dict]) -> tuple[dict, float, dict, list[dict]]:
    """Re-predicted rows judged as run.py judges a run: (the layout they would choose, the best screened
    seconds, the prediction errors, the dp modes' orders: by the run's mode rounds where it had them)."""
    summary = next((s for s in result.get("summary", []) if s.get("ranks") == world), None)
    return (
        min(rows, key=lambda r: r["predicted_s"]),
        min(r["measured_s"] for r in rows),
        bench.prediction_errors(rows),
        bench.mode_orders(rows, bench.remeasured_in(summary) if summary else None),
    )


def main(argv: list[str]) -> None:
    result = json.loads(Path(argv[0]).read_text())
    for world in sorted({r["ranks"] for r in result["layouts"]}):
        for profile in argv[1:]:
            rows = repredicted(result, world, profile)
            chosen, best, errors, orders = judged(result, world, rows)
            print(
                f"{world} ranks, {profile}: Spearman "
                f"{bench.spearman([r['predicted_s'] for r in rows], [r['measured_s'] for r in rows]):.3f}"
                f" over {len(rows)} layouts, error median {errors['median_abs_error']:.1%} (largest "
                f"{errors['max_abs_error']:.1%}), dp modes in the measured order at {bench.order_counts(orders)}"
                f"; would choose dp{chosen['dp']} tp{chosen['tp']} pp{chosen['pp']} micro "
                f"{chosen['micro_batch']} {chosen['dp_mode']} (screened {chosen['measured_s']:.2f} s; best "
                f"screened {best:.2f} s: {best / chosen['measured_s']:.3f})"
            )
            for o in orders:
                print(
                    f"    {o['degrees']} micro {o['micro_batch']}: predicted {' < '.join(o['predicted'])}, "
                    f"measured {' < '.join(o['measured'])}"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
