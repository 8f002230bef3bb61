"""Run reports: the effective trajectory, the exactly-once check, segments, downtime stages, the table, the plot."""

from __future__ import annotations

from elastic_trainer.elastic.report import (
    downtime,
    effective,
    format_rows,
    parts,
    phase_rows,
    plot,
    samples_consumed_once,
    segments,
)

L4 = {"dp": 2, "tp": 1, "pp": 2, "micro_batch": 4, "num_microbatches": 1, "dp_mode": "ddp", "recompute": False}
L8 = {"dp": 4, "tp": 1, "pp": 2, "micro_batch": 2, "num_microbatches": 1, "dp_mode": "fsdp", "recompute": True}
BATCH = 8


def rec(step, time, step_time=2.0, phase=0, restart=0, world=4, layout=L4, attempt="first"):
    """One metrics record; step s consumed samples [(s - 1) * 8, s * 8); loss 10 - s / 10."""
    return {
        "step": step,
        "loss": 10.0 - step / 10,
        "step_time_s": step_time,
        "time": time,
        "samples": [(step - 1) * BATCH, step * BATCH],
        "world_size": world,
        "layout": layout,
        "phase": phase,
        "restart": restart,
        "attempt": attempt,
    }


def ev(event, time, phase, **fields):
    return {"event": event, "time": time, "phase": phase, **fields}


# ---------------------------------------------------------------- effective


def test_effective_without_restart_is_unchanged():
    records = [rec(s, 1000 + 2 * s) for s in range(1, 7)]
    kept = effective(records)
    assert kept == records and all(a is b for a, b in zip(kept, records))


def test_effective_later_records_replace_redone_steps():
    first = [rec(s, 1000 + 2 * s) for s in range(1, 7)]
    redo = [rec(s, 1100 + 2 * s, restart=1, attempt="redo") for s in (5, 6, 7)]
    kept = effective(first + redo)
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["attempt"] for r in kept] == ["first"] * 4 + ["redo"] * 3
    assert kept[4] is redo[0] and kept[5] is redo[1] and kept[3] is first[3]


def test_effective_rollback_of_several_steps_drops_the_rolled_back_tail():
    first = [rec(s, 1000 + 2 * s) for s in range(1, 11)]
    redo = [rec(s, 1100 + 2 * s, attempt="redo") for s in (3, 4, 5)]
    kept = effective(first + redo)
    assert [(r["step"], r["attempt"]) for r in kept] == [
        (1, "first"),
        (2, "first"),
        (3, "redo"),
        (4, "redo"),
        (5, "redo"),
    ]


def test_effective_two_restarts():
    records = (
        [rec(s, 1000 + s) for s in range(1, 7)]
        + [rec(s, 1100 + s, attempt="second") for s in (5, 6, 7, 8)]
        + [rec(s, 1200 + s, attempt="third") for s in (7, 8, 9)]
    )
    kept = effective(records)
    assert [(r["step"], r["attempt"][0]) for r in kept] == [
        (1, "f"),
        (2, "f"),
        (3, "f"),
        (4, "f"),
        (5, "s"),
        (6, "s"),
        (7, "t"),
        (8, "t"),
        (9, "t"),
    ]


# ---------------------------------------------------------------- samples consumed once


def test_contiguous_samples_are_consumed_once():
    assert samples_consumed_once([{"samples": [0, 8]}, {"samples": [8, 16]}])


def test_a_gap_is_not_consumed_once():
    assert not samples_consumed_once([{"samples": [0, 8]}, {"samples": [16, 24]}])


def test_an_overlap_is_not_consumed_once():
    assert not samples_consumed_once([{"samples": [0, 8]}, {"samples": [4, 12]}])
    assert not samples_consumed_once([{"samples": [0, 8]}, {"samples": [8, 16]}, {"samples": [8, 16]}])


def test_effective_records_after_a_rollback_are_consumed_once():
    records = [rec(s, 1000 + s) for s in range(1, 7)] + [rec(s, 1100 + s) for s in (4, 5, 6, 7)]
    assert not samples_consumed_once(records)  # raw: steps 4..6 twice
    assert samples_consumed_once(effective(records))


# ---------------------------------------------------------------- a run: phase 0 (4 ranks), phase 1 (8 ranks) twice

