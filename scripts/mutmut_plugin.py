"""pytest plugin for mutation runs; mutmut loads it through `pytest_add_cli_args` in pyproject.toml.

mutmut 3 runs pytest in-process (in forks of itself) inside mutants/, and this plugin is imported there from
the copy of scripts/ (`also_copy`). What it does for the distributed tests and the runs around them:

1. Test selection sees the forked ranks. In the stats run mutmut learns which tests reach which function from
   trampoline hits recorded in the pytest process; a rank forked by parallel/local_ranks.py records its hits
   in its own memory and leaves with os._exit, so without help every function that runs only on the ranks
   (the engine, the pipeline, the data-parallel sync, the checkpoint's collectives) would get no tests and
   its mutants would count as "no tests". Here a forked process appends its hits to a file, which the
   pytest process reads into its own hits before mutmut's teardown hook hands them to the test.
2. A mutant's ranks do not outlive it. The mutant (MUTANT_UNDER_TEST) reaches the ranks by inheritance of
   the fork; when mutmut's wall-clock timeout kills a hanging mutant's pytest process (SIGXCPU, counted as
   "timeout"), its ranks, perhaps blocked in a collective, get SIGKILL from the kernel (PR_SET_PDEATHSIG)
   instead of living on as orphans.
3. Only the fast tests judge a mutant, and a hanging one is stopped by its test, not by the whole run's limit: a
   mutant runs every test that reaches its function (for data/order.py that is every distributed training test, ~8
   min in all), and mutmut's wall-clock limit scales with that sum. Here each test of a mutant run gets
   pytest-timeout's limit of MUTATION_TEST_TIMEOUT_MIN + MUTATION_TEST_TIMEOUT_FACTOR * its own clean duration
   (defaults 15 s and 4, durations from mutmut's stats run); a test stopped by it fails, and the run is logged as a
   timeout. Before that, the tests are cut to the fastest ones whose clean times add up to MUTATION_TEST_BUDGET_S
   (default 15 s; at least one test; 0 keeps all): the survivors of a function reached by 90 tests otherwise cost
   minutes each (the whole run was estimated at 180 h with every test). The clean run before the mutants (every test
   of the mutants to run) is cut the same way.

5. Each pytest session removes its temporary folders when it ends (a mutant's never would: see 4.'s os._exit).
6. A test that fails in mutmut's stats or clean run (which stop the whole run, their output thrown away) is
   written with the end of its report to mutants/mutation-failures.txt, which scripts/mutation.sh prints.

Outside mutmut (no MUTANT_UNDER_TEST) the plugin does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

_state: dict = {
    "main_pid": None,
    "hits_file": None,
    "patched": False,
    "at_fork": False,
    "started": None,
    "timings": None,
    "forked_at": None,
    "timed_out": [],
}
_NOT_A_MUTANT = ("", "stats", "fail", "list_all_tests", "mutant_generation")
_seen: set = set()
_PR_SET_PDEATHSIG = 1


def _mode() -> str | None:
    return os.environ.get("MUTANT_UNDER_TEST")


def _after_fork_in_child() -> None:
    _seen.clear()
    _state["forked_at"] = time.monotonic()
    if _mode() is None:
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans are then left to their own timeouts
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


# Saved at import: tests monkeypatch os functions (os.listdir in test_hosts.py), and the hook below runs
# before the test's fixtures are torn down.
_os_open, _os_read, _os_write, _os_close, _os_ftruncate, _os_getpid = (
    os.open,
    os.read,
    os.write,
    os.close,
    os.ftruncate,
    os.getpid,
)


def _patch_trampoline() -> None:
    """Route trampoline hits made in forked processes into the pytest process's hits file."""
    import mutmut.mutation.trampoline as trampoline

    original = trampoline.record_trampoline_hit
    _state["original"] = original

    def record(name: str, caller: str | None = None) -> None:
        if _os_getpid() == _state["main_pid"] or _state["hits_file"] is None:
            return original(name, caller=caller)
        if (name, caller) in _seen:
            return None
        _seen.add((name, caller))
        # one short O_APPEND write per new hit (atomic among the ranks): a rank leaves with os._exit,
        # so nothing may wait in a buffer
        fd = _os_open(_state["hits_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _os_write(fd, f"{name}\t{caller or ''}\n".encode())
        finally:
            _os_close(fd)
        return None

    trampoline.record_trampoline_hit = record


def _collect_forked_hits() -> None:
    path = _state["hits_file"]
    if path is None:
        return
    try:
        fd = _os_open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        chunks = []
        while chunk := _os_read(fd, 1 << 16):
            chunks.append(chunk)
        _os_ftruncate(fd, 0)
    finally:
        _os_close(fd)
    original = _state["original"]
    for line in b"".join(chunks).decode().splitlines():
        name, _, caller = line.partition("\t")
        if name:
            original(name, caller=caller or None)


def pytest_configure(config) -> None:
    mode = _mode()
    if mode is None:
        return
    if not _state["at_fork"]:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _state["at_fork"] = True
    _state["main_pid"] = os.getpid()
    _state["hits_file"] = None
    _state["timings"] = os.path.abspath("mutation-timings.tsv")  # cwd is mutants/ here
    if mode == "stats":
        if not _state["patched"]:
            _patch_trampoline()
            _state["patched"] = True
        _state["hits_file"] = os.path.abspath(f".mutmut-forked-hits-{os.getpid()}")


def pytest_sessionstart(session) -> None:
    _state["started"] = time.monotonic()
    _state["timed_out"] = []


def judging_tests(tests: list[str], durations: dict, budget: float) -> list[str]:
    """The tests of `tests` that judge a mutant: the fastest whose clean times add up to at most `budget` seconds
    (at least one), the one-process tests first; all of them when `budget` is 0 (scripts/mutation_diff.py
    reads the same rule)."""
    if budget <= 0:
        return list(tests)
    kept, spent = [], 0.0
    for test in sorted(tests, key=lambda t: (not t.startswith("tests/unit/"), durations.get(t, 0.0))):
        spent += durations.get(test, 0.0)
        if kept and spent > budget:
            break
        kept.append(test)
    return kept


def pytest_collection_modifyitems(session, config, items) -> None:
    """The fast tests, and per-test timeouts, for a mutant's run; the fast tests also for the clean run that
    precedes the mutants (see 3. above)."""
    mode = _mode()
    if mode is None or (mode in _NOT_A_MUTANT and mode != ""):
        return
    import json

    import pytest

    try:
        with open("mutmut-stats.json") as f:  # cwd is mutants/
            stats = json.load(f)
        durations = stats["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    floor = float(os.environ.get("MUTATION_TEST_TIMEOUT_MIN", "15"))
    factor = float(os.environ.get("MUTATION_TEST_TIMEOUT_FACTOR", "4"))
    budget = float(os.environ.get("MUTATION_TEST_BUDGET_S", "15"))
    if budget > 0 and items:
        # The fastest tests, up to `budget` seconds of clean time in all (at least one), judge a mutant. A
        # mutant only a slower test would kill therefore counts as survived, never the other way round.
        if mode == "":  # the clean run: what any function's mutants will run
            by_function = stats.get("tests_by_mangled_function_name", {})
            present = {item.nodeid for item in items}
            wanted = set()
            for tests in by_function.values():
                if present.intersection(tests):
                    wanted.update(judging_tests([t for t in tests if t in present], durations, budget))
        else:
            wanted = set(judging_tests([item.nodeid for item in items], durations, budget))
        if len(wanted) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
            items[:] = [item for item in items if item.nodeid in wanted]
    # One-process tests first, then mutmut's order (fastest first): a forked test's recorded time leaves out
    # its module fixture (a reference run), so one "taking 0 s" can take 10 s.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/unit/"))
    if mode == "":  # the clean run: no timeouts
        return
    for item in items:
        limit = floor + factor * float(durations.get(item.nodeid, 0.0))
        item.add_marker(pytest.mark.timeout(limit, method="signal"), append=False)


FAILURES_FILE = "mutation-failures.txt"
"""In mutants/: the tests that failed in mutmut's stats or clean run, each with the end of its report."""


def pytest_runtest_logreport(report) -> None:
    mode = _mode()
    if not report.failed:
        return
    if mode not in _NOT_A_MUTANT and "Timeout" in (report.longreprtext or ""):
        _state["timed_out"].append(report.nodeid)
    elif mode in ("stats", "") and _os_getpid() == _state["main_pid"]:
        # mutmut sends the pytest output of these runs to /dev/null and says only "runner returned 1"
        tail = "\n".join((report.longreprtext or "").splitlines()[-15:])
        with open(FAILURES_FILE, "a") as f:
            f.write(f"{mode or 'clean'} run: {report.nodeid} failed ({report.when})\n{tail}\n\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    mode = _mode()
    if mode is None or _state["started"] is None or session.config.option.collectonly:
        return
    now = time.monotonic()
    elapsed = now - _state["started"]
    since_fork = now - _state["forked_at"] if _state["forked_at"] is not None else elapsed
    _state["started"] = None
    try:
        with open(_state["timings"], "a") as f:
            f.write(
                f"{mode or 'clean'}\t{elapsed:.3f}\t{int(exitstatus)}\t{session.testscollected}\t{since_fork:.3f}"
                f"\t{','.join(_state['timed_out'])}\n"
            )
    except Exception:
        pass


def pytest_unconfigure(config) -> None:
    if _mode() is not None:
        # A mutant's pytest leaves with os._exit, so pytest never cleans its numbered temporary folders: at
        # ~0.4 GB a session they filled a 250 GB disk within one run. Each session removes its own.
        factory = getattr(config, "_tmp_path_factory", None)
        basetemp = getattr(factory, "_basetemp", None) if factory is not None else None
        if basetemp is not None:
            import shutil

            shutil.rmtree(basetemp, ignore_errors=True)
    path = _state["hits_file"]
    if path and _os_getpid() == _state["main_pid"]:
        try:
            os.unlink(path)
        except OSError:
            pass


try:
    import pytest

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(item, nextitem) -> None:
        """Runs before mutmut's StatsCollector hook, which hands the hits gathered so far to this test."""
        if _mode() == "stats" and _os_getpid() == _state["main_pid"]:
            try:
                _collect_forked_hits()
            except Exception as e:  # never break the test's teardown; the hits are then lost
                print(f"mutmut_plugin: forked hits of {item.nodeid} lost: {e!r}")
except ImportError:  # imported outside pytest
    pass
