"""scripts/mutation_diff.py: which mutants can be judged differently at two revisions, on two small checkouts
written here (their code, their tests, mutmut's stats and results)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutation_diff", ROOT / "scripts" / "mutation_diff.py")
mutation_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation_diff)

CODE = '''
def kept(x):
    """Same at both."""
    return x + 1


def reformatted(a, b):
    return max(a, b)


def changed(x):
    return x * 2


class Box:
    def size(self):
        return 3
'''
CODE_AFTER = '''
def kept(x):
    """Same at both, another docstring."""
    return x + 1


def reformatted(
    a,
    b,
):
    return max(a, b)


def changed(x):
    return x * 3


class Box:
    def size(self):
        return 3
'''
TESTS = """
def test_kept():
    assert True


def test_box(tmp_path):
    assert True


def test_slow():
    assert True
"""
M = "elastic_trainer.mod"
SEP = mutation_diff.FUNCTION_SEPARATOR


def checkout(root: Path, code: str, tests: str, test_dir: str, reach: dict, durations: dict, results: dict) -> Path:
    (root / "elastic_trainer").mkdir(parents=True)
    (root / "elastic_trainer" / "mod.py").write_text(code)
    (root / "tests" / test_dir).mkdir(parents=True)
    (root / "tests" / test_dir / "test_mod.py").write_text(tests)
    (root / "tests" / "conftest.py").write_text("import pytest\n\n\n@pytest.fixture\ndef tmp_path():\n    pass\n")
    mutants = root / "mutants"
    (mutants / "elastic_trainer").mkdir(parents=True)
    stats = {"tests_by_mangled_function_name": reach, "duration_by_test": durations, "stats_time": 1.0}
    (mutants / "mutmut-stats.json").write_text(json.dumps(stats))
    (mutants / "elastic_trainer" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": results}))
    return root


def pair(tmp_path, *, tests_after=TESTS, after_dir="unit", durations_after=None, results_after=None):
    """The same four functions at two revisions; `changed` differs in code, `reformatted` only in form."""
    t = "tests/{}/test_mod.py::{}"
    reach_b = {
        f"{M}.x_kept": [t.format("unit", "test_kept")],
        f"{M}.x_reformatted": [t.format("unit", "test_kept")],
        f"{M}.x_changed": [t.format("unit", "test_kept")],
        f"{M}.x{SEP}Box{SEP}size": [t.format("unit", "test_box"), t.format("unit", "test_slow")],
    }
    reach_a = {fn: [x.replace("/unit/", f"/{after_dir}/") for x in v] for fn, v in reach_b.items()}
    durations_b = {t.format("unit", n): d for n, d in (("test_kept", 1.0), ("test_box", 2.0), ("test_slow", 20.0))}
    durations_a = durations_after or {k.replace("/unit/", f"/{after_dir}/"): v for k, v in durations_b.items()}
    results = {f"{M}.x_kept__mutmut_1": 1, f"{M}.x_changed__mutmut_1": 1, f"{M}.x{SEP}Box{SEP}size__mutmut_1": 1}
    before = checkout(tmp_path / "before", CODE, TESTS, "unit", reach_b, durations_b, results)
    after = checkout(
        tmp_path / "after", CODE_AFTER, tests_after, after_dir, reach_a, durations_a, results_after or results
    )
    return before, after


def test_only_the_function_whose_code_changed_is_selected(tmp_path):
    before, after = pair(tmp_path)
    assert mutation_diff.differing(before, after) == {f"{M}.x_changed": ["code changed"]}


def test_a_test_file_moved_between_tiers_is_the_same_tests(tmp_path):
    before, after = pair(tmp_path, after_dir="distributed")
    assert set(mutation_diff.differing(before, after)) == {f"{M}.x_changed"}


def test_a_judging_test_that_changed_selects_what_it_judges(tmp_path):
    before, after = pair(
        tmp_path,
        tests_after=TESTS.replace("def test_box(tmp_path):\n    assert True", "def test_box(tmp_path):\n    assert 1"),
    )
    assert set(mutation_diff.differing(before, after)) == {f"{M}.x_changed", f"{M}.x{SEP}Box{SEP}size"}


def test_a_test_beyond_the_budget_does_not_judge_and_its_change_does_not_count(tmp_path):
    before, after = pair(
        tmp_path, tests_after=TESTS.replace("def test_slow():\n    assert True", "def test_slow():\n    assert 1")
    )
    assert set(mutation_diff.differing(before, after)) == {f"{M}.x_changed"}


def test_a_test_that_moved_inside_the_budget_selects_the_function(tmp_path):
    t = "tests/unit/test_mod.py::"
    durations = {t + "test_kept": 1.0, t + "test_box": 2.0, t + "test_slow": 5.0}  # now within 15 s
    before, after = pair(tmp_path, durations_after=durations)
    why = mutation_diff.differing(before, after)
    assert why[f"{M}.x{SEP}Box{SEP}size"] == ["judging tests 1 -> 2: 0 left, 1 came"]


def test_a_fixture_that_changed_selects_the_tests_that_name_it(tmp_path):
    before, after = pair(tmp_path)
    (after / "tests" / "conftest.py").write_text("import pytest\n\n\n@pytest.fixture\ndef tmp_path():\n    return 1\n")
    assert set(mutation_diff.differing(before, after)) == {f"{M}.x_changed", f"{M}.x{SEP}Box{SEP}size"}


def test_compare_scores_the_selected_part_and_names_each_mutant_judged_differently(tmp_path, capsys):
    results_after = {f"{M}.x_kept__mutmut_1": 1, f"{M}.x_changed__mutmut_1": 0, f"{M}.x{SEP}Box{SEP}size__mutmut_1": 1}
    before, after = pair(tmp_path, results_after=results_after)
    mutation_diff.compare(before, after, {f"{M}.x_changed"})
    out = capsys.readouterr().out
    assert "before: 1 / 1 killed (100.0%)" in out
    assert "after: 0 / 1 killed (0.0%)" in out
    assert f"{M}.x_changed__mutmut_1: killed -> survived" in out


def test_a_checkout_without_stats_is_one_line_and_exit_code_2(tmp_path, capsys):
    before, after = pair(tmp_path)
    (after / "mutants" / "mutmut-stats.json").unlink()
    with pytest.raises(SystemExit) as stop:
        mutation_diff.differing(before, after)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mutmut-stats.json; run mutmut's stats there first" in err


def test_a_sample_draws_only_mutants_both_revisions_have_and_is_seeded(tmp_path):
    only_after = f"{M}.x_changed__mutmut_2"
    results = {f"{M}.x_kept__mutmut_1": 1, f"{M}.x_changed__mutmut_1": 1, f"{M}.x{SEP}Box{SEP}size__mutmut_1": 1}
    before, after = pair(tmp_path, results_after={**results, only_after: 1})
    assert mutation_diff.sample(before, after, 10) == sorted(results)
    two = mutation_diff.sample(before, after, 2, seed=3)
    assert len(two) == 2 and set(two) < set(results) and two == mutation_diff.sample(before, after, 2, seed=3)


def test_compare_of_named_mutants_counts_those_checked_at_both(tmp_path, capsys):
    kept, changed, size = f"{M}.x_kept__mutmut_1", f"{M}.x_changed__mutmut_1", f"{M}.x{SEP}Box{SEP}size__mutmut_1"
    before, after = pair(tmp_path, results_after={kept: 0, changed: 1, size: None})
    (tmp_path / "names").write_text(f"{kept}\n{changed}\n{size}\n")
    assert mutation_diff.main(["compare", str(before), str(after), "--names", str(tmp_path / "names")]) == 0
    out = capsys.readouterr().out
    assert "3 mutants named, 1 not checked at both (left out)" in out
    assert "before: 2 / 2 killed (100.0%; 95 % 34.2-100.0%)" in out
    assert "after: 1 / 2 killed (50.0%; 95 % 9.5-90.5%)" in out
    assert f"{kept}: killed -> survived" in out and size not in out.split("judged differently")[1]
