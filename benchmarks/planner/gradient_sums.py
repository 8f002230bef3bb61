"""The committed planner runs re-predicted with and without the gradients summed over micro-batches charged in
fsdp and ddp (plan/step_time.py accumulation_bytes; before, only zero1's adds, 12 bytes per micro-batch), at
several `microbatch_ns_per_param`: per run and rank count, chosen / best screened, the median prediction error,
the dp-mode groups in the measured order and the pairs more than 3 % apart in the predicted order. Each run with
its own committed profile (embedding_grad_ns 0.275 where it has none). Nothing is run again; about 30 s.

    python benchmarks/planner/gradient_sums.py            # microbatch_ns_per_param 0, 0.15, 0.3
    python benchmarks/planner/gradient_sums.py 0,0.1,0.2
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import profiles  # noqa: E402  (this folder's profiles.py)

import elastic_trainer.plan.step_time as step_time  # noqa: E402
from elastic_trainer.plan import load_hardware  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = [
    "gpt3-small-8-gloo",
    "gpt3-small-8-head-rate",
    "gpt3-small-8-microbatch",
    "gpt3-small-4-gloo",
    "gpt3-small-4-microbatch",
    "gpt3-medium-4-microbatch",
    "gpt3-medium-8-microbatch",
    "bench-embedding",
    "gpt-tiny-embedding",
]
SUMS = step_time.accumulation_bytes


def zero1_adds_only(layout: Layout, dtype: str) -> float:
    """The model before: zero1's hooks read each gradient and read and write the buffer every micro-batch."""
    return (step_time.DTYPE_BYTES[dtype] + 2 * step_time.MASTER_BYTES) if layout.dp_mode == "zero1" else 0.0


def cell(result: dict, world: int, hw) -> str:
    """'chosen/best screened, median error, groups in order, pairs in order' of the run re-predicted with `hw`."""
    chosen, best, errors, orders = profiles.judged(result, world, profiles.repredicted(result, world, hw))
    pairs = [p for o in orders for p in o["apart"]]
    return (
        f"{best / chosen['measured_s']:.3f} {errors['median_abs_error']:.1%} "
        f"{sum(o['match'] for o in orders)}/{len(orders)} {sum(p['predicted'] for p in pairs)}/{len(pairs)}"
    )


def committed(names: list[str]):
    """(name, results, ranks, its own profile) of each committed run and rank count it measured (the profile's
    embedding_grad_ns 0.275 where it has none)."""
    for name in names:
        result = json.loads((HERE / f"results-{name}.json").read_text())
        own = load_hardware(str(HERE / f"results-{name}-profile.toml"))
        own = own if own.embedding_grad_ns else dataclasses.replace(own, embedding_grad_ns=0.275)
        for world in sorted({r["ranks"] for r in result["layouts"]}):
            yield name, result, world, own


def main(argv: list[str]) -> None:
    per_param = [float(x) for x in (argv[0] if argv else "0,0.15,0.3").split(",")]
    print("run ranks: [model, microbatch_ns_per_param]: chosen/best screened, median error, groups, pairs")
    for name, result, world, own in committed(RUNS):
        cells = []
        for label, charge in (("zero1 adds only", zero1_adds_only), ("sums", SUMS)):
            step_time.accumulation_bytes = charge
            try:
                cells += [
                    f"{label} {m}: {cell(result, world, dataclasses.replace(own, microbatch_ns_per_param=m))}"
                    for m in per_param
                ]
            finally:
                step_time.accumulation_bytes = SUMS
        print(f"{name} {world}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
