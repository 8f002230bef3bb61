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


@pytest.mark.parametrize("step, phase", [(0, 0), (1, 0), (7, 0), (8, 1), (15, 1), (16, 2), (23, 2), (24, 3),
                                         (31, 3), (32, None), (33, None), (1000, None)])
def test_phase_at_default(step, phase):
    """Step is the 0-based next step: step 7 is the last of phase 0, 32 is past the end."""
    assert phase_at(DEFAULT, step) == phase


def test_phase_at_uneven_phases():
    phases = [Phase(1, steps=3), Phase(2, steps=1), Phase(4, steps=5)]
    assert [phase_at(phases, s) for s in range(11)] == [0, 0, 0, 1, 2, 2, 2, 2, 2, None, None]


# ---------------------------------------------------------------- bad schedules

OK = {"gpus": 4, "steps": 8}
OK_T = {"gpus": 4, "duration_s": 60}


@pytest.mark.parametrize("data, message", [
    ([], "expected a non-empty list of phases"),
    ({"phases": []}, "expected a non-empty list of phases"),
    ({"comment": "no phases"}, "expected a non-empty list of phases"),
    ({"phases": {"gpus": 4, "steps": 8}}, "expected a non-empty list of phases"),
    (5, "expected a non-empty list of phases"),
    ("4 gpus", "expected a non-empty list of phases"),
    ([OK, 4], "phase 2 must be an object"),
    ([OK, OK, ["gpus", 4]], "phase 3 must be an object"),
    ([OK, {"steps": 8}], 'phase 2 needs "gpus" and exactly one of "steps" or "duration_s"'),
    ([{"gpus": 4, "steps": 8, "duration_s": 10}],
     'phase 1 needs "gpus" and exactly one of "steps" or "duration_s"'),
    ([OK, OK, {"gpus": 4}], 'phase 3 needs "gpus" and exactly one of "steps" or "duration_s"'),
    ([OK, {"gpus": 0, "steps": 8}], "phase 2: gpus=0 must be a positive integer"),
    ([{"gpus": -1, "steps": 8}], "phase 1: gpus=-1 must be a positive integer"),
    ([{"gpus": 2.5, "steps": 8}], "phase 1: gpus=2.5 must be a positive integer"),
    ([{"gpus": True, "steps": 8}], "phase 1: gpus=True must be a positive integer"),
    ([{"gpus": "4", "steps": 8}], "phase 1: gpus='4' must be a positive integer"),
    ([OK, {"gpus": 4, "steps": 0}], "phase 2: steps=0 must be a positive integer"),
    ([{"gpus": 4, "steps": 2.0}], "phase 1: steps=2.0 must be a positive integer"),
    ([OK_T, {"gpus": 4, "duration_s": 0}], "phase 2: duration_s=0 must be a positive number of seconds"),
    ([{"gpus": 4, "duration_s": -3}], "phase 1: duration_s=-3 must be a positive number of seconds"),
    ([{"gpus": 4, "duration_s": math.nan}], "phase 1: duration_s=nan must be a positive number of seconds"),
    ([{"gpus": 4, "duration_s": math.inf}], "phase 1: duration_s=inf must be a positive number of seconds"),
    ([{"gpus": 4, "duration_s": "10"}], "phase 1: duration_s='10' must be a positive number of seconds"),
    ([{"gpus": 4, "duration_s": True}], "phase 1: duration_s=True must be a positive number of seconds"),
    ([OK, {"gpus": 4, "step": 8}], "phase 2: unknown key(s) 'step' (valid: gpus, steps, duration_s)"),
    ({"phases": [OK], "phase": []}, "unknown key(s) 'phase' (valid: phases, comment)"),
    ([OK, OK_T], 'phases mix "steps" and "duration_s"; use one kind'),
    ([OK_T, OK_T, OK], 'phases mix "steps" and "duration_s"; use one kind'),
])
def test_bad_schedule_file_is_one_line_config_error(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as error:
        load_schedule(str(path))
    assert f"{path}: {message}" in assert_one_line(error)


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
    with pytest.raises(ConfigError, match=r"schedule 'no-such-preset' does not exist \(a JSON file, or one of: .*"
                                          r"\bdefault\b") as error:
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
