"""The agent and the restart contract: a scheduler's signal ends the agent with one line and 128 + N; which exit
codes of a worker mean stopped, rejoin or bad input; which failures it logs."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic_trainer.elastic.exit_codes import EXIT_REJOIN, EXIT_STOPPED, PEER_REASON, exit_code
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.launch import agent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_the_agent_with_one_line_and_128_plus_its_number(monkeypatch, capsys, sig):
    def launch(config, entrypoint):
        def run(*args):
            raise SignalException(f"Process 1 got signal: {int(sig)}", sigval=sig)

        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", launch)
    configured = agent.agent_config(["--standalone", "--nproc-per-node", "1", "script.py"])
    assert agent.run_agent(configured) == 128 + int(sig)
    err = capsys.readouterr().err
    assert err == f"[agent] stopped by {sig.name}: the ranks were asked to save after their current step\n"


@pytest.mark.parametrize(
    "status, reason, torchelastic, peer_env, code",
    [
        ("finished", None, False, None, 0),
        ("finished", None, True, "rejoin", 0),
        ("stopped", "SIGTERM", False, None, 3),  # a plain process: stopped after saving
        ("stopped", PEER_REASON, False, "rejoin", 3),  # ... whatever the reason
        ("stopped", "SIGTERM", True, None, 0),  # under torchrun: 0, or the agent restarts it in the old size
        ("stopped", "SIGTERM", True, "rejoin", 0),  # asked itself: its agent is stopping too
        ("stopped", PEER_REASON, True, None, 0),  # the launcher's contract (no rejoin asked)
        ("stopped", PEER_REASON, True, "rejoin", EXIT_REJOIN),  # a scale-down elsewhere: re-form in the new size
        ("stopped", PEER_REASON, True, "other", 0),
        ("stopped", "until step 5", True, "rejoin", 0),
    ],
)
def test_the_restart_contract(monkeypatch, status, reason, torchelastic, peer_env, code):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if torchelastic:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert exit_code(status, reason, under_torchrun=TorchrunEnv.read().under_torchrun, peer_stop=peer_env) == code
    assert (EXIT_REJOIN, EXIT_STOPPED) == (75, 3)


def test_the_exit_codes_and_the_error_mark_are_defined_in_one_module():
    """Every module takes them from elastic/exit_codes.py: no other module assigns a name of theirs."""
    import ast
    from pathlib import Path

    import elastic_trainer

    names = {"EXIT_BAD_INPUT", "EXIT_STOPPED", "EXIT_REJOIN", "ERROR_MARK"}
    package = Path(elastic_trainer.__file__).parent
    assigned = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            assigned += [
                (path.relative_to(package).as_posix(), t.id)
                for t in targets
                if isinstance(t, ast.Name) and t.id in names
            ]
    assert sorted(assigned) == sorted(("elastic/exit_codes.py", n) for n in names)
    assert (agent.EXIT_BAD_INPUT, EXIT_REJOIN) == (2, 75)


@pytest.mark.parametrize("code, shown", [(2, False), (75, False), (1, True), (-9, True)])
def test_the_agent_quiets_only_the_failures_that_are_not_errors(code, shown):
    import logging

    record = logging.LogRecord(
        "torch.distributed.elastic.multiprocessing.api",
        logging.ERROR,
        __file__,
        1,
        f"failed (exitcode: {code}) local_rank: 0 (pid: 1) of fn: worker",
        None,
        None,
    )
    assert agent._quiet_bad_input(record) is shown


def _failure(local_rank: int, exitcode: int, message: str, timestamp: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure.__new__(ProcessFailure)
    failure.local_rank, failure.pid, failure.exitcode, failure.error_file = local_rank, 100 + local_rank, exitcode, ""
    failure.message, failure.timestamp, failure.error_file_data = {"message": message}, timestamp, {}
    return failure


@pytest.mark.parametrize(
    "failures, line",
    [
        # both ranks failed on bad input and rank 1's error file came first: rank 0 printed its own; nothing more
        ({0: (0, 2, "rank 0's line", 2), 1: (1, 2, "rank 1's line", 1)}, None),
        ({0: (0, 2, "rank 0's line", 1), 1: (1, 2, "rank 1's line", 2)}, None),
        # only rank 1 had bad input (rank 0 was stopped by the agent): its line has not been seen
        ({0: (0, -15, "", 2), 1: (1, 2, "rank 1's line", 1)}, "rank 1's line"),
        # both had it, and the agent stopped rank 0 after it printed (its error file, written after the line, has it)
        # but before it exited with the code: seen once in CI as the line printed twice
        ({0: (0, -15, "elastic-trainer: error: the line", 2), 1: (1, 2, "elastic-trainer: error: the line", 1)}, None),
        ({1: (1, 2, "rank 1's line", 1)}, "rank 1's line"),
    ],
)
def test_the_bad_input_line_is_printed_once(failures, line):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    error = ChildFailedError("worker", {rank: _failure(*spec) for rank, spec in failures.items()})
    assert agent._failure_line(error) == (2, line)


@pytest.mark.parametrize(
    "failures",
    [
        {0: (0, 2, "rank 0's line", 1), 1: (1, 2, "rank 1's line", 2)},
        {1: (1, 2, "rank 1's line", 1)},  # rank 0 stopped by the agent after rank 1 failed: not among the failures
    ],
)
def test_forked_workers_leave_the_line_to_the_agent(failures):
    """Forked workers print nothing (rank.report_bad_input, quiet): the agent prints the first failure's line.
    When local rank 0 printed its own, a rank 0 the agent stopped after another rank failed is missing from the
    failures, so the agent could not tell that it had printed and printed the line again (seen in CI)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    error = ChildFailedError("worker", {rank: _failure(*spec) for rank, spec in failures.items()})
    first = min(failures.values(), key=lambda spec: spec[3])[2]
    assert agent._failure_line(error, workers_print=False) == (2, first)


def test_the_agent_does_not_ask_the_cuda_runtime_before_it_forks(monkeypatch):
    """TorchElastic's LaunchConfig calls torch.cuda.is_available(); asked of the CUDA runtime (its device count),
    that poisons fork, and on an H100 every forked worker failed "Cannot re-initialize CUDA in forked subprocess".
    Here the runtime's count is a spy and NVML (what torch asks under PYTORCH_NVML_BASED_CUDA_CHECK=1) sees one
    GPU, as on a one-GPU machine: building the agent's config must not reach the runtime."""
    import torch

    asked = []
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: asked.append("runtime") or 1, raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    monkeypatch.delenv(agent.NVML_CHECK_ENV, raising=False)
    monkeypatch.delenv(agent.START_ENV, raising=False)
    config, entrypoint, _ = agent.agent_config(
        ["--standalone", "--nproc-per-node", "1", "-m", agent.WORKER_MODULE, "--job", "job.json"]
    )
    assert entrypoint is agent.worker and config.start_method == "fork"
    assert asked == [] and os.environ[agent.NVML_CHECK_ENV] == "1"


def test_a_worker_forked_from_a_cuda_agent_says_how_to_go_on(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=f"used CUDA before forking.*{agent.START_ENV}=spawn"):
        agent.refuse_poisoned_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CUDA build on a machine without GPUs
    agent.refuse_poisoned_cuda()
