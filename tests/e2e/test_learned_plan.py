"""The planner learns from the job (plan/measured.py) through the launcher: every start records its steady step
time in the run folder, and a later phase on hosts the job has run on before plans with it. The default model
on 4 -> 2 -> 4 ranks: the third phase's plan names the measurement of the first (not a prediction) for the
layout the first ran, and the job stays on the eager single-process trajectory."""

from __future__ import annotations

import subprocess

import pytest

from elastic_trainer.elastic.events import read_jsonl
from elastic_trainer.plan.layout import Layout
from tests.e2e.test_launch import assert_on_trajectory, env, launch_argv, schedule

pytestmark = pytest.mark.slow


def test_a_phase_on_hosts_seen_before_plans_with_what_the_job_measured_there(tmp_path, data_cache, reference):
    run_dir = tmp_path / "learned"
    argv = launch_argv(
        run_dir,
        "localhost slots=4\n",
        "--schedule",
        schedule(tmp_path / "s.json", (4, 4), (2, 6), (4, 4)),
        cache=data_cache,
    )
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert_on_trajectory(run_dir, reference, 14)
    records = read_jsonl(run_dir / "measured.jsonl")
    assert [r["hosts"] for r in records] == [[4], [2], [4]] and all(r["steps"] >= 3 for r in records)
    assert all(r["step_s"] > 0 and r["predicted_s"] > 0 and r["model"] == "gpt-tiny" for r in records)
    planned = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "planned"]
    assert [e["source"] for e in planned] == ["spec", "spec", "planned"]  # phase 2's hosts were new to the job
    assert planned[2]["reason"] == "with the step times and memory this job measured on these hosts"
    line = next(ln for ln in proc.stdout.splitlines() if "[plan]" in ln and "measured by this job" in ln)
    first = Layout(**records[0]["layout"])
    if Layout(**planned[2]["layout"]) == first:  # kept: its figure is phase 1's measurement, not a prediction
        assert f"measured {records[0]['step_s']:.3f} s/step by an earlier start" in line
        assert f"(measured {records[0]['kept_memory_gib']:.1f} GiB at the largest rank's peak, planned " in line
    else:  # left for a layout predicted faster than phase 1 measured
        assert records[0]["step_s"] > float(line.split(" s/step")[0].rsplit(" ", 1)[1])
