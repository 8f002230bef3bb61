"""Hosts files (both forms), host-name strictness, and the machine facts the launcher needs."""

from __future__ import annotations

import os
import socket

import pytest

from elastic_trainer.config import ConfigError
from elastic_trainer.launch import hosts as hosts_mod
from elastic_trainer.launch.hosts import (
    Host,
    HostsError,
    default_slots,
    detected_gpus,
    interface_ipv4,
    is_local,
    parse_hosts,
    read_hosts,
    valid_host_name,
)

SUFFIX = "(expected 'HOST' or 'HOST slots=N')"


def assert_one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "\r" not in message and len(message) < 250, message
    return message


# ---------------------------------------------------------------- well-formed files


def test_bare_form_takes_default_slots():
    assert parse_hosts("node1\nnode2\n", 8) == [Host("node1", 8, 1), Host("node2", 8, 2)]


def test_slots_form_overrides_default():
    hosts = parse_hosts("worker-0 slots=4\nworker-1 slots=16", 8)
    assert hosts == [Host("worker-0", 4, 1), Host("worker-1", 16, 2)]


def test_mixed_forms_comments_blank_lines_tabs_and_addresses():
    text = (
        "# cluster A\n"
        "\n"
        "  node1.example.com   slots=2  # two GPUs\n"
        "\tnode2\t\n"
        "   # indented comment\n"
        "10.0.0.3\tslots=1\n"
        "fe80::1 slots=3\r\n"
        "::1#trailing comment right after the name\n"
        "gpu-box-7  \n"
        "   \t  \n"
    )
    assert parse_hosts(text, 8) == [
        Host("node1.example.com", 2, 3),
        Host("node2", 8, 4),
        Host("10.0.0.3", 1, 6),
        Host("fe80::1", 3, 7),
        Host("::1", 8, 8),
        Host("gpu-box-7", 8, 9),
    ]


def test_names_are_kept_as_written_and_slots_may_be_large():
    assert parse_hosts("Node-A.Example.COM slots=0128", 1) == [Host("Node-A.Example.COM", 128, 1)]


def test_hosts_error_is_a_config_error():
    assert issubclass(HostsError, ConfigError) and issubclass(HostsError, ValueError)


@pytest.mark.parametrize("bad", [0, -1, True, "8", 2.0, None])
def test_default_slots_must_be_positive_int(bad):
    with pytest.raises(HostsError, match="--gpus-per-host") as e:
        parse_hosts("node1", bad)
    assert_one_line(e)


# ---------------------------------------------------------------- malformed files

MALFORMED = [
    # (id, text, line, fragment of the message)
    ("duplicate-bare", "a\nb\na", 3, "host 'a' is listed twice (lines 1 and 3)"),
    ("duplicate-case", "node1\nNODE1 slots=2", 2, "listed twice (lines 1 and 2)"),
    ("duplicate-slots", "a slots=2\n\nb slots=2\na slots=4", 4, "listed twice (lines 1 and 4)"),
    ("duplicate-ipv6-spelling", "::1\n0:0::1 slots=2", 2, "listed twice (lines 1 and 2)"),
    ("slots-empty", "ok\na slots=", 2, "'slots=' has no value"),
    ("slots-zero", "ok\na slots=0", 2, "slots='0' must be positive"),
    ("slots-zeros", "a slots=000", 1, "slots='000' must be positive"),
    ("slots-negative", "ok\nb\na slots=-2", 3, "slots='-2' is negative"),
    ("slots-word", "a slots=abc", 1, "slots='abc' is not an integer"),
    ("slots-float", "a slots=1.5", 1, "slots='1.5' is not an integer"),
    ("slots-plus", "a slots=+2", 1, "slots='+2' is not an integer"),
    ("slots-suffix", "a slots=2x", 1, "slots='2x' is not an integer"),
    ("slots-unicode-digit", "a slots=\u00b2", 1, "is not an integer"),
    ("slots-double-eq", "a slots==2", 1, "slots='=2' is not an integer"),
    ("slots-no-eq", "a slots", 1, "unknown option 'slots'"),
    ("slots-spaced", "a slots = 2", 1, "unexpected '=' after 'slots'"),
    ("other-key", "a gpus=4", 1, "unknown option 'gpus=4'"),
    ("slots-colon", "a slots:4", 1, "unknown option 'slots:4'"),
    ("slots-upper", "a SLOTS=4", 1, "unknown option 'SLOTS=4'"),
    ("bare-number", "a 4", 1, "unknown option '4'"),
    ("second-name-bare", "a b", 1, "unknown option 'b'"),
    ("slots-twice", "a slots=2 slots=3", 1, "'slots=' is given twice"),
    ("third-token-bare", "ok\na b c", 2, "unexpected 'c' after 'b'"),
    ("third-token-slots", "a slots=2 extra", 1, "unexpected 'extra' after 'slots=2'"),
    ("missing-name", "ok\nslots=4", 2, "missing host name before 'slots=4'"),
    ("bad-name-bare", "user@host", 1, "'user@host' is not a valid hostname or IP address"),
    ("bad-name-slots", "ok\nuser@host slots=2", 2, "'user@host' is not a valid hostname or IP address"),
    ("port-bare", "host:22", 1, "'host:22' is not a valid hostname"),
    ("port-slots", "host:22 slots=2", 1, "'host:22' is not a valid hostname"),
    ("underscore-bare", "a_b", 1, "'a_b' is not a valid hostname"),
    ("underscore-slots", "a_b slots=1", 1, "'a_b' is not a valid hostname"),
    ("bad-ipv4-bare", "999.1.1.1", 1, "'999.1.1.1' is not a valid hostname"),
    ("bad-ipv4-slots", "10.0.0 slots=2", 1, "'10.0.0' is not a valid hostname"),
    ("bracketed-ipv6", "[::1] slots=2", 1, "'[::1]' is not a valid hostname"),
    ("ipv6-zone", "fe80::1%eth0", 1, "'fe80::1%eth0' is not a valid hostname"),
]


