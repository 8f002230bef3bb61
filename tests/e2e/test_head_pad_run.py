"""benchmarks/gpu/head_pad.py run as a program in its small form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_script_runs_its_small_form(tmp_path):
    out = tmp_path / "h.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/head_pad.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["parity"][0]["multiple"] == 64
    assert got["parity"][0]["grad_rel_diff_padded"] < 1e-9 and got["head"][0]["ms_64"] > 0
