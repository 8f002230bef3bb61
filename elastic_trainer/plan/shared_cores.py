"""A pipeline schedule on ranks that share a host's cores (`shared_host` profiles: CPU processes).

On dedicated devices a pipeline step takes sum_i t_i + (a - 1) * max_i t_i (plan/step_time.py). When the ranks
share cores, a stage waiting for its neighbour leaves its core to the others, and stages that run at once slow
each other down. Neither the dedicated-device formula nor the host's whole work divided by its cores (the
bound used before) says how long the step takes when the stages are uneven: gpt3-small's last stage, with the
output head, is three times the others at pp=4, so most of the step is that stage running beside a few others.

`makespan` runs the schedule: each stage's ranks do their forwards and backwards in the order torch's
schedule gives them (`orders`), an operation starts when its input has arrived and the stage's previous one
has finished, and at every moment the cores are shared equally among the ranks running an operation, each
getting at most one core. A stage's own data-parallel collectives can be given as work too, before its first
forward (`head`: fsdp's all-gather) and after its last backward (`tail`: the gradient reduction), in
core-seconds (their time on idle ranks): they then share the cores with the other stages' compute, as they do
(gpt3-small on 8 ranks, dp2 x pp4, zero1: the first stage's reduction took 0.16 s at the end of the step, run
alone, the others' ran beside its backward; charged after the schedule with every rank in it, 0.97 s). The
rest of the communication is the caller's.
"""

from __future__ import annotations

import functools

Op = tuple[str, int]
"""("F" or "B", micro-batch index)."""


def orders(pp: int, a: int) -> list[list[Op]]:
    """Each stage's forwards and backwards in execution order: torch's Schedule1F1B when a >= pp (stage s
    first runs min(a, pp - s) forwards, then alternates backward and forward, then the remaining backwards),
    ScheduleGPipe (all forwards, then all backwards) otherwise, as parallel/pipeline.py chooses."""
    out = []
    for s in range(pp):
        if a < pp:
            out.append([("F", m) for m in range(a)] + [("B", m) for m in range(a)])
            continue
        forwards = min(a, pp - s)
        ops: list[Op] = [("F", m) for m in range(forwards)]
        for b in range(a):
            ops.append(("B", b))
            if forwards < a:
                ops.append(("F", forwards))
                forwards += 1
        out.append(ops)
    return out


@functools.lru_cache(maxsize=4096)
def makespan(
    per_mb: tuple[float, ...],
    a: int,
    copies: float,
    cores: float,
    forward_share: float = 1 / 3,
    head: tuple[float, ...] = (),
    tail: tuple[float, ...] = (),
) -> float:
    """Seconds for `a` micro-batches through stages taking `per_mb[s]` core-seconds each (forward
    `forward_share` of it, backward the rest), with `copies` ranks of every stage on the host (its dp x tp
    ranks, running the same schedule) sharing `cores`; stage s first does `head[s]` core-seconds of work and
    ends with `tail[s]` (none where not given)."""
    pp = len(per_mb)
    ops, nxt, done = orders(pp, a), [0] * pp, set()
    for s in range(pp):
        ops[s] = (
            ([("H", 0)] if s < len(head) and head[s] > 0 else [])
            + ops[s]
            + ([("T", 0)] if s < len(tail) and tail[s] > 0 else [])
        )
    work = {
        "F": lambda s: per_mb[s] * forward_share,
        "B": lambda s: per_mb[s] * (1 - forward_share),
        "H": lambda s: head[s],
        "T": lambda s: tail[s],
    }
    scale = max(max(per_mb), *head, *tail, 0.0) or 1.0
    running: dict[int, float] = {}  # stage -> core-seconds left of its current operation
    now = 0.0
    while True:
        for s in range(pp):
            if s not in running and nxt[s] < len(ops[s]) and _ready(ops[s][nxt[s]], s, pp, done):
                running[s] = work[ops[s][nxt[s]][0]](s)
        if not running:
            return now
        rate = min(1.0, cores / (len(running) * copies))  # each running rank's share of a core
        first = min(running.values())
        now += first / rate
        for s in list(running):
            running[s] -= first
            if running[s] <= 1e-12 * scale:
                kind, m = ops[s][nxt[s]]
                done.add((kind, s, m))
                nxt[s] += 1
                del running[s]


def _ready(op: Op, stage: int, pp: int, done: set) -> bool:
    """A forward needs the previous stage's forward of its micro-batch, a backward the next stage's backward."""
    kind, m = op
    if kind in ("H", "T"):  # the stage's own, after what it did before
        return True
    if kind == "F":
        return stage == 0 or ("F", stage - 1, m) in done
    return stage == pp - 1 or ("B", stage + 1, m) in done