@pytest.mark.parametrize("text, line, fragment", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_line(text, line, fragment):
    with pytest.raises(HostsError) as e:
        parse_hosts(text, 8)
    message = assert_one_line(e)
    assert message.startswith(f"hosts.txt:{line}: "), message
    assert fragment in message, message
    if "listed twice" not in fragment:
        assert message.endswith(SUFFIX), message


@pytest.mark.parametrize("text", ["", "\n\n", "# just a comment\n   # another\n\t\n"])
def test_no_hosts(text):
    with pytest.raises(HostsError) as e:
        parse_hosts(text, 8, source="cluster.hosts")
    assert assert_one_line(e) == "cluster.hosts: no hosts (one per line: 'HOST' or 'HOST slots=N')"


INJECTIONS = [
    "a; touch /tmp/x",
    "a;touch",
    "$(touch /tmp/x)",
    "`touch /tmp/x`",
    "a && b",
    "a&&b",
    "a || b",
    "a|b",
    "a slots=2; rm -rf /",
    "a slots=2;reboot",
    "a slots=$(id)",
    "a\\nb",  # a literal backslash-n escape
    "a\x0bb",  # vertical tab: splits into two tokens
    "a\x00b",
    "a\x1b[31mred",
    "'a'",
    '"a"',
    "a>b",
    "a<b",
    "~root",
    "a/b",
    "*",
    "a\\ b",
    "n\u00f6de",
    "\uff10.0.0.1",  # fullwidth digit
    "x" * 300,
    "x" * 300 + " slots=2",
]


@pytest.mark.parametrize("line", INJECTIONS, ids=range(len(INJECTIONS)))
def test_shell_metacharacters_are_rejected(line):
    with pytest.raises(HostsError) as e:
        parse_hosts(f"good\n{line}\n", 8)
    message = assert_one_line(e)
    assert message.startswith("hosts.txt:2: "), message


def test_long_tokens_are_shortened_in_messages():
    with pytest.raises(HostsError) as e:
        parse_hosts("y" * 5000, 8)
    message = assert_one_line(e)
    assert "..." in message and "y" * 61 not in message
    with pytest.raises(HostsError) as e:
        parse_hosts("a slots=" + "9x" * 1000, 8)
    assert "..." in assert_one_line(e)


def test_control_characters_are_shown_escaped():
    with pytest.raises(HostsError) as e:
        parse_hosts("a\x1b[2Jb", 8)
    assert "\\x1b" in assert_one_line(e) and "\x1b" not in str(e.value)


# ---------------------------------------------------------------- host names

LABEL63 = "a" * 63
NAME253 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])


@pytest.mark.parametrize(
    "name",
    [
        "localhost",
        "node1",
        "a",
        "1a",
        "a-b",
        "a--b",
        "a.b.c",
        "Node1.Example.COM",
        "123abc",
        "a.1b",
        LABEL63,
        NAME253,
        "10.0.0.1",
        "127.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "2001:db8::8a2e:370:7334",
        "::ffff:10.0.0.1",
    ],
)
def test_valid_host_names(name):
    assert valid_host_name(name) is True


@pytest.mark.parametrize(
    "name",
    [
        "",
        " ",
        "a b",
        "a\n",
        "a\nb",
        "\tb",
        "user@host",
        "host:22",
        "1.2.3.4:22",
        "a_b",
        "-a",
        "a-",
        "a.-b",
        "a..b",
        ".a",
        "a.",
        "localhost.",
        "$(reboot)",
        "a;rm -rf /",
        "`id`",
        "a|b",
        "a&",
        ">a",
        "'a'",
        '"a"',
        "a'b",
        "*",
        "a/b",
        "~a",
        "a\\b",
        "a,b",
        "a=b",
        "n\u00f6de",
        "\u0661\u0662.com",
        "a" * 64,
        NAME253 + "e",
        "10.0.0",
        "999.1.1.1",
        "256.1.1.1",
        "1.2.3.4.5",
        "010.0.0.1",
        "1",
        "[::1]",
        "fe80::1%eth0",
        "fe80::1%1",
        ":::1",
        "1::2::3",
        "gggg::1",
        "0x7f.0.0.1",
        None,
        5,
        b"node1",
    ],
)
def test_invalid_host_names(name):
    assert valid_host_name(name) is False


