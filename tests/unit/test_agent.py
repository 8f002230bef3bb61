"""The agent's ending when a scheduler stops it: one line and 128 + the signal, not TorchElastic's traceback."""

from __future__ import annotations

import signal

import pytest
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.multiprocessing.api import SignalException

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
