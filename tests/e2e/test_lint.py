"""The tree is formatted and linted by ruff as pyproject.toml configures it (the pinned version of the dev extra)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return subprocess.run([find_ruff_bin(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [("format", "--check", "."), ("check", ".")], ids=["format", "check"])
def test_ruff(command):
    proc = ruff(*command)
    assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout}{proc.stderr}"


def test_ruff_finds_what_it_should(tmp_path):
    """A badly formatted file with an unused import fails both checks (so a clean result means something)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = [1,2]\n")
    config = ["--config", str(ROOT / "pyproject.toml")]
    assert ruff("format", "--check", *config, str(bad)).returncode == 1
    assert ruff("check", *config, str(bad)).returncode == 1
