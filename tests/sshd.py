"""A throwaway OpenSSH server on loopback for tests, with its own keys; never reads or writes ~/.ssh."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

SSHD = "/usr/sbin/sshd"
TAG = "ET_TEST_SSHD"  # sshd's SetEnv puts it in every remote command: cleanup finds orphans by it


@dataclass(frozen=True)
class SshServer:
    host: str
    port: int
    identity: str
    known_hosts: str
    log: str

    def ssh_options(self) -> list[str]:
        # -F /dev/null: no ~/.ssh/config nor /etc/ssh/ssh_config (so no SendEnv), and ssh won't mkdir ~/.ssh.
        # Port and identity are not in here: pass -p/-i (or use .ssh()), so a test can swap the key.
        opts = {
            "UserKnownHostsFile": self.known_hosts,
            "GlobalKnownHostsFile": "/dev/null",
            "StrictHostKeyChecking": "yes",
            "UpdateHostKeys": "no",
            "BatchMode": "yes",
            "IdentitiesOnly": "yes",
            "IdentityAgent": "none",
            "PasswordAuthentication": "no",
            "ConnectTimeout": "5",
            "LogLevel": "ERROR",
        }
        return ["-F", "/dev/null", *(x for k, v in opts.items() for x in ("-o", f"{k}={v}"))]

    def ssh(self, *cmd: str) -> list[str]:
        """Argument list that runs cmd on the server (the remote shell joins cmd with spaces)."""
        return ["ssh", *self.ssh_options(), "-p", str(self.port), "-i", self.identity, self.host, "--", *cmd]


APT_WAIT = ("-o", "DPkg::Lock::Timeout=600")
"""Wait for dpkg's lock: another test (sshd's, Slurm's) may be installing its packages at the same time."""


def _installed() -> bool:
    """sshd, ssh and ssh-keygen present and sshd's privilege-separation user made: dpkg unpacks the binaries
    before the package's script adds the user, so a binary alone may be an install another test has under way
    (an sshd started then exits with "Privilege separation user sshd does not exist")."""
    try:
        pwd.getpwnam("sshd")
    except KeyError:
        return False
    return os.path.exists(SSHD) and bool(shutil.which("ssh")) and bool(shutil.which("ssh-keygen"))


def ensure_sshd() -> str | None:
    """None when sshd and ssh are usable (apt-installing them as root if missing), else why to skip."""
    if _installed():
        return None
    if os.geteuid() != 0:
        return f"{SSHD} or ssh missing and not root to install openssh"
    if not shutil.which("apt-get"):
        return f"{SSHD} or ssh missing and no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", *APT_WAIT, "install", "-y", "--no-install-recommends", "openssh-server", "openssh-client"]
    try:
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        stale = ("Unable to locate package", "no installation candidate", "404")  # no or old package lists
        if proc.returncode != 0 and any(m in proc.stderr for m in stale):
            subprocess.run(["apt-get", *APT_WAIT, "update"], env=env, capture_output=True, timeout=600)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "apt-get timed out installing openssh-server"
    if proc.returncode != 0 or not _installed():
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        return f"apt-get install openssh-server failed: {lines[-1]}"
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _procs() -> dict[int, tuple[int, bytes]]:
    """pid -> (ppid, environ) of every live (non-zombie) process."""
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            if stat[0] != "Z":
                out[int(entry)] = (int(stat[1]), open(f"/proc/{entry}/environ", "rb").read())
        except (OSError, IndexError):  # gone meanwhile
            pass
    return out


