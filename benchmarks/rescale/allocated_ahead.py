"""Writing into shared memory allocated ahead, beside writing into new pages (checkpoint/spare.py's reason).

    .venv/bin/python benchmarks/rescale/allocated_ahead.py            # 1 GiB, 3 rounds
    .venv/bin/python benchmarks/rescale/allocated_ahead.py --gib 4 --rounds 2

Per round, in alternating order: `os.pwrite` of the same buffer into a new file of /dev/shm (what a hand-over
pays when its files are made at the write), and into a file allocated before with `os.posix_fallocate` (what
it pays when the stopping rank allocated its files once the next world was started; the allocation is timed
apart, it is off the critical path). Between measurements the files are removed and the process sleeps
(`--rest`), so that freed pages go back as they do between two hand-overs. Prints medians and the ratio
new / allocated (above 1: allocating ahead makes the write faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def write(path: str, data: memoryview, ahead: bool) -> tuple[float, float]:
    """(allocation seconds, write seconds) of `data` into `path`."""
    allocate_s = 0.0
    if ahead:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, len(data))
        os.close(fd)
        allocate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if ahead else os.O_TRUNC), 0o600)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)
    os.close(fd)
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return allocate_s, seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rest", type=float, default=3.0, help="seconds between measurements")
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args(argv)
    data = memoryview(np.ones(int(args.gib * (1 << 30)), dtype=np.uint8))
    path = os.path.join(args.dir, f"elastic-trainer-allocated-ahead-{os.getpid()}")
    new, ahead, allocate = [], [], []
    for r in range(args.rounds):
        for first in ((False, True) if r % 2 == 0 else (True, False)):
            a, w = write(path, data, first)
            (ahead if first else new).append(w)
            if first:
                allocate.append(a)
            time.sleep(args.rest)
    gb = len(data) / 1e9
    print(f"{gb:.2f} GB into {args.dir}, {args.rounds} rounds (medians):")
    print(f"  into new pages        {statistics.median(new):6.3f} s  ({gb / statistics.median(new):5.2f} GB/s)   runs "
          + ", ".join(f"{x:.3f}" for x in new))
    print(f"  into allocated pages  {statistics.median(ahead):6.3f} s  ({gb / statistics.median(ahead):5.2f} GB/s)   runs "
          + ", ".join(f"{x:.3f}" for x in ahead))
    print(f"  the allocation ahead  {statistics.median(allocate):6.3f} s  (off the critical path)")
    print(f"  ratio new / allocated {statistics.median(new) / statistics.median(ahead):.2f}")


if __name__ == "__main__":
    main()
