"""Launch commands: rank placement over hosts, the torchrun agent's argv, ssh quoting, per-host commands."""

from __future__ import annotations

import shlex

import pytest

from elastic_trainer.launch.commands import (
    AgentSpec,
    Placement,
    SshSettings,
    agent_argv,
    allocate,
    host_command,
    remote_argv,
    ssh_argv,
)
from elastic_trainer.launch.hosts import Host, HostsError

A, B, C = Host("a", 4, 1), Host("b", 2, 2), Host("c", 8, 3)
HOSTS = [A, B, C]
CONF = "is_host=false,join_timeout=600,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2"
TRAIN = ("--model", "gpt-tiny", "--steps", "32", "--schedule", "default")
SPEC = AgentSpec(run_id="job-7", endpoint="10.0.0.1:29400", max_nodes=3, max_restarts=5, worker_argv=TRAIN)
NODE2 = Placement(Host("node2", 4, 2), 4, False)

# Arguments a shell would mangle if the remote command were not quoted element by element.
HOSTILE = (
    "two words",
    "it's",
    'say "hi"',
    "$(echo injected)",
    "`echo injected`",
    "a; echo injected",
    "line1\nline2",
    "*",
    "",
    "$HOME",
    "back\\slash",
    "#not a comment",
    "tab\there",
    "&&",
    "|",
    "--flag=a b",
    "'",
    '"',
    ">out.txt",
    "!!",
    "~",
)


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def o_options(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-o"]


# ---------------------------------------------------------------- allocate


@pytest.mark.parametrize(
    "gpus, placed",
    [
        (1, [(A, 1)]),
        (4, [(A, 4)]),
        (5, [(A, 4), (B, 1)]),
        (6, [(A, 4), (B, 2)]),
        (7, [(A, 4), (B, 2), (C, 1)]),
        (14, [(A, 4), (B, 2), (C, 8)]),
    ],
)
def test_allocate_fills_hosts_in_file_order(gpus, placed):
    assert allocate(HOSTS, gpus) == placed


def test_allocate_keeps_the_given_order_not_the_largest_first():
    assert allocate([C, A, B], 9) == [(C, 8), (A, 1)]


def test_allocate_beyond_the_slots_is_a_hosts_error():
    with pytest.raises(HostsError) as error:
        allocate(HOSTS, 15, "cluster.txt")
    assert str(error.value) == "15 GPUs asked for, but the hosts in cluster.txt have 14 slots"


# ---------------------------------------------------------------- agent argv


def test_agent_argv_options_and_values():
    argv = agent_argv("/venv/bin/python", SPEC, NODE2)
    assert argv[:3] == ["/venv/bin/python", "-m", "elastic_trainer.launch.agent"]
    assert value_after(argv, "--nnodes") == "1:3"
    assert value_after(argv, "--nproc-per-node") == "4"
    assert value_after(argv, "--rdzv-backend") == "c10d"
    assert value_after(argv, "--rdzv-endpoint") == "10.0.0.1:29400"
    assert value_after(argv, "--rdzv-id") == "job-7"
    assert value_after(argv, "--rdzv-conf") == CONF
    assert value_after(argv, "--max-restarts") == "5"
    assert value_after(argv, "--local-addr") == "node2"


def test_agent_argv_ends_with_the_train_command_in_order():
    argv = agent_argv("/venv/bin/python", SPEC, NODE2)
    assert argv[-len(TRAIN) - 2 :] == ["-m", "elastic_trainer.rank", *TRAIN]
    # every agent option comes before the worker's module; none of them is taken for a train argument
    worker = len(argv) - len(TRAIN) - 3
    assert all(argv.index(flag) < worker for flag in ("--nnodes", "--rdzv-conf", "--local-addr", "--max-restarts"))


def test_agent_argv_uses_the_spec_and_placement_values():
    spec = AgentSpec(
        run_id="r",
        endpoint="[fe80::1]:1234",
        max_nodes=8,
        min_nodes=2,
        max_restarts=0,
        rdzv_conf={"is_host": "false", "join_timeout": "30"},
    )
    argv = agent_argv("py", spec, Placement(Host("10.0.0.9", 8, 1), 3, False))
    flags = ("--nnodes", "--nproc-per-node", "--max-restarts", "--rdzv-conf", "--local-addr", "--rdzv-endpoint")
    assert [value_after(argv, f) for f in flags] == [
        "2:8",
        "3",
        "0",
        "is_host=false,join_timeout=30",
        "10.0.0.9",
        "[fe80::1]:1234",
    ]
    assert argv[-2:] == ["-m", "elastic_trainer.rank"]


# ---------------------------------------------------------------- ssh argv


def test_ssh_argv_default_settings():
    assert ssh_argv(Host("node2", 4, 2), ["run", "x"], SshSettings()) == [
        "ssh",
        "-T",
        "-o",
        "BatchMode=yes",
        "node2",
        "--",
        "run x",
    ]


@pytest.mark.parametrize("train", [HOSTILE, ("",), ("$(echo injected)",), ("a\nb", "c d")])
def test_remote_command_string_splits_back_to_the_exact_list(train):
    remote = remote_argv("/srv/my root", {"A": "1", "B": "x y;$(z)"}, ["/srv/py", "-m", "m", *train])
    argv = ssh_argv(Host("node2", 4, 2), remote, SshSettings(port=2222))
    assert argv[-3:-1] == ["node2", "--"] and isinstance(argv[-1], str)
    assert shlex.split(argv[-1]) == [
        "/srv/my root/launch/remote.sh",
        "env",
        "A=1",
        "B=x y;$(z)",
        "/srv/py",
        "-m",
        "m",
        *train,
    ]


def test_ssh_argv_port_and_identity_only_when_given():
    plain = ssh_argv(Host("n", 1, 1), ["x"], SshSettings())
    assert "-p" not in plain and "-i" not in plain and "IdentitiesOnly=yes" not in o_options(plain)
    argv = ssh_argv(Host("n", 1, 1), ["x"], SshSettings(port=2222, identity="/keys/id ed25519"))
    assert value_after(argv, "-p") == "2222" and value_after(argv, "-i") == "/keys/id ed25519"
    assert "IdentitiesOnly=yes" in o_options(argv)
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"] and argv[-3:] == ["n", "--", "x"]


def test_ssh_argv_config_file_only_when_given():
    assert "-F" not in ssh_argv(Host("n", 1, 1), ["x"], SshSettings())
    argv = ssh_argv(Host("n", 1, 1), ["x"], SshSettings(config="/home/me/.ssh/et_config"))
    assert value_after(argv, "-F") == "/home/me/.ssh/et_config" and argv.index("-F") < argv.index("n")


def test_ssh_argv_extra_options_in_order_before_the_host():
    options = ("UserKnownHostsFile=/tmp/kh", "StrictHostKeyChecking=accept-new", "ConnectTimeout=5")
    argv = ssh_argv(Host("node-9", 1, 1), ["x"], SshSettings(options=options, port=22, identity="/k"))
    assert [o for o in o_options(argv) if o in options] == list(options)
    assert argv.index("node-9") == len(argv) - 3 and argv[-2] == "--"
    assert all(argv.index(o) < argv.index("node-9") for o in options)


# ---------------------------------------------------------------- host command


def test_local_host_runs_the_agent_directly_with_env():
    local = Placement(Host("localhost", 8, 1), 8, True)
    argv, env = host_command(
        local,
        SPEC,
        {"NCCL_DEBUG": "WARN"},
        python="/venv/bin/python",
        remote_root="/srv/et",
        remote_python="/srv/et/.venv/bin/python",
        ssh=SshSettings(port=2222),
    )
    assert argv == agent_argv("/venv/bin/python", SPEC, local)
    assert argv[0] == "/venv/bin/python" and "ssh" not in argv and value_after(argv, "--local-addr") == "localhost"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["NCCL_DEBUG"] == "WARN"


def test_remote_host_runs_the_agent_through_ssh_and_remote_sh():
    argv, env = host_command(
        NODE2,
        SPEC,
        {"NCCL_SOCKET_IFNAME": "eth0", "ODD": "a b;$(x)"},
        python="/venv/bin/python",
        remote_root="/srv/et",
        remote_python="/srv/et/.venv/bin/python",
        ssh=SshSettings(port=2222),
    )
    assert env == {}
    assert argv[0] == "ssh" and value_after(argv, "-p") == "2222" and argv[-3:-1] == ["node2", "--"]
    remote = shlex.split(argv[-1])
    assert remote[:2] == ["/srv/et/launch/remote.sh", "env"]
    agent = remote.index("/srv/et/.venv/bin/python")
    assert remote[agent : agent + 3] == ["/srv/et/.venv/bin/python", "-m", "elastic_trainer.launch.agent"]
    assignments = remote[2:agent]
    assert all("=" in a for a in assignments)
    assert {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "NCCL_SOCKET_IFNAME=eth0", "ODD=a b;$(x)"} <= set(assignments)
    assert remote[-len(TRAIN) - 2 :] == ["-m", "elastic_trainer.rank", *TRAIN]
    assert value_after(remote, "--local-addr") == "node2" and value_after(remote, "--nproc-per-node") == "4"
