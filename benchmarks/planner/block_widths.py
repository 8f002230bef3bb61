"""What `calibrate`'s CPU fits say at widths they were not measured at: one block's forward + backward timed at
widths 64 to 1024 and 128 and 512 tokens (calibrate.measure_blocks, one thread, freed memory kept as the ranks
keep it), fitted as calibrate fits them (t = F / R + (F / tokens) h / R + c) over some pairs of widths, with
each fit's error at every width; then the token embedding's backward per micro-batch and table element
(calibrate.measure_embedding_grad) at each width beside two passes at `--bandwidth`, the model's estimate
without it.

    python benchmarks/planner/block_widths.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # measured with the allocator the trainer's CPU ranks get
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import torch  # noqa: E402

from elastic_trainer.parallel import calibrate  # noqa: E402

WIDTHS, TOKENS = (64, 128, 256, 512, 768, 1024), (128, 512)
FITS = [tuple(sorted({d for d, _ in calibrate.CPU_SHAPES})), (256, 1024), (512, 1024), WIDTHS]
"""Widths fitted over: calibrate's own (CPU_SHAPES: 256 and 512), wider pairs, all of them."""


def fit_errors(points: dict, widths: tuple[int, ...]) -> tuple[tuple[float, float, float], dict]:
    """((GFLOP/s, half-rate tokens, ms per block) of calibrate's fit over `widths`, {(width, tokens): its relative
    error})."""
    tflops, half, overhead_ms = calibrate.fit_compute([v for (d, _), v in points.items() if d in widths])
    errors = {k: (f / (tflops * 1e12) * (1 + half / n) + overhead_ms * 1e-3) / t - 1 for k, (f, n, t) in points.items()}
    return (tflops * 1e3, half, overhead_ms), errors


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", type=float, default=58.8581, help="GB/s (the shipped cpu profile's)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = list(itertools.product(WIDTHS, TOKENS))
    points = dict(zip(shapes, calibrate.measure_blocks(torch.device("cpu"), torch.float32, shapes, repeat=3)))
    for (d, n), (f, _, t) in points.items():
        print(f"block {d:5d} x {n:4d} tokens: {t * 1e3:7.1f} ms ({f / t / 1e9:5.1f} GFLOP/s)", flush=True)
    out = {"blocks": [[d, n, f, t] for (d, n), (f, _, t) in points.items()], "fits": [], "embedding": []}
    for widths in FITS:
        (rate, half, overhead), errors = fit_errors(points, widths)
        print(
            f"fit over {widths}: {rate:.1f} GFLOP/s, half rate at {half:.1f} tokens, {overhead:.2f} ms; errors "
            + " ".join(f"{d}x{n} {e:+.1%}" for (d, n), e in errors.items()),
            flush=True,
        )
        out["fits"].append(
            {
                "widths": widths,
                "gflops": rate,
                "half_rate_tokens": half,
                "overhead_ms": overhead,
                "errors": [[d, n, e] for (d, n), e in errors.items()],
            }
        )
    estimate = 2 * 4 / args.bandwidth
    for d in WIDTHS:
        ns = calibrate.measure_embedding_grad(calibrate.CPU_HEAD_VOCAB, d)
        print(
            f"embedding {calibrate.CPU_HEAD_VOCAB} x {d}: {ns:.3f} ns per element and micro-batch "
            f"(two passes at {args.bandwidth:g} GB/s: {estimate:.3f})",
            flush=True,
        )
        out["embedding"].append([d, ns])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
