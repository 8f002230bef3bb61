"""What runs on each host, as argument lists: one torchrun agent per host (c10d rendezvous), started directly
on this machine or through ssh on another. Pure: nothing is executed here, and nothing is concatenated into a
shell string except the remote command ssh needs, which is quoted from a list with shlex.join. Host names
reach it only after hosts.valid_host_name accepted them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from elastic_trainer.config import positive_int
from elastic_trainer.elastic.handover import HOST_ENV  # noqa: F401  (the host's name, set per host)
from elastic_trainer.launch.hosts import Host, HostsError

# c10d rendezvous settings: the launcher hosts the store (no agent is its host, so losing any host leaves the
# rendezvous up). A lost host leaves the completed round when its heartbeat is keep_alive_interval *
# keep_alive_max_attempt seconds old; the survivors then close their round at once (launch/live_hosts.py), so
# that product is most of a lost host's cost: 2 s measured 2.1 s to recover, 3 s 4.3 s and torch's 6 s 7.5 s
# (benchmarks/rescale/failures.py). A heartbeat comes from an agent's own thread, which woke at most 0.6 ms
# late with 8 ranks training on 2 cores; a live host taken for dead costs nothing until the next restart.
# last_call_timeout only matters when a phase's host is slow to start and alive.
RDZV_CONF = {
    "is_host": "false",
    "join_timeout": "600",
    "last_call_timeout": "10",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "2",
}
# torch >= 2.4 shares one store across rendezvous rounds without a per-round prefix, so restarted workers can
# read a dead peer's address and fail once more (measured: one wasted restart, 15 s); opt out.
# TorchElastic gives stopping workers 30 s before SIGKILL; a stop (the launcher gone, a scheduler's SIGTERM)
# must leave time to finish the step and write a large model's checkpoint to shared storage.
AGENT_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300",
}


@dataclass(frozen=True)
class Placement:
    """One host's part of a phase."""

    host: Host
    nproc: int
    """Ranks (GPUs) started on this host."""
    local: bool
    """Started on this machine directly; otherwise through ssh."""


def allocate(hosts: list[Host], gpus: int, source: str = "hosts file") -> list[tuple[Host, int]]:
    """`gpus` ranks over the hosts in file order, each host filled up to its slots before the next."""
    positive_int("gpus", gpus, HostsError)
    total = sum(h.slots for h in hosts)
    if gpus > total:
        raise HostsError(f"{gpus} GPUs asked for, but the hosts in {source} have {total} slots")
    out, left = [], gpus
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        out.append((host, take))
        left -= take
    return out


@dataclass(frozen=True)
class AgentSpec:
    """What every agent of one phase shares."""

    run_id: str
    endpoint: str
    """HOST:PORT of the rendezvous store."""
    max_nodes: int
    min_nodes: int = 1
    max_restarts: int = 3
    rdzv_conf: dict = field(default_factory=lambda: dict(RDZV_CONF))
    worker_argv: tuple[str, ...] = ()
    """Arguments of every rank (`python -m elastic_trainer.rank`): the job spec and the phase."""


def agent_argv(python: str, spec: AgentSpec, placement: Placement) -> list[str]:
    """The agent of one host: torchrun's own entry (wrapped so the agent dies with its parent) running
    `python -m elastic_trainer.rank` on its ranks."""
    conf = ",".join(f"{k}={v}" for k, v in spec.rdzv_conf.items())
    return [
        python,
        "-m",
        "elastic_trainer.launch.agent",
        "--nnodes",
        f"{spec.min_nodes}:{spec.max_nodes}",
        "--nproc-per-node",
        str(placement.nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        spec.endpoint,
        "--rdzv-id",
        spec.run_id,
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(spec.max_restarts),
        "--local-addr",
        placement.host.name,
        "-m",
        "elastic_trainer.rank",
        *spec.worker_argv,
    ]


def remote_argv(remote_root: str, env: dict[str, str], argv: list[str]) -> list[str]:
    """The command a remote host runs: the bootstrap (project folder, its environment, stop on hang-up)."""
    return [f"{remote_root}/launch/remote.sh", "env", *(f"{k}={v}" for k, v in env.items()), *argv]


@dataclass(frozen=True)
class SshSettings:
    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    """Extra `-o KEY=VALUE` options, e.g. UserKnownHostsFile=..."""
    config: str | None = None
    """Client config file (`ssh -F`)."""


def ssh_argv(host: Host, remote: list[str], ssh: SshSettings) -> list[str]:
    """ssh in batch mode (never a password prompt) without a tty (stdout and stderr stay apart)."""
    cmd = ["ssh", "-T", "-o", "BatchMode=yes"]
    if ssh.config:
        cmd += ["-F", ssh.config]
    for option in ssh.options:
        cmd += ["-o", option]
    if ssh.port is not None:
        cmd += ["-p", str(ssh.port)]
    if ssh.identity:
        cmd += ["-i", ssh.identity, "-o", "IdentitiesOnly=yes"]
    return [*cmd, host.name, "--", shlex.join(remote)]


def host_command(
    placement: Placement,
    spec: AgentSpec,
    env: dict[str, str],
    *,
    python: str,
    remote_root: str,
    remote_python: str,
    ssh: SshSettings,
) -> tuple[list[str], dict[str, str]]:
    """(argv to run on this machine, environment additions) for one host: the agent itself when the host is
    this machine, else ssh with the agent as its remote command (ssh forwards no environment: it goes in
    the command)."""
    env = {**AGENT_ENV, **env}
    if placement.local:
        return agent_argv(python, spec, placement), env
    return ssh_argv(placement.host, remote_argv(remote_root, env, agent_argv(remote_python, spec, placement)), ssh), {}
