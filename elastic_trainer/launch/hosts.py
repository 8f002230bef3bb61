"""Hosts files (`HOST` or `HOST slots=N` per line) and facts about this machine; no torch import.

Parsing is strict: every name must be a plain hostname or IP address, which is what guarantees nothing from
the file can inject into the ssh/shell commands built from it later.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass

from elastic_trainer.config import ConfigError, positive_int

EXPECTED = "(expected 'HOST' or 'HOST slots=N')"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_IFACE = re.compile(r"[A-Za-z0-9._:-]{1,15}")
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's address


class HostsError(ConfigError):
    """A hosts file (or a host-related option) is invalid; one line naming the file, the line and what is wrong."""


@dataclass(frozen=True)
class Host:
    """One line of a hosts file."""

    name: str
    """As written: hostname, alias, IPv4 or IPv6 address."""
    slots: int
    """GPUs (ranks) on this host."""
    line: int
    """1-based line number in the file (0 when not from a file)."""


def _show(token: str, limit: int = 60) -> str:
    """repr() of a bad token, shortened: control characters stay visible and the message stays one line."""
    return repr(token) if len(token) <= limit else repr(token[:limit]) + "..."


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if re.fullmatch(r"[0-9A-Fa-f:.]+", name):  # ipaddress takes "%zone" suffixes; never valid here
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(name)
    return None


def valid_host_name(name: str) -> bool:
    """Whether `name` is an IPv4/IPv6 address or an RFC 1123 hostname (so it is safe in a shell command)."""
    if not isinstance(name, str):
        return False
    if _ip(name) is not None:
        return True
    # A last label of digits only ("10.0.0", "999.1.1.1") is a malformed address, not a hostname.
    return len(name) <= 253 and bool(_HOSTNAME.fullmatch(name)) and not name.rsplit(".", 1)[-1].isdigit()


def _line_slots(tokens: list[str], default: int) -> int | str:
    """The slots of one line's tokens (`default` for a bare name), or what is wrong with them."""
    name, options = tokens[0], tokens[1:]
    if not valid_host_name(name):
        if name.startswith("slots"):
            return f"missing host name before {_show(name)}"
        return f"{_show(name)} is not a valid hostname or IP address"
    if len(options) > 1:
        if options[1].startswith("slots="):
            return "'slots=' is given twice"
        return f"unexpected {_show(options[1])} after {_show(options[0])}"
    if not options:
        return default
    key, eq, value = options[0].partition("=")
    if key != "slots" or not eq:
        return f"unknown option {_show(options[0])}"
    if not value:
        return "'slots=' has no value"
    if re.fullmatch(r"[0-9]+", value):  # ASCII digits only: int() would also take "+2", " 2" and "²"
        return int(value) if int(value) > 0 else f"slots={_show(value)} must be positive"
    if re.fullmatch(r"-[0-9]+", value):
        return f"slots={_show(value)} is negative"
    return f"slots={_show(value)} is not an integer"


def parse_hosts(text: str, default_slots: int, source: str = "hosts.txt") -> list[Host]:
    """The hosts of a hosts file's text, in order; HostsError (one line, naming source:line) on anything else."""
    positive_int("--gpus-per-host", default_slots, HostsError)
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        slots = _line_slots(tokens, default_slots)
        if isinstance(slots, str):
            raise HostsError(f"{source}:{number}: {slots} {EXPECTED}")
        name, ip = tokens[0], _ip(tokens[0])
        key = str(ip) if ip is not None else name.lower()  # "::1" == "0::1", "Node1" == "node1"
        if key in seen:
            raise HostsError(f"{source}:{number}: host {_show(name)} is listed twice (lines {seen[key]} and {number})")
        seen[key] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise HostsError(f"{source}: no hosts (one per line: 'HOST' or 'HOST slots=N')")
    return hosts


def read_hosts(path: str, default_slots: int) -> list[Host]:
    """parse_hosts() of the file at `path`; a missing, unreadable or non-UTF-8 file is a one-line HostsError."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM from Windows editors is not part of a name
            text = f.read()
    except FileNotFoundError:
        raise HostsError(f"hosts file {path!r} does not exist (pass --hosts FILE)") from None
    except IsADirectoryError:
        raise HostsError(f"hosts file {path!r} is a folder (pass --hosts FILE)") from None
    except UnicodeDecodeError as e:
        raise HostsError(f"hosts file {path!r} is not UTF-8 text (byte {e.start}); pass --hosts FILE") from None
    except OSError as e:
        raise HostsError(f"hosts file {path!r} cannot be read: {e.strerror or e} (pass --hosts FILE)") from None
    return parse_hosts(text, default_slots, source=path)


def _interfaces() -> list[str]:
    try:
        return [iface for _, iface in socket.if_nameindex()]
    except OSError:
        return []


@functools.lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    """This machine's names and interface IPv4 addresses (lower case); computed once."""
    names = {"localhost", socket.gethostname().lower()}
    fqdn = socket.getfqdn().lower()
    names |= {fqdn, fqdn.split(".", 1)[0]}
    for iface in _interfaces():
        with contextlib.suppress(HostsError):  # interfaces without an IPv4 address
            names.add(interface_ipv4(iface))
    return frozenset(names - {""})


def is_local(name: str) -> bool:
    """Whether `name` is this machine (start it without ssh). Never resolves `name` itself via DNS."""
    ip = _ip(name)
    if ip is not None:
        return ip.is_loopback or str(ip) in _own_names()
    return valid_host_name(name) and name.lower() in _own_names()


def interface_ipv4(iface: str) -> str:
    """The IPv4 address of network interface `iface` (Linux); a one-line HostsError when it has none."""
    known = f"(interfaces: {', '.join(_interfaces()) or 'none found'})"
    if not isinstance(iface, str) or not _IFACE.fullmatch(iface):
        raise HostsError(f"--detect-self-ip {_show(str(iface))}: not an interface name {known}")
    try:
        import fcntl  # Linux only; imported here so the module loads everywhere

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", iface[:15].encode()))
    except (OSError, ImportError):
        raise HostsError(f"--detect-self-ip {iface!r}: no such interface or no IPv4 address {known}") from None
    return socket.inet_ntoa(packed[20:24])


def detected_gpus() -> int:
    """GPUs on this machine without importing torch: CUDA_VISIBLE_DEVICES, else /proc/driver/nvidia/gpus/."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA ignores every device from the first invalid entry on, so "-1" hides all.
        return next((i for i, e in enumerate(entries) if e.startswith("-")), len(entries))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def default_slots() -> int:
    """Ranks per host when neither the hosts file nor --gpus-per-host says: the GPUs here, else 4 CPU ranks."""
    return detected_gpus() or 4
