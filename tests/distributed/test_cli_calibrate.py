"""elastic-trainer plan --calibrate: its measurements run on forked ranks of this machine."""

from __future__ import annotations

import pytest


def test_calibration_measurements_run_on_this_machine(monkeypatch):
    """The real measurements (a block, the head, memory, AdamW, gloo all-reduces, ranks at once) on tiny shapes;
    only what noise cannot change is checked: what was measured, and positive times."""
    import math

    import torch

    from elastic_trainer.parallel import calibrate
    from elastic_trainer.parallel.local_ranks import run_ranks

    cpu = torch.device("cpu")
    points = calibrate.measure_blocks(cpu, torch.float32, [(64, 128), (128, 256)], repeat=1)
    assert [(f, n) for f, n, _ in points] == [
        (3 * (24 * 128 * 64**2 + 2 * 128 * 128 * 64), 128),
        (3 * (24 * 256 * 128**2 + 2 * 256 * 128 * 128), 256),
    ]
    seen = {}

    def record(rows, ys):
        seen.update(rows=rows, ys=ys)
        return [1e-12, 1e-9]

    monkeypatch.setattr(calibrate, "GPU_HEAD_SHAPES", [(16, 64), (32, 128)])
    monkeypatch.setattr(calibrate, "fit_nonneg", record)
    assert calibrate.measure_head(cpu, torch.float32, tokens=32, repeat=1) == pytest.approx((1.0, 1.0))
    assert seen["rows"] == [[6.0 * 32 * 16 * 64, 32.0 * 64], [6.0 * 32 * 32 * 128, 32.0 * 128]]
    monkeypatch.setattr(calibrate, "CPU_HEAD_TOKENS", (32, 512))  # 16x the work: a difference noise cannot undo
    monkeypatch.setattr(calibrate, "CPU_LOGIT_TOKENS", 32)
    head_tflops, head_half, logit_ns = calibrate.measure_cpu_head(torch.float32, (64,), 512, repeat=1)
    assert math.isfinite(head_half) and head_half >= 0
    cpu_head = (head_tflops, logit_ns, calibrate.measure_embedding_grad(512, 64, repeat=1))
    per_rank = run_ranks(calibrate._all_reduce_times, 2, [2**10, 2**14], 1)
    assert len(per_rank) == 2 and all(len(r) == 2 for r in per_rank)
    measured = (
        [t for _, _, t in points]
        + seen["ys"]
        + list(cpu_head)
        + [t for r in per_rank for t in r]
        + [
            calibrate.measure_memory_bandwidth(cpu, numel=2**12, repeat=1),  # GB/s
            calibrate.measure_optimizer(cpu, numel=2**10, repeat=1),
        ]
    )  # ns per parameter
    assert all(math.isfinite(v) and v > 0 for v in measured), measured
    monkeypatch.setattr(calibrate, "CPU_SHAPES", [(64, 128)])  # the block the ranks time together
    assert 1.0 <= calibrate.measure_parallel_units(2) <= 2.0
