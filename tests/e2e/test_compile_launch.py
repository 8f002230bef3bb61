"""`--compile` through the launcher: a job compiled on 1 rank, re-planned onto 4 and back onto 1 (warm starts,
the state handed over in memory) stays on the eager single-process trajectory, and the compile cache in the
run folder lets the return to a layout seen before load every kernel instead of compiling it."""

from __future__ import annotations

import json
import subprocess

import pytest

from elastic_trainer.elastic.events import read_jsonl
from tests.e2e.test_launch import assert_on_trajectory, env, launch_argv

pytestmark = pytest.mark.slow


def test_a_compiled_job_reconfigures_on_the_trajectory_and_reuses_its_cache(tmp_path, data_cache, reference):
    run_dir = tmp_path / "compiled"
    # layouts pinned by the schedule: without them the third phase's plan uses what the first measured
    # (plan/measured.py) and may leave the first layout, whose cache this test is about. One rank first: each
    # rank of a new run folder compiles every graph itself (tests/distributed/test_compile.py has dp2 worlds)
    phases = tmp_path / "s.json"
    phases.write_text(
        json.dumps(
            [
                {"gpus": 1, "steps": 3, "layout": "1,1,1", "micro_batch": 2},
                {"gpus": 4, "steps": 3, "layout": "2,1,2", "micro_batch": 2},
                {"gpus": 1, "steps": 2, "layout": "1,1,1", "micro_batch": 2},
            ]
        )
    )
    argv = launch_argv(run_dir, "localhost slots=4\n", "--schedule", str(phases), cache=data_cache)
    proc = subprocess.run(
        [*argv, "--compile", "--dp-mode", "fsdp"], capture_output=True, text=True, env=env(), timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    kept = assert_on_trajectory(run_dir, reference, 8)  # compiled vs eager: 1e-5 (tests/distributed/test_compile.py)
    assert [r["world_size"] for r in kept] == [1] * 3 + [4] * 3 + [1] * 2
    firsts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "first_step_done"]
    assert len(firsts) == 3 and all(e["compile"]["graphs"] >= 1 for e in firsts)
    assert firsts[0]["compile"]["cache_misses"] > 0  # a new run folder: the first world compiles
    assert firsts[2]["layout"] == firsts[0]["layout"]
    assert firsts[2]["compile"]["cache_misses"] == 0 and firsts[2]["compile"]["cache_hits"] > 0
    assert any((run_dir / "compile-cache").iterdir())
    assert "[compile] rank 0's 4 blocks as 1 graph(s)" in proc.stdout
