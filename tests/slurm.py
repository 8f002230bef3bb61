"""A throwaway single-node Slurm cluster for tests: Debian's slurmctld, slurmd and munge, configured in a
temporary folder (never /etc), started by the test and stopped by PID.

munged runs as the munge user with its own key and socket; slurm.conf names that socket, declares this
host (`hostname -s`) with more CPUs than it has (so one agent task can ask for 4 CPUs = 4 gloo ranks;
`SlurmdParameters=config_overrides` lets slurmd accept that) and `cred_expire=10` so a requeued job starts
again after seconds rather than two minutes. Client commands need `SLURM_CONF` (see `env()`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMONS = {"slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd", "munged": "/usr/sbin/munged"}
CPUS = 8
APT_WAIT = ("-o", "DPkg::Lock::Timeout=600")
"""Wait for dpkg's lock: another test (sshd's, Slurm's) may be installing its packages at the same time."""


def ensure_slurm() -> str | None:
    """None when Slurm and munge are usable (apt-installing them as root if missing), else why to skip."""

    def present() -> bool:
        return all(os.path.exists(p) for p in DAEMONS.values()) and all(
            shutil.which(c) for c in ("sbatch", "scontrol", "squeue", "sinfo", "scancel")
        )

    if present():
        return None
    if os.geteuid() != 0:
        return (
            "Slurm is not installed and the tests are not root to install it (apt-get install "
            + " ".join(PACKAGES)
            + ")"
        )
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", *APT_WAIT, "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            subprocess.run(["apt-get", *APT_WAIT, "update"], env=env, capture_output=True, timeout=900)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "apt-get timed out installing Slurm"
    if proc.returncode != 0 or not present():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return f"apt-get could not install Slurm: {tail[0]}"
    # the packages' own services (started by dpkg where a service manager runs) would hold the default ports
    if shutil.which("service"):
        for unit in ("slurmctld", "slurmd", "munge"):
            subprocess.run(["service", unit, "stop"], capture_output=True, timeout=60)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mb() -> int:
    out = subprocess.run([DAEMONS["slurmd"], "-C"], capture_output=True, text=True, timeout=60).stdout
    for word in out.split():
        if word.startswith("RealMemory="):
            return int(word.split("=", 1)[1])
    return 4096


@dataclass
class SlurmCluster:
    folder: Path
    conf: Path
    node: str
    procs: dict[str, subprocess.Popen]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv),
            env=kw.pop("env", None) or self.env(),
            capture_output=True,
            text=True,
            check=check,
            timeout=kw.pop("timeout", 60),
            **kw,
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NumCPUs, ...); {} once it is gone."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        if proc.returncode != 0:
            return {}
        out = {}
        for word in proc.stdout.split():
            key, _, value = word.partition("=")
            out.setdefault(key, value)
        return out

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _wait(what, timeout: float, message: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(step)


@contextlib.contextmanager
def slurm_cluster(folder: Path, nodes: tuple[str, ...] | None = None) -> Iterator[SlurmCluster]:
    """munged, slurmctld and a slurmd per node up in `folder`; everything stopped by PID afterwards (jobs
    cancelled). `nodes`: names of emulated nodes, one slurmd each on this machine (`slurmd -N`), which must
    resolve to this machine (e.g. this host's short name and localhost); default: this host alone."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    munge = pwd.getpwnam("munge")
    munge_dir = folder / "munge"
    munge_dir.mkdir(mode=0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    for path in (munge_dir, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    socket_path = munge_dir / "munge.sock"
    os.chmod(munge_dir, 0o711)  # clients reach the socket; only munge reads the key
    node = socket.gethostname().split(".")[0]
    nodes = tuple(nodes or (node,))
    multiple = len(nodes) > 1
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    conf = folder / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=ettest",
                f"SlurmctldHost={node}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                *([] if multiple else [f"SlurmdPort={_free_port()}"]),
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path},cred_expire=10",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}" + ("/%n" if multiple else ""),
                f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'slurmd'}" + ("-%n.pid" if multiple else ".pid"),
                f"SlurmctldLogFile={folder / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'slurmd'}" + ("-%n.log" if multiple else ".log"),
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "MpiDefault=none",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "JobAcctGatherType=jobacct_gather/none",
                "KillWait=30",
                "MinJobAge=600",
                "InactiveLimit=0",
                *(
                    f"NodeName={name} NodeAddr=127.0.0.1"
                    + (f" Port={_free_port()}" if multiple else "")
                    + f" CPUs={CPUS} RealMemory={max(256, _real_memory_mb() // (2 * len(nodes)))} State=UNKNOWN"
                    for name in nodes
                ),
                f"PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    procs: dict[str, subprocess.Popen] = {}
    cluster = SlurmCluster(folder, conf, node, procs)
    try:
        procs["munged"] = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={munge.pw_uid}",
                f"--regid={munge.pw_gid}",
                "--clear-groups",
                DAEMONS["munged"],
                "--foreground",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(folder / "munged.err", "w"),
        )
        _wait(lambda: socket_path.exists() or procs["munged"].poll() is not None, 30, "munged did not start")
        if procs["munged"].poll() is not None:
            raise RuntimeError(f"munged exited: {(folder / 'munged.err').read_text()[-2000:]}")
        env = cluster.env()
        procs["slurmctld"] = subprocess.Popen(
            [DAEMONS["slurmctld"], "-D", "-i", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(folder / "slurmctld.err", "w"),
        )
        time.sleep(0.5)
        for name in nodes:
            if multiple:
                (folder / "spool" / name).mkdir()
            key_ = f"slurmd-{name}" if multiple else "slurmd"
            procs[key_] = subprocess.Popen(
                [DAEMONS["slurmd"], "-D", "-f", str(conf), *(["-N", name] if multiple else [])],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(folder / f"{key_}.err", "w"),
            )

        def node_idle() -> bool:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    err = (folder / f"{name}.err").read_text()[-1500:] + cluster.log(name)[-1500:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {err}")
            out = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            return out == ["idle"] * len(nodes)

        _wait(node_idle, 60, "the Slurm node did not become idle")
        yield cluster
    finally:
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            cluster.run("scancel", "--full", "--signal=KILL", "--partition=test", check=False)
            with contextlib.suppress(Exception):
                _wait(lambda: not cluster.run("squeue", "-h", check=False).stdout.strip(), 20, "jobs remain")
        for name in [n for n in procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
