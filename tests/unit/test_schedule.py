"""Schedule files: the shipped preset, both JSON forms, phase boundaries, and one-line errors for bad files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.schedule import Phase, load_schedule, parse_schedule, phase_at, step_ends

PRESET_FILE = Path(__file__).resolve().parents[2] / "configs" / "schedules" / "default.json"
DEFAULT = [Phase(4, steps=8), Phase(8, steps=8), Phase(2, steps=8), Phase(4, steps=8)]


def assert_one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "\r" not in message, message
    return message


# ---------------------------------------------------------------- well-formed schedules


def test_default_preset_loads_by_name():
    assert load_schedule("default") == DEFAULT


def test_default_preset_loads_by_path():
    assert load_schedule(str(PRESET_FILE)) == DEFAULT


def test_list_form_and_object_form_parse_alike():
    phases = [{"gpus": 2, "steps": 3}, {"gpus": 6, "steps": 1}]
    expected = [Phase(2, steps=3), Phase(6, steps=1)]
    assert parse_schedule(phases) == expected
    assert parse_schedule({"phases": phases, "comment": "anything"}) == expected


def test_duration_phases_become_float_seconds():
    phases = parse_schedule([{"gpus": 4, "duration_s": 30}, {"gpus": 8, "duration_s": 1.5}])
    assert phases == [Phase(4, duration_s=30.0), Phase(8, duration_s=1.5)]
    assert type(phases[0].duration_s) is float and phases[0].steps is None


def test_file_without_suffix_is_read_as_a_file(tmp_path):
    path = tmp_path / "myschedule"
    path.write_text('[{"gpus": 3, "steps": 5}]')
    assert load_schedule(str(path)) == [Phase(3, steps=5)]


def test_step_ends_are_cumulative():
    assert step_ends(DEFAULT) == [8, 16, 24, 32]
    assert step_ends([Phase(1, steps=3), Phase(2, steps=1), Phase(4, steps=5)]) == [3, 4, 9]


@pytest.mark.parametrize(
    "step, phase",
    [(0, 0), (1, 0), (7, 0), (8, 1), (15, 1), (16, 2), (23, 2), (24, 3), (31, 3), (32, None), (33, None), (1000, None)],
)
def test_phase_at_default(step, phase):
    """Step is the 0-based next step: step 7 is the last of phase 0, 32 is past the end."""
    assert phase_at(DEFAULT, step) == phase


def test_phase_at_uneven_phases():
    phases = [Phase(1, steps=3), Phase(2, steps=1), Phase(4, steps=5)]
    assert [phase_at(phases, s) for s in range(11)] == [0, 0, 0, 1, 2, 2, 2, 2, 2, None, None]


# ---------------------------------------------------------------- bad schedules

OK = {"gpus": 4, "steps": 8}
OK_T = {"gpus": 4, "duration_s": 60}


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "expected a non-empty list of phases"),
        ({"phases": []}, "expected a non-empty list of phases"),
        ({"comment": "no phases"}, "expected a non-empty list of phases"),
        ({"phases": {"gpus": 4, "steps": 8}}, "expected a non-empty list of phases"),
        (5, "expected a non-empty list of phases"),
        ("4 gpus", "expected a non-empty list of phases"),
        ([OK, 4], "phase 2 must be an object"),
        ([OK, OK, ["gpus", 4]], "phase 3 must be an object"),
        ([OK, {"steps": 8}], 'phase 2 needs "gpus" and exactly one of "steps" or "duration_s"'),
        (
            [{"gpus": 4, "steps": 8, "duration_s": 10}],
            'phase 1 needs "gpus" and exactly one of "steps" or "duration_s"',
        ),
        ([OK, OK, {"gpus": 4}], 'phase 3 needs "gpus" and exactly one of "steps" or "duration_s"'),
        (
            [OK, {"gpus": 0, "steps": 8}],
            "phase 2: a steps phase of 0 GPUs (the job stops and starts again) has steps=0",
        ),
        (
            [OK, {"gpus": 4, "steps": 0}],
            "phase 2: a steps phase of 0 GPUs (the job stops and starts again) has steps=0",
        ),
        ([{"gpus": -1, "steps": 8}], "phase 1: gpus=-1 must be a non-negative integer"),
        ([{"gpus": 2.5, "steps": 8}], "phase 1: gpus=2.5 must be a non-negative integer"),
        ([{"gpus": True, "steps": 8}], "phase 1: gpus=True must be a non-negative integer"),
        ([{"gpus": "4", "steps": 8}], "phase 1: gpus='4' must be a non-negative integer"),
        ([{"gpus": 4, "steps": 2.0}], "phase 1: steps=2.0 must be a non-negative integer"),
        ([OK_T, {"gpus": 4, "duration_s": 0}], "phase 2: duration_s=0 must be a positive number of seconds"),
        ([{"gpus": 4, "duration_s": -3}], "phase 1: duration_s=-3 must be a positive number of seconds"),
        ([{"gpus": 4, "duration_s": math.nan}], "phase 1: duration_s=nan must be a positive number of seconds"),
        ([{"gpus": 4, "duration_s": math.inf}], "phase 1: duration_s=inf must be a positive number of seconds"),
        ([{"gpus": 4, "duration_s": "10"}], "phase 1: duration_s='10' must be a positive number of seconds"),
        ([{"gpus": 4, "duration_s": True}], "phase 1: duration_s=True must be a positive number of seconds"),
        (
            [OK, {"gpus": 4, "step": 8}],
            "phase 2: unknown key(s) 'step' (valid: gpus, steps, duration_s, layout, micro_batch)",
        ),
        ({"phases": [OK], "phase": []}, "unknown key(s) 'phase' (valid: phases, comment)"),
        ([OK, OK_T], 'phases mix "steps" and "duration_s"; use one kind'),
        ([{"gpus": 8, "steps": 2, "layout": "2,2,4"}], "phase 1: layout 2,2,4 has 16 GPUs, the phase 8"),
        ([{"gpus": 8, "steps": 2, "layout": "2,x,4"}], "phase 1: layout '2,x,4' must be three positive integers"),
        ([{"gpus": 8, "steps": 2, "layout": [1, 2, 4]}], 'phase 1: layout=[1, 2, 4] must be a string "DP,TP,PP"'),
        ([{"gpus": 8, "steps": 2, "micro_batch": 2}], "phase 1: micro_batch needs a layout in the same phase"),
        ([{"gpus": 8, "steps": 2, "layout": "8,1,1", "micro_batch": 0}], "phase 1: micro_batch=0 must be a positive"),
        ([OK_T, {"gpus": 0, "duration_s": 5, "layout": "1,1,1"}], "phase 2: a phase of 0 GPUs (the job waits) has no"),
        ([{"gpus": 0, "duration_s": 5}], "every phase has 0 GPUs; nothing would train"),
        ([OK_T, {"gpus": -1, "duration_s": 5}], "phase 2: gpus=-1 must be a non-negative integer"),
        ([OK_T, OK_T, OK], 'phases mix "steps" and "duration_s"; use one kind'),
    ],
)
def test_bad_schedule_file_is_one_line_config_error(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as error:
        load_schedule(str(path))
    assert f"{path}: {message}" in assert_one_line(error)


def test_pinned_layouts_waits_and_runs_round_trip(tmp_path):
    from elastic_trainer.elastic.schedule import dump_schedule, run_end, same_run

    data = [
        {"gpus": 16, "duration_s": 60, "layout": "2,2,4"},
        {"gpus": 0, "duration_s": 30},
        {"gpus": 8, "duration_s": 60, "layout": "1,2,4", "micro_batch": 4},
        {"gpus": 8, "duration_s": 60, "layout": "1,2,4", "micro_batch": 4},
        {"gpus": 8, "duration_s": 10},
    ]
    phases = parse_schedule(data)
    assert phases[0] == Phase(16, duration_s=60.0, layout=(2, 2, 4))
    assert phases[1].waits and not phases[0].waits
    assert phases[2].micro_batch == 4
    assert [run_end(phases, i) for i in range(5)] == [0, 1, 3, 3, 4]  # same GPUs and pinned layout: one run
    assert not same_run(phases[1], phases[1])  # waiting is never a run
    path = tmp_path / "s.json"
    path.write_text(dump_schedule(phases, "round trip"))
    assert load_schedule(str(path)) == phases


@pytest.mark.parametrize("data", [[{"gpus": 4, "steps": 8, "no\nte": 1}], {"phases": [OK], "x\ny": 1}])
def test_unknown_key_with_newline_still_gives_one_line(data):
    with pytest.raises(ConfigError) as error:
        parse_schedule(data)
    assert_one_line(error)


def test_missing_file_lists_the_presets(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError) as error:
        load_schedule(missing)
    message = assert_one_line(error)
    assert f"schedule {missing!r} does not exist (a JSON file, or one of: " in message
    assert "default" in message.split("one of: ", 1)[1].rstrip(")").split(", ")


def test_unknown_preset_name_lists_the_presets():
    with pytest.raises(
        ConfigError,
        match=r"schedule 'no-such-preset' does not exist \(a JSON file, or one of: .*"
        r"\bdefault\b",
    ) as error:
        load_schedule("no-such-preset")
    assert_one_line(error)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"gpus": 4, "steps": 8},\n  {"gpus": 4 "steps": 8}\n]\n')
    with pytest.raises(ConfigError) as error:
        load_schedule(str(path))
    message = assert_one_line(error)
    assert message.startswith(f"schedule {str(path)!r} is not valid JSON: ") and message.endswith("(line 3)")


def test_folder_cannot_be_read(tmp_path):
    folder = tmp_path / "schedules.json"
    folder.mkdir()
    with pytest.raises(ConfigError) as error:
        load_schedule(str(folder))
    assert f"schedule {str(folder)!r} cannot be read: " in assert_one_line(error)


def test_non_utf8_file_cannot_be_read(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"gpus": 4, "steps": 8, "comment": "caf\xe9"}]')
    with pytest.raises(ConfigError) as error:
        load_schedule(str(path))
    assert f"schedule {str(path)!r} cannot be read: " in assert_one_line(error)
