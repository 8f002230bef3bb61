"""`elastic-trainer plan --explain`: the planner's predicted step time of a layout, term by term, and beside
it what a job measured when it ran the layout (`--run-dir`).

The rows add up to the step time the planner ranks the layout by (`plan/step_time.py`): the slowest pipeline
stage's time per micro-batch, split into its parts and counted once per micro-batch, the pipeline's fill and
drain (the other stages' time in the first and last micro-batch), what sharing a host's cores adds (CPU
profiles), the data-parallel communication that compute does not hide, and the optimizer step.

A step is timed by its phases (train/loop.py PHASES), not by the model's terms: communication runs inside
forward and backward. So the terms are summed into the phase they run in (`by_phase`) and each phase's sum is
set beside rank 0's median time in it over the steps of every start that ran the layout (plan/measured.py).
"""

from __future__ import annotations

from elastic_trainer.plan.candidates import Candidate, Request, evaluate
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.traffic import accumulation_bytes, wrapper_bytes


def terms(req: Request, layout: Layout) -> list[tuple[str, float]]:
    """[(term, seconds per step)] of `layout` under `req`; they sum to its predicted step time."""
    t = evaluate(req, layout).time  # the planner's own figure for the layout
    a = layout.num_microbatches
    slowest = max(t.stages, key=lambda s: s.total)
    passes = "forward + backward" + (" + recomputed forward" if layout.recompute else "")
    scheduled = req.hardware.shared_host and layout.pp > 1 and layout.dp > 1  # step_time.scheduled_comm
    hw = req.hardware
    copies = hw.counts_copies and wrapper_bytes(layout, req.compute_dtype, hw.shared_host)[0]
    rest = (
        "output head and embedding gradient"
        + (", gradient accumulation" if accumulation_bytes(layout, req.compute_dtype) else "")
        + (f", {layout.dp_mode}'s copies around its collectives" if copies else "")
    )
    rows = [
        (f"transformer blocks ({passes}){', compiled' if req.compiled else ''}", a * slowest.blocks),
        (rest, a * (slowest.compute - slowest.blocks - slowest.host_wait - slowest.weights)),
        ("work per micro-batch and parameter of the stage", a * slowest.weights),
        ("the device waiting on the host issuing its kernels", a * slowest.host_wait),
        ("tensor-parallel all-reduces", a * slowest.tp_comm),
        ("pipeline sends between stages", a * slowest.p2p),
        ("pipeline fill and drain", sum(s.total for s in t.stages) - slowest.total),
        (
            "ranks sharing the host's cores" + (", each stage's reductions among them" if scheduled else ""),
            t.shared_cores,
        ),
        (
            f"data-parallel communication not hidden ({layout.dp_mode})"
            + (", tied embedding" if layout.pp > 1 else ""),
            t.dp_comm,
        ),
        ("optimizer step (clipping + AdamW)", t.optimizer),
        (
            f"{layout.dp_mode}'s copies around its collectives and measured excess, per step"
            if hw.shared_host
            else f"{layout.dp_mode}'s casts and copies around its collectives, per step",
            t.hooks,
        ),
    ]
    return rows


PHASE_ROWS = (
    (("forward_backward",), "forward + backward of every micro-batch, with their communication"),
    (("clip", "optimizer"), "tied embedding all-reduce, clipping, loss all-reduce, AdamW"),
    (("sync",), "zero1's all-gather and copy of the updated weights"),
    (("batch",), "reading the batch"),
)
"""The rows measured and predicted are compared in: the model counts clipping in its optimizer term, the step
times it apart from AdamW, so the two phases make one row."""


def by_phase(req: Request, layout: Layout) -> dict[str, float]:
    """The predicted terms summed into the step's phases (train/loop.py PHASES); the model has no term for
    reading the batch, and counts clipping in its optimizer term."""
    t = evaluate(req, layout).time
    return {
        "forward_backward": t.pipeline + t.dp_comm - t.tied - t.after_step + t.hooks,
        "clip": t.tied,
        "optimizer": t.optimizer,
        "sync": t.after_step,
        "batch": 0.0,
    }


def format_measured(req: Request, layout: Layout, phases: dict[str, float], starts: int) -> list[str]:
    """Lines setting each measured phase (rank 0's median) beside the terms predicted for it."""
    predicted = by_phase(req, layout)
    lines = [
        f"  measured by this job ({starts} start(s), rank 0's median step) beside the prediction:",
        f"    {'phase':66s}  {'measured':>9s}  {'predicted':>9s}  {'ratio':>6s}",
    ]
    for names, label in PHASE_ROWS:
        got, want = sum(phases.get(n, 0.0) for n in names), sum(predicted[n] for n in names)
        if got or want:
            ratio = f"{got / want:6.2f}" if want > 0 else "     -"
            lines.append(f"    {label:66s}  {got:8.4g}s  {want:8.4g}s  {ratio}")
    got, want = sum(phases.values()), sum(predicted.values())
    lines.append(f"    {'the whole step (the sum of the phases)':66s}  {got:8.4g}s  {want:8.4g}s  {got / want:6.2f}")
    return lines


def format_terms(req: Request, c: Candidate, measured: tuple[dict, int] = ({}, 0)) -> str:
    """The predicted terms of `c`; with `measured` (phases_for's answer), the job's measured phases beside."""
    rows = terms(req, c.layout)
    total = sum(s for _, s in rows)
    width = max(len(name) for name, _ in rows)
    lines = [
        f"explain dp{c.dp} tp{c.tp} pp{c.pp}, micro-batch {c.micro_batch} x {c.num_microbatches}, "
        f"{c.dp_mode}{', recompute' if c.recompute else ''}: {total:.4g} s per step predicted "
        f"({req.hardware.name})"
    ]
    lines += [f"  {name:{width}s}  {s:10.4g} s  {100 * s / total:5.1f} %" for name, s in rows if s > 0]
    if measured[1]:
        lines += format_measured(req, c.layout, *measured)
    elif req.measured:
        lines.append("  (predictions; this job recorded no phases of this layout on these hosts)")
    else:
        lines.append(
            "  (predictions; `--run-dir` sets what a job measured in this layout beside them: plan/measured.py)"
        )
    return "\n".join(lines)
