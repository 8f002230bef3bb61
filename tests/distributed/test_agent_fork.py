"""The agent's forked workers (os.fork): what they inherit from the agent."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from elastic_trainer.elastic.handover import HOST_ENV, Control
from elastic_trainer.launch import agent


def test_a_forked_worker_does_not_keep_the_agents_notice_handler():
    """A launcher's agent takes SIGTERM as its host's notice (launch/notices.py); a worker it forks must die of
    SIGTERM as a spawned one does. With the agent's handler kept, a worker SIGTERMed outside its own stop handler
    (its agent stopping the group after another worker died) posted that its host was leaving, and the launcher
    re-formed the job without a healthy host (seen in CI)."""
    from torch.distributed import TCPStore

    from elastic_trainer.launch.notices import take_sigterm_as_notice

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent_pid = os.fork()
    if agent_pid == 0:  # the agent, then its worker
        code = 1
        try:
            os.environ.update({**Control.environment(f"127.0.0.1:{store.port}", "job"), HOST_ENV: "vm-a"})
            take_sigterm_as_notice(SimpleNamespace(), agent.LAUNCHER_GONE)
            worker_pid = os.fork()
            if worker_pid == 0:
                agent.signals_as_after_exec()
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0)
            _, status = os.waitpid(worker_pid, 0)
            code = 0 if os.waitstatus_to_exitcode(status) == -signal.SIGTERM else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(agent_pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the worker did not die of SIGTERM"
    assert Control(store, "job").notices(0, ["vm-a"]) == (0, {})