def _kill_all(token: str, proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Stop sshd, its children, and every remote command (even orphaned ones, found by the SetEnv tag).

    sshd and its forks overwrite their environ with the process title, so they are found by parentage;
    remote commands run in their own session (setsid), so a process-group kill would miss them."""
    needle = f"{TAG}={token}".encode()
    victims = {proc.pid}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + grace
        while True:
            procs = _procs()
            grown = True
            while grown:  # the tree under sshd (before reparenting) plus everything tagged
                more = {p for p, (pp, env) in procs.items() if pp in victims or needle in env.split(b"\0")}
                grown = not more <= victims
                victims |= more
            alive = (victims & procs.keys()) - {os.getpid()}
            if not alive or time.monotonic() > deadline:
                break
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            proc.poll()  # reap sshd so it doesn't linger as a zombie
            time.sleep(0.05)
        if not alive:
            break
    proc.wait(timeout=5)


@contextlib.contextmanager
def sshd(tmp_dir: str, host: str = "127.0.0.2") -> Iterator[SshServer]:
    """Run sshd for root on host:free port with keys under tmp_dir/sshd; on exit kill it and all it started.

    Note: killing a local `ssh` (without -tt) does NOT stop its remote command: it is reparented and keeps
    running until it writes to its closed stdout/stderr or reads EOF on stdin. Exit here kills such orphans."""
    d = os.path.join(os.path.abspath(tmp_dir), "sshd")
    os.makedirs(d, exist_ok=True)
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", f"{d}/host_key", "-C", "test-host"], check=True)
    subprocess.run([*keygen, "-f", f"{d}/client_key", "-C", "test-client"], check=True)
    shutil.copy(f"{d}/client_key.pub", f"{d}/authorized_keys")
    port = _free_port(host)  # tiny race until sshd binds it; fine for tests
    with open(f"{d}/known_hosts", "w") as f:
        f.write(f"[{host}]:{port} {open(f'{d}/host_key.pub').read()}")
    token = uuid.uuid4().hex
    conf = {
        "ListenAddress": host,
        "Port": port,
        "HostKey": f"{d}/host_key",
        "PidFile": f"{d}/sshd.pid",
        "AuthorizedKeysFile": f"{d}/authorized_keys",
        "PubkeyAuthentication": "yes",
        "PasswordAuthentication": "no",
        "KbdInteractiveAuthentication": "no",
        "PermitRootLogin": "prohibit-password",
        "UsePAM": "no",
        "StrictModes": "no",
        "DisableForwarding": "yes",
        "AllowTcpForwarding": "no",
        "X11Forwarding": "no",
        "PrintMotd": "no",
        "PrintLastLog": "no",
        "PermitUserRC": "no",  # PermitUserRC: skip ~/.ssh/rc
        "MaxStartups": "100",
        "MaxSessions": "100",  # many concurrent launches must not be dropped
        "SetEnv": f"{TAG}={token}",
    }  # tags every remote command for cleanup
    with open(f"{d}/sshd_config", "w") as f:
        f.writelines(f"{k} {v}\n" for k, v in conf.items())
    with contextlib.suppress(OSError):  # privilege-separation dir, made at boot on a real host
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    server = SshServer(host, port, f"{d}/client_key", f"{d}/known_hosts", f"{d}/sshd.log")
    # sshd needs an absolute path (it re-execs itself); own session so terminal signals don't reach it
    proc = subprocess.Popen(
        [SSHD, "-D", "-f", f"{d}/sshd_config", "-E", server.log],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline, last = time.monotonic() + 20, ""
        while True:  # up only once a full login round trip works
            if proc.poll() is not None:
                last = f"sshd exited with {proc.returncode}"
            else:
                r = subprocess.run(server.ssh("true"), capture_output=True, text=True, timeout=15)
                if r.returncode == 0:
                    break
                last = r.stderr.strip()
            if proc.poll() is not None or time.monotonic() > deadline:
                log = open(server.log).read()[-2000:] if os.path.exists(server.log) else ""
                raise RuntimeError(f"sshd on {host}:{port} not usable ({last}); log tail:\n{log}")
            time.sleep(0.25)
        yield server
    finally:
        _kill_all(token, proc)


@pytest.fixture
def ssh_server(tmp_path) -> Iterator[SshServer]:
    reason = ensure_sshd()
    if reason:
        pytest.skip(reason)
    with sshd(str(tmp_path)) as server:
        yield server