# phase 0: steps 1..4, 2 s each, ending at 1002, 1004, 1006, 1008 (started at 1000)
PHASE0 = [rec(s, 1000 + 2 * s) for s in range(1, 5)]
# phase 1, restart 0: steps 5..8, ending 1030 (first step 3 s: started at 1027), 1032, 1034, 1036; a rank dies after 8
PHASE1 = [rec(5, 1030, 3.0, phase=1, world=8, layout=L8)] + [
    rec(s, 1032 + 2 * (s - 6), phase=1, world=8, layout=L8) for s in (6, 7, 8)
]
# phase 1, restart 1: resumes from the step-6 checkpoint, redoes 7 and 8, goes on to 10; step 7 ends at 1053 (3.5 s)
RESTART = [rec(7, 1053, 3.5, phase=1, restart=1, world=8, layout=L8, attempt="redo")] + [
    rec(s, 1055 + 2 * (s - 8), phase=1, restart=1, world=8, layout=L8, attempt="redo") for s in (8, 9, 10)
]
RECORDS = PHASE0 + PHASE1 + RESTART
EVENTS = [
    ev("stopping", 1008.5, 0, step=4),
    ev("saved", 1011.0, 0),
    ev("exited", 1013.0, 0),
    ev("launched", 1014.0, 1),
    ev("processes_up", 1020.0, 1),
    ev("planned", 1022.0, 1),
    ev("state_loaded", 1025.0, 1, load={"total_s": 2.5}),
    ev("first_step_done", 1030.0, 1),
    # the restart: no stop, save, exit or launch; torchrun restarts the workers
    ev("processes_up", 1045.0, 1, restart=1),
    ev("planned", 1046.0, 1, restart=1),
    ev("state_loaded", 1049.0, 1, restart=1, load={"total_s": 1.25}),
    ev("first_step_done", 1053.0, 1, restart=1),
    # the final stop, after the last step: belongs to no gap
    ev("stopping", 1059.5, 1, restart=1),
    ev("saved", 1061.0, 1, restart=1),
    ev("exited", 1062.0, 1),
]


