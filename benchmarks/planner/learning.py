"""How the planner's learning from a job (plan/measured.py) behaves when its hardware profile is wrong, in
simulation: the planner plans GPT-3 XL on 16 H100s (hosts of 8, global batch 64 x 2048) with a profile that has
one field set wrong, "measures" the chosen layout with the true profile (`h100-80g` as shipped), and plans
again with that measurement, five times (five phases on the same hosts). Prints, per wrong field, each phase's
true step time over the true best layout's.

    python benchmarks/planner/learning.py

Not a measurement of hardware: it shows what the learning rule can and cannot correct (a layout that ran
slower than predicted gives way; a better layout that the wrong profile predicts slow is never tried).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.plan import Request, load_hardware, plan  # noqa: E402
from elastic_trainer.plan.candidates import evaluate  # noqa: E402

WRONG = (
    ("intra_host_gbs", 20),
    ("inter_host_gbs", 20),
    ("inter_host_gbs", 0.1),
    ("tflops", 2.0),
    ("tflops", 0.5),
    ("overlap", 0.0),
    ("half_rate_tokens", 5),
)


def main() -> None:
    model, true_hw = load_model_config("gpt3-xl"), load_hardware("h100-80g")
    for field, factor in WRONG:
        wrong = dataclasses.replace(true_hw, **{field: getattr(true_hw, field) * factor})
        req = Request(model, 16, 64, 2048, wrong, 8, dtype="bf16")
        truth = dataclasses.replace(req, hardware=true_hw)
        best = plan(truth).chosen.step_time_s
        measured: list = []
        path = []
        for _ in range(5):
            chosen = plan(dataclasses.replace(req, measured=tuple(measured))).chosen
            seconds = evaluate(truth, chosen.layout).time.total
            path.append(seconds / best)
            if chosen.layout not in dict(measured):
                measured.append((chosen.layout, seconds))
        print(f"{field} x{factor:g}: true step time / true best, phases 1-5: " + " ".join(f"{x:.2f}" for x in path))


if __name__ == "__main__":
    main()
