"""The job sequence on two forked ranks: stops and saves agreed by both."""

from __future__ import annotations

import os

from elastic_trainer.checkpoint import CheckpointConfig
from elastic_trainer.elastic.events import EventLog, read_jsonl
from elastic_trainer.elastic.stop import StopRequest
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import run_job
from elastic_trainer.train.job import _agree
from tests.unit.test_job_unit import CFG, CPU, MODEL, TOKENS, B


# Forked ranks first: a fork after this process ran gloo groups of its own can inherit their threads in a
# state the child cannot use (seen to hang under mutmut's fork server).
class _Clock:
    """A checkpointer's part that _agree reads: whether a save is due, and the interval setting."""

    def __init__(self, due: bool, interval: float):
        self._due = due
        self.cfg = CheckpointConfig(dir="unused", save_interval_s=interval)

    def due(self, step: int) -> bool:
        return self._due


def _on_two_ranks(rank, world, tmp):
    out = {}
    # rank 0's clock decides a time-based save; a step-based one is due on every rank alike
    for name, due, interval in [
        ("rank1_clock", rank == 1, 5.0),
        ("rank0_clock", rank == 0, 5.0),
        ("step_based", rank == 1, 0.0),
        ("none", False, 5.0),
    ]:
        out[name] = _agree(None, _Clock(due, interval), 7)
    stop = StopRequest(os.path.join(tmp, "STOP1"), signals=())
    if rank == 1:
        open(stop.stop_file, "w").close()
    out["stop"] = _agree(stop if rank == 1 else None, None, 1)
    out["coming"] = _agree(None, None, 1, coming=rank == 0)  # rank 0 saw the next world started
    events = EventLog(os.path.join(tmp, f"ev{rank}.jsonl"))
    layout = Layout(2, 1, 1, B // 2, 1)
    result = run_job(MODEL, CFG, layout, CPU, tokens=TOKENS, stop=stop if rank == 1 else None, events=events)
    events.close()
    out["job"] = (result.status, result.step)
    return out


def test_two_ranks_agree_on_stops_and_saves(tmp_path):
    results = run_ranks(_on_two_ranks, 2, str(tmp_path))
    for r in results:
        assert (r["rank1_clock"], r["rank0_clock"], r["step_based"], r["none"]) == (
            (False, False, False),
            (False, True, False),
            (False, True, False),
            (False, False, False),
        )
        assert r["stop"] == (True, False, False) and r["job"] == ("stopped", 1)
        assert r["coming"] == (False, False, True)
    reasons = [
        [e["reason"] for e in read_jsonl(tmp_path / f"ev{rank}.jsonl") if e["event"] == "stopping"] for rank in range(2)
    ]
    assert reasons == [["requested on another rank"], [f"stop file {tmp_path / 'STOP1'}"]]