def test_segments_split_on_phase_and_restart():
    segs = segments(RECORDS)
    assert [(s.phase, s.restart, s.world_size, s.layout) for s in segs] == [(0, 0, 4, L4), (1, 0, 8, L8), (1, 1, 8, L8)]
    assert [[r["step"] for r in s.records] for s in segs] == [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    assert all(r["attempt"] == "redo" for r in segs[2].records)
    # the failed start trained steps 7 and 8 too (redone after the restart): its training ended at 1036
    assert [(s.start, s.end) for s in segs] == [(1000.0, 1008.0), (1027.0, 1036.0), (1049.5, 1059.0)]


def test_downtime_of_a_phase_change_and_its_stages():
    segs = segments(RECORDS)
    gap = downtime(segs[0], segs[1], EVENTS)
    assert gap == {
        "downtime_s": 19.0,
        "warm": False,  # 1027 (1030 - 3) - 1008
        "save_s": 3.0,
        "exit_s": 2.0,
        "relaunch_s": 1.0,
        "detect_s": None,
        "rendezvous_s": None,
        "start_s": 6.0,
        "setup_s": 5.0,
        "load_s": 2.5,
        "first_step_s": 3.0,
        "source": "disk",
    }


def test_downtime_of_a_warm_hand_over_and_its_parts():
    """The next world was started beside the old one: the old world writes its state into memory (save), the
    next one, not ready yet, finishes its start (wait), reads the state (hand-over) and sets up; its launch,
    rendezvous and process group came before the gap and are not downtime."""
    before = [
        {
            "step": 1,
            "time": 100.0,
            "step_time_s": 1.0,
            "loss": 9.0,
            "phase": 0,
            "restart": 0,
            "world_size": 4,
            "layout": L4,
            "samples": [0, 8],
        }
    ]
    after = [
        {
            "step": 2,
            "time": 104.0,
            "step_time_s": 0.5,
            "loss": 8.9,
            "phase": 1,
            "restart": 0,
            "world_size": 8,
            "layout": L8,
            "samples": [8, 16],
        }
    ]
    events = [
        {"event": "launched", "time": 90.0, "phase": 1, "warm": True},
        {"event": "processes_up", "time": 95.0, "phase": 1},
        {"event": "stopping", "time": 100.0, "phase": 0},
        {"event": "saved", "time": 100.5, "phase": 0},
        {"event": "next_world_ready", "time": 101.5, "phase": 1},
        {"event": "handover_done", "time": 103.0, "phase": 1, "handover": {"total_s": 1.25, "bytes_fetched": 0}},
        {"event": "state_loaded", "time": 103.25, "phase": 1},
    ]
    segs = segments(before + after)
    gap = downtime(segs[0], segs[1], events)
    assert gap["warm"] and gap["downtime_s"] == 3.5  # 103.5 (104 - 0.5) - 100
    assert (gap["save_s"], gap["wait_s"], gap["handover_s"], gap["setup_s"]) == (0.5, 1.0, 1.5, 0.25)
    assert gap["load_s"] == 1.25 and gap["handover"]["bytes_fetched"] == 0
    assert parts(gap) == "memory: save 0.50 + wait 1.00 + hand-over 1.50 + setup 0.25"


def test_downtime_of_a_restart_within_a_phase():
    """No saved/exited/launched events: those stages are None; the gap starts when the last step before it
    ended (step 8, redone after the restart), so the lost steps are not downtime but `redone`."""
    segs = segments(RECORDS)
    gap = downtime(segs[1], segs[2], EVENTS)
    assert gap == {
        "downtime_s": 13.5,
        "warm": False,  # 1049.5 (1053 - 3.5) - 1036
        "save_s": None,
        "exit_s": None,
        "relaunch_s": None,
        "detect_s": None,
        "rendezvous_s": None,
        "start_s": 9.0,
        "setup_s": 4.0,
        "load_s": 1.25,
        "first_step_s": 3.5,
        "source": "disk",
    }


def test_downtime_of_a_failure_recorded_by_the_agents():
    """The surviving agents' events split the restart's start: detection, their rendezvous, the workers' start."""
    agents = [
        ev("workers_restarting", 1038.0, 1, writer="agent"),
        ev("workers_restarting", 1038.5, 1, writer="agent"),
        ev("rendezvous_done", 1041.0, 1, writer="agent"),
        ev("rendezvous_done", 1041.2, 1, writer="agent"),
    ]
    segs = segments(RECORDS)
    gap = downtime(segs[1], segs[2], sorted(EVENTS + agents, key=lambda e: e["time"]))
    assert (gap["detect_s"], gap["rendezvous_s"], gap["start_s"], gap["setup_s"]) == (2.0, 3.0, 4.0, 4.0)
    assert gap["downtime_s"] == 13.5 and gap["save_s"] is None


def test_a_restart_that_reads_a_snapshot_in_memory_is_a_restart_from_memory():
    """A loss's restart that loads a snapshot (its `handover_done` event) keeps the restart's stages and says
    where the state came from; it is not taken for a warm start."""
    agents = [
        ev("workers_restarting", 1038.0, 1, writer="agent"),
        ev("rendezvous_done", 1041.0, 1, writer="agent"),
        ev("handover_done", 1048.0, 1, handover={"total_s": 0.4}),
    ]
    segs = segments(RECORDS)
    gap = downtime(segs[1], segs[2], sorted(EVENTS + agents, key=lambda e: e["time"]))
    assert gap["warm"] is False and gap["source"] == "memory"
    assert (gap["detect_s"], gap["rendezvous_s"], gap["start_s"], gap["setup_s"]) == (2.0, 3.0, 4.0, 4.0)
    assert parts(gap) == "restart: detect 2.00 + rendezvous 3.00 + start 4.00 + setup 4.00, from memory"


def test_downtime_without_events_has_no_stages():
    segs = segments(RECORDS)
    gap = downtime(segs[0], segs[1], [])
    assert gap["downtime_s"] == 19.0 and gap["first_step_s"] == 3.0 and "load_s" not in gap
    assert [gap[k] for k in ("save_s", "exit_s", "relaunch_s", "detect_s", "rendezvous_s", "start_s", "setup_s")] == [
        None
    ] * 7


def test_phase_rows_one_per_segment():
    rows = phase_rows(RECORDS, EVENTS)
    assert [(r["phase"], r["restart"], r["ranks"], r["layout"], r["steps"], r["loss"]) for r in rows] == [
        (0, 0, 4, "dp2 tp1 pp2, 4x1 ddp", (1, 4), 9.6),
        (1, 0, 8, "dp4 tp1 pp2, 2x1 fsdp+rc", (5, 6), 9.4),
        (1, 1, 8, "dp4 tp1 pp2, 2x1 fsdp+rc", (7, 10), 9.0),
    ]
    assert rows[0]["downtime"] is None
    assert (rows[1]["downtime"]["downtime_s"], rows[2]["downtime"]["downtime_s"]) == (19.0, 13.5)


def test_format_rows_table():
    lines = format_rows(phase_rows(RECORDS, EVENTS)).splitlines()
    assert len(lines) == 4
    assert lines[0].split("  ")[0] == "phase" and "downtime s" in lines[0] and "of which load s" in lines[0]
    cells = [[c.strip() for c in line.split("  ") if c.strip()] for line in lines[1:]]
    assert cells == [
        ["1", "4", "dp2 tp1 pp2, 4x1 ddp", "1-4", "9.6000", "-", "-", "-", "-"],
        [
            "2",
            "8",
            "dp4 tp1 pp2, 2x1 fsdp+rc",
            "5-6",
            "9.4000",
            "19.0",
            "2.50",
            "0",
            "restart: save 3.00 + exit 2.00 + relaunch 1.00 + start 6.00 + setup 5.00, from disk",
        ],
        [
            "2 (restart 1)",
            "8",
            "dp4 tp1 pp2, 2x1 fsdp+rc",
            "7-10",
            "9.0000",
            "13.5",
            "1.25",
            "2",
            "restart: start 9.00 + setup 4.00, from disk",
        ],
    ]
    column = lines[0].index("downtime s")
    assert lines[2][column:].startswith("19.0") and lines[3][column:].startswith("13.5")


def test_segments_count_the_steps_a_restart_trained_again():
    assert [s.redone for s in segments(RECORDS)] == [0, 0, 2]  # steps 7 and 8 were trained before the restart


# A job killed whole after step 7 (checkpoint at 6) and resumed by a new launch: the same phase, restart count
# and layout, told apart only by the id rank 0 gave each start.
CRASHED = [{**rec(s, 1000 + 2 * s), "start": "aaaa"} for s in range(1, 8)]
RESUMED = [{**rec(s, 1100 + 2 * s), "start": "bbbb"} for s in range(7, 11)]


def test_a_crash_and_resume_is_a_segment_of_its_own():
    rows = phase_rows(CRASHED + RESUMED, [ev("launched", 1105.0, 0)])
    assert [(r["steps"], r["resumed"], r["redone"]) for r in rows] == [((1, 6), False, 0), ((7, 10), True, 1)]
    assert rows[1]["downtime"]["downtime_s"] == 1114 - 2 - 1014  # from the lost step 7's end to its redo's start
    cells = [line.split("  ")[0].strip() for line in format_rows(rows).splitlines()[1:]]
    assert cells == ["1", "1 (resumed)"]
    assert len(phase_rows([{k: v for k, v in r.items() if k != "start"} for r in CRASHED + RESUMED], [])) == 1


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "loss.png"
    assert plot(RECORDS, str(path), "test run") == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_the_plot_marks_restarts_after_failures(tmp_path, monkeypatch):
    """A planned phase change is shaded grey; a torchrun restart and a resumed crash are shaded red and marked
    on the step axis with the steps they trained twice."""
    import matplotlib.axes

    notes = []
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", lambda self, text, *a, **k: notes.append(text))
    plot(RECORDS, str(tmp_path / "a.png"))
    assert notes == ["restart, 2 redone"]  # phase 0 -> 1 is planned; the restart in phase 1 redid 7 and 8
    notes.clear()
    plot(CRASHED + RESUMED, str(tmp_path / "b.png"))
    assert notes == ["restart, 1 redone"]


def with_val(r: dict, val_loss: float, eval_time: float) -> dict:
    """A record whose step was followed by an evaluation: its time is the evaluation's end."""
    return {**r, "val_loss": val_loss, "val_samples": 16, "eval_time_s": eval_time, "time": r["time"] + eval_time}


def test_an_evaluation_is_the_segment_s_time_not_downtime():
    """An evaluation after a segment's last step ends before the gap; one after its first step is inside it."""
    records = [with_val(r, 9.0, 1.5) if r["step"] in (4, 5) else r for r in PHASE0 + PHASE1]
    segs = segments(records)
    plain = segments(PHASE0 + PHASE1)
    assert segs[0].end == plain[0].end + 1.5 and segs[1].start == plain[1].start
    assert downtime(segs[0], segs[1], [])["downtime_s"] == downtime(plain[0], plain[1], [])["downtime_s"] - 1.5


def test_the_plot_marks_the_validation_losses(tmp_path, monkeypatch):
    import matplotlib.axes

    lines = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda self, *a, **k: lines.append((a, k)) or original(self, *a, **k)
    )
    records = [with_val(r, 9.5 - r["step"] / 10, 0.5) if r["step"] % 3 == 0 else r for r in RECORDS]
    plot(records, str(tmp_path / "a.png"))
    assert {a[2] for a, k in lines if k.get("label") == "validation"} == {"o"}  # markers, not a line
    marked = [(list(a[0]), list(a[1])) for a, k in lines if k.get("label") == "validation" and len(a[0])]
    by_step = [m for m in marked if all(isinstance(x, int) for x in m[0])]
    assert [x for m in by_step for x in m[0]] == [3, 6, 9]
    assert [y for m in by_step for y in m[1]] == [9.2, 8.9, 8.6]
    assert len(marked) == 2 * len(by_step)  # against step and against time
    lines.clear()
    plot(RECORDS, str(tmp_path / "b.png"))
    assert not any(len(a[0]) for a, k in lines if k.get("label") == "validation")
