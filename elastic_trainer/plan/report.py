"""A Plan as people and programs read it: a table, a one-line summary, JSON."""

from __future__ import annotations

from elastic_trainer.plan.candidates import Candidate, Request, rank_peak_bytes
from elastic_trainer.plan.hardware import GIB
from elastic_trainer.plan.planner import Plan

COLUMNS = ("#", "dp", "tp", "pp", "micro", "accum", "mode", "recompute", "GiB/GPU", "step s", "tokens/s", "bubble")


def tokens_per_s(c: Candidate, req: Request) -> float:
    return req.tokens / c.step_time_s


def candidate_dict(c: Candidate, req: Request) -> dict:
    """JSON-ready fields of one candidate (valid or not)."""
    out = {
        "dp": c.dp,
        "tp": c.tp,
        "pp": c.pp,
        "micro_batch": c.micro_batch,
        "num_microbatches": c.num_microbatches,
        "dp_mode": c.dp_mode,
        "recompute": c.recompute,
    }
    if c.memory is not None:
        out.update(
            memory_gb=round(c.memory_gb, 3),
            step_time_s=round(c.step_time_s, 6),
            source=c.source,
            predicted_s=round(c.time.total, 6),
            tokens_per_s=round(tokens_per_s(c, req), 1),
            bubble=round(c.time.bubble, 4),
            breakdown={
                "state_gb": round(c.memory.state.total / GIB, 3),
                "activations_gb": round(c.memory.activations / GIB, 3),
                "pipeline_s": round(c.time.pipeline, 6),
                "dp_comm_s": round(c.time.dp_comm, 6),
                "optimizer_s": round(c.time.optimizer, 6),
                "hooks_s": round(c.time.hooks, 6),
            },
        )
        out["memory_source"] = c.memory_source
        if c.measured_memory_gib is not None:
            out["measured_memory_gib"] = round(c.measured_memory_gib, 3)
        elif c.memory_correction != 1.0:
            out["memory_correction"] = round(c.memory_correction, 4)
    if c.reason is not None:
        out["reason"] = c.reason
    return out


def plan_dict(plan: Plan, compare: Candidate | None = None) -> dict:
    req = plan.request
    out = {
        "model": req.model.name,
        "gpus": req.world_size,
        "gpus_per_host": req.gpus_per_host,
        "host_sizes": list(req.topology.sizes),
        "hardware": req.hardware.name,
        "dtype": req.compute_dtype,
        "global_batch": req.global_batch,
        "seq_len": req.seq_len,
        "chosen": candidate_dict(plan.chosen, req),
        "candidates": [candidate_dict(c, req) for c in plan.candidates],
        "rejected": [candidate_dict(c, req) for c in plan.rejected],
    }
    if compare is not None:
        out["compare"] = candidate_dict(compare, req)
    return out


def _row(rank: str, c: Candidate, req: Request) -> list[str]:
    return [
        rank,
        str(c.dp),
        str(c.tp),
        str(c.pp),
        str(c.micro_batch),
        str(c.num_microbatches),
        c.dp_mode,
        "yes" if c.recompute else "no",
        f"{c.memory_gb:.1f}",
        f"{c.step_time_s:.3f}",
        f"{tokens_per_s(c, req):,.0f}",
        f"{100 * c.time.bubble:.1f}%",
    ]


def format_table(plan: Plan, top: int = 10, compare: Candidate | None = None) -> str:
    """The best `top` candidates; with this job's measurements, a last column says where each step time came
    from (measured, corrected by its family's measurement, or predicted)."""
    req = plan.request
    shown = [(str(i + 1), c) for i, c in enumerate(plan.candidates[:top])]
    shown += [("cmp", compare)] if compare is not None else []
    rows = [_row(rank, c, req) + ([c.source] if req.measured else []) for rank, c in shown]
    columns = (*COLUMNS, "step s from") if req.measured else COLUMNS
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(columns)]
    lines = [
        f"{req.model.name} on {req.world_size} x {req.hardware.name} ({req.topology.describe()}, "
        f"{req.compute_dtype}), global batch {req.global_batch} x {req.seq_len} tokens: "
        f"{len(plan.candidates)} valid layouts, {len(plan.rejected)} rejected"
    ]
    lines.append("  ".join(h.rjust(w) for h, w in zip(columns, widths)))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    if compare is not None:
        ratio = compare.step_time_s / plan.chosen.step_time_s
        lines.append(
            f"compare {compare.dp},{compare.tp},{compare.pp}: {step_time_words(compare)}, "
            f"{ratio:.2f}x the chosen layout's {plan.chosen.step_time_s:.3f} s"
        )
    return "\n".join(lines)


def step_time_words(c: Candidate) -> str:
    """`predicted X s/step`, or where the figure came from when this job's measurements gave it."""
    if c.source == "measured":
        return f"measured {c.step_time_s:.3f} s/step by an earlier start (predicted {c.time.total:.3f})"
    if c.source == "corrected":
        return f"predicted {c.step_time_s:.3f} s/step (x{c.correction:.2f}, as its family measured)"
    return f"predicted {c.step_time_s:.3f} s/step"


def memory_words(c: Candidate, req: Request) -> str:
    """The memory model's peak per GPU, and the peak an earlier start of this job measured in the layout beside
    the plan's figure for the same thing (on CPU ranks the heap the largest keeps, with its base)."""
    words = f"{c.memory_gb:.1f} GiB/GPU"
    if c.measured_memory_gib is not None:
        planned = rank_peak_bytes(req, c) / GIB
        return words + f" (measured {c.measured_memory_gib:.1f} GiB at the largest rank's peak, planned {planned:.1f})"
    return words


def summary(plan: Plan) -> str:
    """One line for logs: the chosen layout and its predictions (or this job's measurement of it)."""
    c, req = plan.chosen, plan.request
    learned = sum(x.source == "measured" for x in plan.candidates)
    return (
        f"[plan] {req.world_size} x {req.hardware.name} ({req.topology.describe()}): "
        f"{c.layout.describe()}; {memory_words(c, req)}, {step_time_words(c)}, "
        f"{tokens_per_s(c, req):,.0f} tokens/s, bubble {100 * c.time.bubble:.1f}% "
        f"(best of {len(plan.candidates)} valid layouts" + (f"; {learned} measured by this job)" if learned else ")")
    )
