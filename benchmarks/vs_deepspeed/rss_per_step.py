"""Step time and resident memory of each rank after every step: gpt3-small on 4 forked ranks, dp2 x pp2 with
one micro-batch of 4, to see what the CPU ranks' allocator (elastic_trainer/launch/allocator.py) costs in
memory and whether that memory stays flat.

    .venv/bin/python benchmarks/vs_deepspeed/rss_per_step.py ddp 40                       # freed memory kept
    ELASTIC_TRAINER_CPU_ALLOCATOR=system .venv/bin/python benchmarks/vs_deepspeed/rss_per_step.py ddp 16
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    from elastic_trainer.launch.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import run as bench  # noqa: E402  (this folder's run.py)

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def job(rank, world, layout, steps, tokens) -> list[tuple[float, int]]:
    bench.quiet()
    trainer = bench.our_trainer("gpt3-small", layout, 128, tokens)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        out.append((round(time.perf_counter() - t0, 2), round(rss_mb())))
    return out


def main() -> None:
    mode, steps = sys.argv[1], int(sys.argv[2])
    layout = Layout(2, 1, 2, 4, 1, dp_mode=mode)
    tokens = bench.tokens_for(load_model_config("gpt3-small"), 128)
    print(f"MALLOC_MMAP_MAX_={os.environ.get('MALLOC_MMAP_MAX_')}: (seconds, RSS MB) after each step, per rank")
    for r, rows in enumerate(run_ranks(job, 4, layout, steps, tokens, timeout=3000)):
        print(r, rows)


if __name__ == "__main__":
    main()
