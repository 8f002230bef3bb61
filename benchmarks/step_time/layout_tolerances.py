"""Print the measured layout-invariance tolerances: every layout of the test matrix against (1,1,1).

    python benchmarks/step_time/layout_tolerances.py

Uses the same forked-rank jobs as tests/distributed/test_layout_invariance.py (gpt-tiny, global batch 8,
5 steps, fp32, gloo) and reports, per layout, the largest per-step relative difference of loss and grad
norm, and the relative L2 difference of the final parameters: the whole vector, the worst tensor with the
key third of the attention biases taken out, and those key thirds (relative to their whole bias; their
gradient is analytically zero, so they hold rounding noise).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elastic_trainer.data import load_tokens  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from tests.distributed.test_layout_invariance import (
    CFG,
    LAYOUTS,
    OTHER_SPLITS,
    make_layout,  # noqa: E402
    run,
    tensor_rel_diffs,
)


def compare(result: dict, ref: dict) -> tuple[float, float, float, float, str, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(result["loss"], ref["loss"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(result["grad_norm"], ref["grad_norm"]))
    p, q = result["params"], ref["params"]
    whole = (sum((p[n] - q[n]).pow(2).sum() for n in q) / sum(v.pow(2).sum() for v in q.values())).sqrt().item()
    tensors, key_biases = tensor_rel_diffs(result, ref)
    worst, name = max((d, n) for n, d in tensors.items())
    return loss, norm, whole, worst, name, max(key_biases.values())


def main() -> None:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tokens = load_tokens(CFG.data)
    ref = run(Layout(1, 1, 1, 8, 1), tokens)
    cases = [(d, "fsdp") for d in LAYOUTS] + [(d, "ddp") for d in LAYOUTS if d[0] > 1]
    cases += [(d, "fsdp") for d in OTHER_SPLITS]
    print(
        f"{'dp,tp,pp':>9} {'micro x n':>9} {'mode':>5} {'loss':>9} {'grad norm':>9} {'params':>9} "
        f"{'worst tensor':>12} {'key bias':>9}  (max relative differences against 1,1,1 over {CFG.steps} steps)"
    )
    for (dp, tp, pp, micro), mode in cases:
        layout = make_layout(dp, tp, pp, micro, mode)
        loss, norm, whole, worst, name, key = compare(run(layout, tokens), ref)
        print(
            f"{dp},{tp},{pp}".rjust(9),
            f"{micro} x {layout.num_microbatches}".rjust(9),
            mode.rjust(5),
            f"{loss:9.1e} {norm:9.1e} {whole:9.1e} {worst:12.1e} {key:9.1e}  {name}",
            flush=True,
        )


if __name__ == "__main__":
    main()
