"""scripts/mutmut_plugin.py keeps the tests that fail in mutmut's stats and clean runs, whose output mutmut
throws away (it says only "failed to collect stats. runner returned 1"), and records a mutant's timeouts."""

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mutmut_plugin_under_test", ROOT / "scripts" / "mutmut_plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)  # the plugin writes into mutants/, its working directory under mutmut
    monkeypatch.setitem(module._state, "main_pid", os.getpid())
    monkeypatch.setitem(module._state, "timed_out", [])
    return module


def report(nodeid: str, failed: bool, text: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, failed=failed, when="call", longreprtext=text)


@pytest.mark.parametrize("mode, run", [("stats", "stats"), ("", "clean")])
def test_a_failure_in_the_stats_or_clean_run_is_kept_with_the_end_of_its_report(plugin, monkeypatch, mode, run):
    monkeypatch.setenv("MUTANT_UNDER_TEST", mode)
    lines = [f"line {i}" for i in range(40)] + ["E   AssertionError: 4 violations"]
    plugin.pytest_runtest_logreport(report("tests/unit/test_a.py::test_b", True, "\n".join(lines)))
    plugin.pytest_runtest_logreport(report("tests/unit/test_a.py::test_c", False, ""))
    text = Path(plugin.FAILURES_FILE).read_text()
    assert text.startswith(f"{run} run: tests/unit/test_a.py::test_b failed (call)\n")
    assert "E   AssertionError: 4 violations" in text
    assert "line 25\n" not in text and "line 26\n" in text  # the last 15 lines of the report
    assert "test_c" not in text


def test_a_mutant_s_failures_are_its_verdict_not_a_record(plugin, monkeypatch):
    monkeypatch.setenv("MUTANT_UNDER_TEST", "elastic_trainer.data.order.x_f__mutmut_1")
    plugin.pytest_runtest_logreport(report("tests/unit/test_a.py::test_b", True, "AssertionError"))
    plugin.pytest_runtest_logreport(report("tests/unit/test_a.py::test_d", True, "Failed: Timeout >15.0s"))
    assert not Path(plugin.FAILURES_FILE).exists()
    assert plugin._state["timed_out"] == ["tests/unit/test_a.py::test_d"]


def test_a_forked_rank_records_nothing(plugin, monkeypatch):
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    monkeypatch.setitem(plugin._state, "main_pid", os.getpid() + 1)
    plugin.pytest_runtest_logreport(report("tests/unit/test_a.py::test_b", True, "AssertionError"))
    assert not Path(plugin.FAILURES_FILE).exists()


def test_the_judging_tests_are_the_fastest_within_the_budget_one_process_tests_first(plugin):
    durations = {"tests/unit/a": 9.0, "tests/unit/b": 5.0, "tests/distributed/c": 1.0, "tests/unit/d": 30.0}
    tests = list(durations)
    assert plugin.judging_tests(tests, durations, 15.0) == ["tests/unit/b", "tests/unit/a"]
    assert plugin.judging_tests(["tests/unit/d", "tests/unit/a"], durations, 1.0) == ["tests/unit/a"]  # at least one
    assert plugin.judging_tests(tests, durations, 0) == tests  # 0 keeps them all
