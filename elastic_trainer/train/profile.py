"""Profiler traces of chosen steps (`--profile-steps A:B`): `torch.profiler` on every rank from the start of
global step A to the end of step B, one Chrome-trace file per rank in `profile/` beside the metrics file (the
run folder under the launcher): `rank{R}-steps{A}-{B}.json`, to open in Perfetto (ui.perfetto.dev) or
chrome://tracing. A start that does not train step A (it resumed after it) traces nothing.

The step's phases carry labels (`torch.profiler.record_function`): `forward M` and `backward M` per
micro-batch (under pipeline parallelism too: parallel/pipeline.py labels each stage's), `zero1 reduce-scatter`,
`clip grad norm`, `loss all-reduce`, `optimizer`, `sync params`; each collective appears as the profiler
records it (for example `gloo:all_reduce`, `nccl:all_reduce`), inside the phase that issued it.
"""

from __future__ import annotations

import os
import re

from elastic_trainer.config import ConfigError
from elastic_trainer.train.metrics import beside_metrics


def parse(text: str | None) -> tuple[int, int] | None:
    """`A:B` (global steps, 1 <= A <= B) as (A, B); None for None; ConfigError (one line) otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ConfigError(
            f"--profile-steps {text!r} must be A:B, the first and last global step to trace "
            "(1 <= A <= B), for example 5:7"
        )
    return int(m.group(1)), int(m.group(2))


class StepProfiler:
    """`before(step)` ahead of each step (the global step about to run), `after(step)` once it is done."""

    def __init__(self, steps: str | None, metrics_file: str | None, rank: int, device_type: str):
        self.window = parse(steps)
        self.path = (
            None
            if self.window is None
            else beside_metrics(metrics_file, "profile") / f"rank{rank}-steps{self.window[0]}-{self.window[1]}.json"
        )
        self.device_type = device_type
        self._prof = None

    def before(self, step: int) -> None:
        if self.window is None or self._prof is not None or step != self.window[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def after(self, step: int) -> None:
        if self._prof is not None and step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop tracing (at step B, or earlier when the run stops first) and write the trace."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.path.parent, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
