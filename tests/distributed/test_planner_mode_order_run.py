"""benchmarks/planner/mode_order.py on forked ranks: a small run writes every group with each mode's steps and
judged pairs."""

from __future__ import annotations

import json

from tests.unit.test_planner_mode_order import modes


def test_a_small_run_writes_every_group_with_each_mode_s_steps_and_its_judged_pairs(tmp_path):
    """gpt-tiny on 2 forked ranks, 6 cycles: the plan's groups at dp2 (every micro-batch), each mode's 6 steps,
    and every pair of the group judged; what noise decides (which mode is faster) is not checked."""
    out = tmp_path / "modes"
    result = modes.main(
        [
            "--model",
            "gpt-tiny",
            "--ranks",
            "2",
            "--seq-len",
            "32",
            "--cycles",
            "6",
            "--warmup",
            "1",
            "--degrees",
            "2,1,1",
            "--out",
            str(out),
        ]
    )
    assert result == json.loads((tmp_path / "modes.json").read_text())
    groups = result["groups"]
    assert groups and all(g["degrees"] == [2, 1, 1] for g in groups)
    for g in groups:
        assert set(g["steps_s"]) == set(g["predicted_s"]) and len(g["steps_s"]) >= 2
        assert all(len(s) == 6 and min(s) > 0 for s in g["steps_s"].values())
        assert len(g["pairs"]) == len(g["steps_s"]) * (len(g["steps_s"]) - 1) // 2
        assert all(p["p"] >= round(2 / 64, 4) and p["cycles"] == 6 for p in g["pairs"])
    assert result["summary"] == modes.counts(groups)
