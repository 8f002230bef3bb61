"""A GPU state staged in host memory before DCP writes it: how a hand-over's state leaves the GPUs quickly.

DCP's FileSystemWriter takes GPU tensors one at a time, copies each to the host and `torch.save`s it, on one
thread. On an H100 that wrote 4.9 GB of GPT-3 XL's weights and moments into /dev/shm in 9.19 s (0.53 GB/s);
with 8 threads and files 5.10 s; copied first into pinned host memory (one pass of asynchronous copies, 0.09
s) and then written from there by 8 threads, 0.89 s (benchmarks/rescale/gpu_memory_path.py, 2026-11-26, torch
2.11). The host copy is made with DCP's own staging helpers (what its async_save uses): DTensors keep their
placements, so the files and the metadata are the ones a direct save writes, only from host tensors. The
hand-over's writer (`raw.Writer`) takes the same thread count: one file per thread.

A CPU state is written as it is, on one thread (its tensors are in host memory already; on the 2-core
machine more threads only contend).
"""

from __future__ import annotations

import os

import torch

MAX_WRITER_THREADS = 8


def is_on_gpu(state) -> bool:
    """Whether any tensor of the (nested) state lives on a GPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return any(is_on_gpu(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(is_on_gpu(v) for v in state)
    if isinstance(state, DTensor):
        return state.to_local().device.type == "cuda"
    return isinstance(state, torch.Tensor) and state.device.type == "cuda"


def to_host(state: dict, pin: bool = True) -> dict:
    """A copy of `state` in (pinned) host memory, its structure, DTensor placements and values unchanged."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    host = _create_cpu_state_dict(state, pin_memory=pin)
    _copy_state_dict(state, host, non_blocking=pin)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return host


def cloned(state):
    """A copy of a CPU `state`, its structure and DTensor placements unchanged: each tensor's own elements
    copied (DCP's helper above deep-copies a view's whole storage, and fails on ZeRO-1's flat buffers)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(v) for v in state)
    if isinstance(state, DTensor):
        local = state.to_local().detach().clone()
        return DTensor.from_local(
            local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def writer_threads(local_ranks: int) -> int:
    """Threads (and files) per rank for a staged write: up to 8, sharing the host's cores with its ranks."""
    return max(1, min(MAX_WRITER_THREADS, (os.cpu_count() or 1) // max(1, local_ranks)))


def for_writing(state: dict, local_ranks: int, say=print) -> tuple[dict, int]:
    """(what DCP writes, its writer's threads): a GPU state staged in pinned host memory with `writer_threads`,
    a CPU state as it is with one. When the host copy cannot be made (pinned memory refused: a container's
    RLIMIT_MEMLOCK, a host short of memory), this rank writes from the GPU as before and says so: the ranks
    need not agree, each one's files are its own."""
    if not is_on_gpu(state):
        return state, 1
    try:
        return to_host(state), writer_threads(local_ranks)
    except (RuntimeError, ImportError) as e:  # torch.cuda.OutOfMemoryError too; helpers a torch has moved
        say(
            f"[checkpoint] the state could not be staged in pinned host memory ({str(e).splitlines()[0]}); "
            "writing it from the GPU, more slowly",
            flush=True,
        )
        return state, 1
