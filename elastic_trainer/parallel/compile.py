"""`--compile`: torch.compile applied to each transformer block, as torchtitan does.

Each block is compiled in place (`nn.Module.compile`), after tensor parallelism and activation recompute and
before data parallelism, so parameter names and checkpoints are the same as eager and the data-parallel
wrappers' hooks (FSDP2's gathers, DDP's reductions, ZeRO-1's gradient hooks) and the pipeline schedule stay
outside the compiled code. All blocks run the same code (the model computes each layer's dropout keys outside
its block, model/gpt.py), so one compiled graph serves every block of a rank: a compile costs one block's
compile, whatever the depth.

The compile cache (inductor's FX graph and autograd caches, and Triton's kernels on GPUs) lives in
`--compile-cache DIR`, by default `compile-cache/` beside the metrics file (the run folder under the
launcher), so a restart or a reconfiguration into a layout seen before loads its kernels instead of compiling
them (what is left is dynamo's tracing). Graphs depend on the local shapes: a new micro-batch size or tensor-
parallel degree compiles once more.

Numerics: compiled fp32 kernels fuse and reorder float operations, so losses differ from eager by rounding
(measured in tests/distributed/test_compile.py and documented in the README); compiled runs of different
layouts agree with each other as closely as eager ones do.
"""

from __future__ import annotations

import os
import shutil

from torch import nn

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its caches (Triton's go in a folder beneath it unless TRITON_CACHE_DIR says otherwise)."""


def compiler_problem(device_type: str) -> str | None:
    """The one-line reason torch.compile cannot run on this machine, else None: inductor's CPU backend needs
    a C++ compiler (CXX, else g++ or clang++); on GPUs it needs Triton."""
    if device_type == "cpu":
        names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++"]
        if not any(shutil.which(n) for n in names):
            return (
                f"--compile on CPU needs a C++ compiler ({' or '.join(names)} on PATH; "
                "e.g. apt install g++), or leave --compile out"
            )
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return "--compile on GPUs needs the triton package (pip install triton), or leave --compile out"
    return None


def use_cache(folder: str | None) -> None:
    """Point inductor's caches at `folder` (made if missing); None leaves them where they are."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        os.environ[CACHE_ENV] = os.path.abspath(folder)


def compile_blocks(model: nn.Module) -> int:
    """Compile every transformer block of `model` (a GPT or one pipeline stage of it) in place; returns how
    many."""
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile()
    return len(blocks)


def report() -> dict:
    """What this process has compiled so far: distinct graphs, seconds compiling (dynamo's tracing and
    inductor's forward and backward compiles), and the compile cache's hits and misses (inductor's FX graphs;
    a hit skips code generation and the C++/Triton build)."""
    from torch._dynamo.utils import compile_times, counters

    try:
        names, values = compile_times(repr="csv", aggregate=True)
        spent = dict(zip(names, (float(v) for v in values)))
    except (TypeError, ValueError):  # a torch whose private timing table changed: no seconds, the rest stays
        spent = {}
    seconds = spent.get("_compile.compile_inner", 0.0) + spent.get("compile_fx.<locals>.bw_compiler", 0.0)
    inductor = counters["inductor"]
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "compile_s": round(seconds, 2),
        "cache_hits": int(inductor["fxgraph_cache_hit"]),
        "cache_misses": int(inductor["fxgraph_cache_miss"]),
    }


def report_line(r: dict, blocks: int) -> str:
    return (
        f"[compile] rank 0's {blocks} blocks as {r['graphs']} graph(s) in {r['compile_s']:.1f} s "
        f"(compile cache: {r['cache_hits']} hit(s), {r['cache_misses']} miss(es) in "
        f"{os.environ.get(CACHE_ENV) or 'inductor default'})"
    )