# ---------------------------------------------------------------- read_hosts


def test_read_hosts_reads_a_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("\ufeffnode1 slots=2\r\nnode2\r\n", encoding="utf-8")  # BOM and CRLF from Windows editors
    assert read_hosts(str(path), 4) == [Host("node1", 2, 1), Host("node2", 4, 2)]


def test_read_hosts_names_the_file_in_line_errors(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1\nnode_2\n")
    with pytest.raises(HostsError) as e:
        read_hosts(str(path), 4)
    assert assert_one_line(e).startswith(f"{path}:2: ")


def test_read_hosts_missing_file(tmp_path):
    with pytest.raises(HostsError, match=r"does not exist.*--hosts FILE") as e:
        read_hosts(str(tmp_path / "nope"), 4)
    assert str(tmp_path / "nope") in assert_one_line(e)


def test_read_hosts_folder(tmp_path):
    with pytest.raises(HostsError, match=r"is a folder.*--hosts FILE") as e:
        read_hosts(str(tmp_path), 4)
    assert str(tmp_path) in assert_one_line(e)


def test_read_hosts_not_utf8(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"node1\n\xff\xfenode2\n")
    with pytest.raises(HostsError, match=r"is not UTF-8") as e:
        read_hosts(str(path), 4)
    assert str(path) in assert_one_line(e)


def test_read_hosts_unreadable(tmp_path, monkeypatch):
    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(hosts_mod, "open", denied, raising=False)  # chmod 000 does not stop root
    with pytest.raises(HostsError, match=r"cannot be read: Permission denied") as e:
        read_hosts(str(tmp_path / "hosts"), 4)
    assert str(tmp_path / "hosts") in assert_one_line(e)


# ---------------------------------------------------------------- this machine


@pytest.mark.parametrize("name", ["localhost", "LocalHost", "127.0.0.1", "127.0.0.2", "127.255.0.9", "::1"])
def test_is_local_loopback(name):
    assert is_local(name) is True


def test_is_local_own_hostname():
    assert is_local(socket.gethostname()) is True
    assert is_local(socket.gethostname().upper()) is True


def test_is_local_false_for_other_hosts():
    assert is_local("example.invalid") is False
    assert is_local("10.255.255.1") is ("10.255.255.1" in hosts_mod._own_names())
    assert is_local("a;b") is False and is_local("") is False


def test_is_local_never_resolves_the_name(monkeypatch):
    is_local("localhost")  # the machine's own names are cached now

    def no_dns(*args, **kwargs):
        raise AssertionError("is_local looked up a name")

    for fn in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getfqdn"):
        monkeypatch.setattr(socket, fn, no_dns)
    assert is_local("unreachable-node-17.example.invalid") is False
    assert is_local("10.1.2.3") is ("10.1.2.3" in hosts_mod._own_names())


def test_interface_ipv4_loopback():
    if "lo" not in [name for _, name in socket.if_nameindex()]:
        pytest.skip("no 'lo' interface here")
    assert interface_ipv4("lo") == "127.0.0.1"
    assert "127.0.0.1" in hosts_mod._own_names()


@pytest.mark.parametrize("iface", ["nosuchif0", "a;b", "x" * 16, "", "eth0 ", "$(id)", "lo\n"])
def test_interface_ipv4_bad_interface(iface):
    with pytest.raises(HostsError, match=r"^--detect-self-ip .*interfaces: ") as e:
        interface_ipv4(iface)
    assert_one_line(e)


@pytest.mark.parametrize(
    "value, count",
    [
        ("0,1,2", 3),
        ("", 0),
        ("-1", 0),
        (" ", 0),
        ("0", 1),
        ("0,,1,", 2),
        ("GPU-1a2b,GPU-3c4d", 2),
        ("0,-1,1", 1),
    ],
)
def test_detected_gpus_from_cuda_visible_devices(monkeypatch, value, count):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert detected_gpus() == count
    assert default_slots() == (count or 4)


def test_detected_gpus_from_proc(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real_listdir = os.listdir

    def fake_listdir(path="."):
        if str(path).rstrip("/") == "/proc/driver/nvidia/gpus":
            return ["0000:17:00.0", "0000:65:00.0"]
        return real_listdir(path)

    monkeypatch.setattr(hosts_mod.os, "listdir", fake_listdir)
    assert detected_gpus() == 2 and default_slots() == 2


def test_detected_gpus_without_nvidia(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def missing(path="."):
        raise FileNotFoundError(path)

    monkeypatch.setattr(hosts_mod.os, "listdir", missing)
    assert detected_gpus() == 0 and default_slots() == 4
