"""`elastic-trainer plan --explain`: the planner's predicted step time of a layout, term by term.

The rows add up to the step time the planner ranks the layout by (`plan/step_time.py`): the slowest pipeline
stage's time per micro-batch, split into its parts and counted once per micro-batch, the pipeline's fill and
drain (the other stages' time in the first and last micro-batch), what sharing a host's cores adds (CPU
profiles), the data-parallel communication that compute does not hide, and the optimizer step.
"""

from __future__ import annotations

from elastic_trainer.plan.candidates import Candidate, Request
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.step_time import step_time


def terms(req: Request, layout: Layout) -> list[tuple[str, float]]:
    """[(term, seconds per step)] of `layout` under `req`; they sum to its predicted step time."""
    hw = req.hardware
    t = step_time(req.model, layout, req.seq_len, req.compute_dtype, hw, req.topology,
                  block_speedup=hw.compiled_speedup if req.compiled else 1.0)
    a = layout.num_microbatches
    slowest = max(t.stages, key=lambda s: s.total)
    passes = "forward + backward" + (" + recomputed forward" if layout.recompute else "")
    rest = "output head and embedding gradient" + (", zero1's gradient adds" if layout.dp_mode == "zero1" else "")
    rows = [(f"transformer blocks ({passes}){', compiled' if req.compiled else ''}", a * slowest.blocks),
            (rest, a * (slowest.compute - slowest.blocks)),
            ("tensor-parallel all-reduces", a * slowest.tp_comm),
            ("pipeline sends between stages", a * slowest.p2p),
            ("pipeline fill and drain", sum(s.total for s in t.stages) - slowest.total),
            ("ranks sharing the host's cores", t.shared_cores),
            (f"data-parallel communication not hidden ({layout.dp_mode})" + (", tied embedding" if layout.pp > 1
                                                                             else ""), t.dp_comm),
            ("optimizer step (clipping + AdamW)", t.optimizer)]
    return rows


def format_terms(req: Request, c: Candidate) -> str:
    rows = terms(req, c.layout)
    total = sum(s for _, s in rows)
    width = max(len(name) for name, _ in rows)
    lines = [f"explain dp{c.dp} tp{c.tp} pp{c.pp}, micro-batch {c.micro_batch} x {c.num_microbatches}, "
             f"{c.dp_mode}{', recompute' if c.recompute else ''}: {total:.4g} s per step predicted "
             f"({req.hardware.name})"]
    lines += [f"  {name:{width}s}  {s:10.4g} s  {100 * s / total:5.1f} %" for name, s in rows if s > 0]
    lines.append("  (predictions; a job's measured step times are in its metrics.jsonl, and the planner uses them "
                 "once it has them: plan/measured.py)")
    return "\n".join(lines)
