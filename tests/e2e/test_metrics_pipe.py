"""Progress lines reach a pipe while a job runs (a real child process writing to a pipe)."""

from __future__ import annotations

CHILD = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("metrics_under_test", sys.argv[1])
metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(metrics)
log = metrics.MetricsLog(None, enabled=True)
log.info("[train] started")
sys.stdin.readline()
log.write({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0, "step_time_s": 0.1})
sys.stdin.readline()
"""


def test_progress_lines_reach_a_pipe_while_the_job_runs():
    """Under the launcher stdout is a pipe, block-buffered: each line must be flushed as it is printed, or the
    user sees nothing until the job ends. The child (a plain interpreter loading metrics.py alone) waits after
    each line until the parent has read it."""
    import os
    import selectors
    import subprocess
    import sys

    from elastic_trainer.train import metrics

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, metrics.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        got = []
        for _ in range(2):
            assert sel.select(timeout=10), f"no line while the job runs (got {got})"
            got.append(child.stdout.readline())
            child.stdin.write("\n")
            child.stdin.flush()
        assert got == [
            "[train] started\n",
            "step 1 | loss 2.0000 | lr 1.00e-03 | grad_norm 0.500 | 10 tok/s | 0.100 s/step\n",
        ]
    finally:
        child.kill()
        child.wait()
