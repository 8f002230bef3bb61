"""The hosts module stays light: a fresh interpreter imports it without torch."""

from __future__ import annotations


def test_hosts_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, elastic_trainer.launch.hosts; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
