"""glibc's allocator told to keep the memory a CPU rank frees, in every process that trains on CPU.

A training step allocates and frees buffers of tens to hundreds of MB: FSDP2's per-unit gradient buffers, the
activations, the output head's logits, gloo's staging. glibc serves every request above its mmap threshold
(32 MiB at most) with a fresh mapping and unmaps it on free, so the next step takes a page fault for every
4 KiB page again and the kernel zeroes each one. With `MALLOC_MMAP_MAX_=0` (no mappings: the heap serves
everything) and `MALLOC_TRIM_THRESHOLD_` above any rank's heap (freed memory is never returned), a freed buffer
is reused by the next step. Measured on the 2-core machine, gpt3-small on 4 forked ranks, dp2 x pp2 with one
micro-batch of 4 (`benchmarks/vs_deepspeed/breakdown.py`, two runs each, seconds per step): ddp 10.3 / 12.1 ->
7.4 / 6.7, fsdp 9.7 / 9.9 -> 7.8 / 8.8, zero1 7.3 / 9.6 -> 7.8 / 7.7; ddp's system CPU time 43-44 -> 23-26 s.
The price is resident memory: each rank holds its heap at its peak. Over 40 ddp steps the ranks' RSS rose to
2.5-2.85 GB by step 16 and stayed there (one rank crept by 90 MB more), against 2.0-2.3 GB without; the
median step was 7.0 s against 10.2 s.

glibc reads these variables once, when the process's allocator starts, so a process that is about to train on
CPU puts them in its environment and starts itself again (`os.execve`, before torch is imported); the ranks
it forks inherit the allocator. Hosts with a GPU are left alone (their ranks' large buffers are device
memory), as is a process whose environment already names either variable (the user's choice), and
`ELASTIC_TRAINER_CPU_ALLOCATOR=system` turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4000000000"}
SWITCH_ENV = "ELASTIC_TRAINER_CPU_ALLOCATOR"
SWITCH_VALUES = ("keep", "system")
"""`keep` (the default): freed memory kept on CPU hosts; `system`: glibc's defaults (no restart)."""
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")
"""A host with any of these has a GPU driver (NVIDIA, AMD): its ranks train on the GPU."""


def additions(environ: dict[str, str] | os._Environ, gpu_devices: tuple[str, ...] = GPU_DEVICES) -> dict[str, str]:
    """The variables a process that trains on this host should add to its environment (empty: none)."""
    if environ.get(SWITCH_ENV) == "system" or any(k in environ for k in KEEP_FREED):
        return {}
    if platform.libc_ver()[0] != "glibc" or any(os.path.exists(p) for p in gpu_devices):
        return {}
    return dict(KEEP_FREED)


def check_switch() -> None:
    """A SWITCH_ENV this version does not know: one line and the bad-input exit code."""
    switch = os.environ.get(SWITCH_ENV)
    if switch and switch not in SWITCH_VALUES:
        from elastic_trainer.elastic.exit_codes import ERROR_MARK, EXIT_BAD_INPUT

        print(
            f"{ERROR_MARK}{SWITCH_ENV}={switch!r} is not valid (valid: {', '.join(SWITCH_VALUES)})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_BAD_INPUT)


def restart_keeping_freed_memory() -> None:
    """Start this process again with KEEP_FREED where `additions` says so (it never returns then). Only for a
    process's own entry point (`python -m ...` or a console script), before torch is imported."""
    check_switch()
    add = additions(os.environ)
    if not add or "torch" in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, **add})


def kept_bytes() -> int | None:
    """This process's anonymous resident bytes (`RssAnon`): with freed memory kept, its heap at its largest,
    plus the interpreter's and torch's own; None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
