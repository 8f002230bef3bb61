"""The command ssh runs on a remote host, through a real shell."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from elastic_trainer.launch.commands import (
    AgentSpec,
    SshSettings,
    agent_argv,
    host_command,
)
from tests.unit.test_launch_commands import HOSTILE, NODE2


def test_remote_command_survives_a_real_shell(tmp_path):
    """bash -c of the ssh command string runs remote.sh and the agent with every argument intact, nothing run."""
    root = tmp_path / "remote root's dir"
    (root / "launch").mkdir(parents=True)
    bootstrap = root / "launch" / "remote.sh"
    bootstrap.write_text('#!/bin/sh\nexec "$@"\n')
    fake_agent = tmp_path / "fake python"
    fake_agent.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'odd': os.environ.get('ODD')}))\n"
    )
    for script in (bootstrap, fake_agent):
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    probes = [tmp_path / f"probe{i}" for i in range(3)]
    train = (*HOSTILE, f"$(touch '{probes[0]}')", f"`touch '{probes[1]}'`", f"; touch '{probes[2]}'")
    spec = AgentSpec(run_id="job-7", endpoint="10.0.0.1:29400", max_nodes=3, worker_argv=train)
    odd = f"x'; touch '{probes[2]}'; echo '"
    argv, _ = host_command(
        NODE2,
        spec,
        {"ODD": odd},
        python="unused",
        remote_root=str(root),
        remote_python=str(fake_agent),
        ssh=SshSettings(),
    )
    (tmp_path / "glob-bait").write_text("")  # an unquoted * would expand to this folder's names
    result = subprocess.run(
        ["bash", "-c", argv[-1]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["argv"][:2] == ["-m", "elastic_trainer.launch.agent"]
    assert out["argv"][-len(train) - 2 :] == ["-m", "elastic_trainer.rank", *train]
    assert out["argv"] == agent_argv(str(fake_agent), spec, NODE2)[1:]
    assert out["odd"] == odd
    assert not any(p.exists() for p in probes)
