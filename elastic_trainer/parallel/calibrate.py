"""`elastic-trainer calibrate`: measure this machine and write a hardware profile for the planner.

What it times, each the best of a few repetitions (the machine's speed without interference from other
work) with one intra-op thread per rank, as the trainer runs its ranks on a CPU:
- one GPT block's forward + backward at several widths and micro-batch sizes; a non-negative least-squares
  fit of t = F / R + (F / tokens) * h / R + c gives the sustained rate R (`tflops`), the size effect h
  (`half_rate_tokens`) and the fixed time per block c (`layer_overhead_ms`);
- the output head: its softmax cross-entropy alone gives `logit_ns` (per logit); its three GEMMs alone at the
  job's width and vocabulary (`--model`; else widths 256 and 512 at 50257: CPU_HEAD_WIDTHS) and two
  micro-batch sizes (CPU_HEAD_TOKENS), fitted as t = F / H + (F / tokens) * h / H, give `head_tflops` H and
  `head_half_rate_tokens` h; on a GPU one fit of t = 6 * tokens * d * vocab / H + tokens * vocab * l over
  GPU_HEAD_SHAPES gives H and `logit_ns`;
- with `--compile`: the block at the largest shape eager and under torch.compile; the ratio of their times is
  `compiled_speedup`, which the planner applies to jobs run with `--compile`;
- on the CPU, the token embedding's backward at the same table (`embedding_grad_ns`); a large in-place add
  (`memory_bandwidth_gbs`) and clipping + an AdamW step (`optimizer_ns_per_param`);
- gloo all-reduces of 16 KB to 128 MB on 2..N forked local ranks, as many as the host has cores (the
  step-time model slows them as more ranks share the cores); a fit of the ring model
  t = 2 (n - 1) / n * bytes / B + 2 (n - 1) * L by relative error gives the bus bandwidth B and step
  latency L (one host: the same figures serve intra- and inter-host links; gloo's reduce-scatter costs an
  all-reduce);
- the block again on as many forked ranks as there are cores at once: their speed-up over one rank is
  `compute_units`, the parallel compute the host's ranks share.
On a CUDA device the compute figures are measured on it and the link figures are kept from --base; its blocks
run at device-bound shapes of three widths in sequences of 2048 (GPU_SHAPES), fitted with a fourth term per
token and unit of width (`activation_ns`: norms, activations, residual adds). `calibrate --model M` on a GPU
adds the host's time per block in each dp mode at M (parallel/calibrate_modes.py `measure_host`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic_trainer.config import ModelConfig
from elastic_trainer.model.gpt import Block, project_to_vocab
from elastic_trainer.parallel.engine import sum_of_squares
from elastic_trainer.parallel.gloo_comms import all_gather, reduce_scatter
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.hardware import CPU_KEPT_HEAP, GIB, Hardware
from elastic_trainer.plan.step_time import block_flops
from elastic_trainer.train.optim import implementation

CPU_SHAPES = [(256, 128), (256, 512), (512, 128), (512, 512)]  # (d_model, tokens per micro-batch)
GPU_SHAPES = [(1024, 8192), (1024, 16384), (2048, 4096), (2048, 16384), (4096, 4096), (4096, 8192)]
"""Sequences of GPU_SEQ_LEN, large enough that the device, not the host, sets the time (an H200, 2026-11-27: at
sequence 128, 1.6-4 ms, launch-bound, and 1133 TFLOP/s fitted, above its peak); three widths, so that the
memory-bound work per token and unit of width (`activation_ns`) is told apart from the GEMMs."""
SEQ_LEN = 128
GPU_SEQ_LEN = 2048
LINK_SIZES = [2**14, 2**18, 2**20, 2**22, 2**24, 2**26, 2**27]
"""Bytes per all-reduce, up to the job's (whole stages, hundreds of MB; FSDP units, tens). Up to 8 MB only, the
fit read the caches' bandwidth (2026-11-28: 3.2 GB/s, against 1.8 at 128-256 MB on two ranks), and the planner
ranked zero1 level with ddp where it ran 18 % slower (benchmarks/planner/README.md at commit 690c16d)."""


def timed(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Fastest seconds of fn() over `repeat` calls after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def fit_nonneg(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0, by trying each subset of features (few features)."""
    a, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    best, best_err = [0.0] * a.shape[1], float("inf")
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if (coef < 0).any():
                continue
            err = float(((a[:, cols] @ coef - y) ** 2).sum())
            if err < best_err:
                best, best_err = [0.0] * a.shape[1], err
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_blocks(
    device: torch.device, dtype: torch.dtype, shapes, repeat: int = 3, compiled: bool = False, seq_len: int = SEQ_LEN
) -> list[tuple[float, int, float]]:
    """[(forward+backward FLOPs, tokens, seconds)] of one block per (d_model, tokens) shape, in sequences of
    `seq_len`; `compiled`: under torch.compile (its first call, which compiles, is not timed)."""
    out = []
    for d, tokens in shapes:
        cfg = ModelConfig(n_layers=1, d_model=d, n_heads=max(1, d // 64), context_length=seq_len)
        block = Block(cfg).to(device, dtype)
        if compiled:
            block.compile()
        x = torch.randn(tokens // seq_len, seq_len, d, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        seconds = timed(lambda: block(x).backward(grad), repeat, _sync(device))  # noqa: F821  (del below)
        out.append((3 * block_flops(cfg, tokens, seq_len, 1), tokens, seconds))
        del block, x, grad
    return out


def fit_device(shapes, points: list[tuple[float, int, float]]) -> tuple[float, float, float, float]:
    """(TFLOP/s, half-rate tokens, activation ns, overhead ms) from GPU block timings at several widths: a
    non-negative fit of t = F / R + (F / tokens) * h / R + tokens * d * a + c."""
    rows = [[f, f / n, n * d, 1.0] for (d, _), (f, n, _) in zip(shapes, points)]
    inv_rate, size, activation, overhead = fit_nonneg(rows, [t for _, _, t in points])
    if inv_rate <= 0:
        raise RuntimeError(f"block timings do not grow with FLOPs: {points}")
    return 1e-12 / inv_rate, size / inv_rate, activation * 1e9, overhead * 1e3


def measure_compiled_speedup(device: torch.device, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[float, float]:
    """(eager seconds / compiled seconds, compiled seconds) of one block's forward + backward at `shape`."""
    eager = measure_blocks(device, dtype, [shape])[0][2]
    compiled = measure_blocks(device, dtype, [shape], compiled=True)[0][2]
    return eager / compiled, compiled


def fit_compute(points: list[tuple[float, int, float]]) -> tuple[float, float, float]:
    """(TFLOP/s, half-rate tokens, overhead ms) from block timings."""
    inv_rate, size, overhead = fit_nonneg([[f, f / n, 1.0] for f, n, _ in points], [t for _, _, t in points])
    if inv_rate <= 0:
        raise RuntimeError(f"block timings do not grow with FLOPs: {points}")
    return 1e-12 / inv_rate, size / inv_rate, overhead * 1e3


CPU_HEAD_WIDTHS, CPU_HEAD_VOCAB = (256, 512), 50257
CPU_HEAD_TOKENS = (128, 512)
"""Tokens per micro-batch the CPU head's GEMMs are timed at: gpt3-small's ran 95, 101, 103 and 102 GFLOP/s at
128, 256, 512 and 1024 tokens (one thread, 2026-11-28), a fixed time per call of 6 d vocab h / H (h = 14 tokens);
its pp8 last stage took 3.21 CPU s a step in 8 micro-batches of 128 tokens, 2.91 in 2 of 512
(benchmarks/planner/stage_cpu.py, removed; benchmarks/planner/README.md at commit 690c16d)."""
CPU_LOGIT_TOKENS = 256
"""The softmax's tokens (and the embedding's), timed apart from the head's GEMMs: in one fit of both (the GPU's
form) it was ~7 % of each time, and seven calibrations read 2.1-7.5 ns per logit where it takes 1.0-1.3 alone
at 4-98 MiB of logits (2026-11-28, freed memory kept as the ranks keep it; else 4-6 ns above 32 MiB)."""
GPU_HEAD_SHAPES = [(768, 50257), (1024, 50257), (2048, 50257), (4096, 50257)]
"""4096 tokens (on an H100 the CPU shapes took 0.3-0.5 ms, launch-bound: a lease on 2026-11-26) at GPT-2's
vocabulary through the model's own projection (`project_to_vocab`: padded to a multiple of 64 rows on CUDA).
Unpadded, 50257 ran the head's GEMMs in alignment-1 kernels, ~120 TFLOP/s on an H200 against ~760 at 50304
(2026-11-27, benchmarks/gpu/results/NVIDIA-H200/README.md)."""


def measure_head(device: torch.device, dtype: torch.dtype, tokens: int = 4096, repeat: int = 3) -> tuple[float, float]:
    """(head TFLOP/s, ns per logit) of head GEMM + softmax cross-entropy, forward + backward, at GPU_HEAD_SHAPES:
    a fit of t = 6 * tokens * d * vocab / H + tokens * vocab * l."""
    rows, ys = [], []
    for d, vocab in GPU_HEAD_SHAPES:
        x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(vocab, d, device=device, dtype=dtype) * 0.02).requires_grad_()
        target = torch.randint(0, vocab, (tokens,), device=device)
        ys.append(
            timed(lambda: F.cross_entropy(project_to_vocab(x, w).float(), target).backward(), repeat, _sync(device))
        )
        rows.append([6.0 * tokens * d * vocab, float(tokens * vocab)])
    inv_rate, per_logit = fit_nonneg(rows, ys)
    if inv_rate <= 0:
        raise RuntimeError(f"head timings do not grow with FLOPs: {list(zip(GPU_HEAD_SHAPES, ys))}")
    return 1e-12 / inv_rate, per_logit * 1e9


def measure_cpu_head(
    dtype: torch.dtype, widths: tuple[int, ...] | None = None, vocab: int | None = None, repeat: int = 3
) -> tuple[float, float, float]:
    """(head TFLOP/s, half-rate tokens, ns per logit) on the CPU, each part timed alone: softmax cross-entropy of
    fp32 logits (CPU_LOGIT_TOKENS x vocab) forward + backward, per logit; the head's three GEMMs at each width
    and each of CPU_HEAD_TOKENS, fitted as t = F / H + (F / tokens) * h / H (default CPU_HEAD_WIDTHS, _VOCAB)."""
    widths, vocab = widths or CPU_HEAD_WIDTHS, vocab or CPU_HEAD_VOCAB
    logits = torch.randn(CPU_LOGIT_TOKENS, vocab, dtype=torch.float32, requires_grad=True)
    target = torch.randint(0, vocab, (CPU_LOGIT_TOKENS,))
    per_logit = timed(lambda: F.cross_entropy(logits, target).backward(), repeat) / (CPU_LOGIT_TOKENS * vocab)
    rows, ys, shapes = [], [], list(itertools.product(widths, CPU_HEAD_TOKENS))
    for d, tokens in shapes:
        x = torch.randn(tokens, d, dtype=dtype, requires_grad=True)
        w = (torch.randn(vocab, d, dtype=dtype) * 0.02).requires_grad_()
        grad = torch.randn(tokens, vocab, dtype=dtype)
        ys.append(timed(lambda: project_to_vocab(x, w).backward(grad), repeat))
        flops = 6.0 * tokens * d * vocab
        rows.append([flops, flops / tokens])
    inv_rate, size = fit_nonneg(rows, ys)
    if inv_rate <= 0:
        raise RuntimeError(f"head timings do not grow with tokens: {list(zip(shapes, ys))}")
    return 1e-12 / inv_rate, size / inv_rate, per_logit * 1e9


def measure_embedding_grad(vocab: int, d: int, microbatches: int = 4, repeat: int = 3) -> float:
    """ns per table element of the embedding's backward per micro-batch (each zeroes a whole table's gradient and
    adds its CPU_LOGIT_TOKENS rows in; all but the first of a step's `microbatches` then add that in)."""
    table = torch.nn.Embedding(vocab, d)
    ids, grad = torch.randint(0, vocab, (microbatches, CPU_LOGIT_TOKENS)), torch.randn(CPU_LOGIT_TOKENS, d)

    def step():
        table.weight.grad = None
        for x in ids:
            table(x).backward(grad)

    return timed(step, repeat) / microbatches / (vocab * d) * 1e9


def measure_memory_bandwidth(device: torch.device, numel: int = 32 * 2**20, repeat: int = 5) -> float:
    """GB/s of a large in-place add (two reads, one write of fp32)."""
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    return 3 * 4 * numel / timed(lambda: a.add_(b), repeat, _sync(device)) / 1e9


def measure_optimizer(device: torch.device, numel: int = 8 * 2**20, repeat: int = 3) -> float:
    """ns per parameter of gradient clipping + one AdamW step (the trainer's: train.optim.implementation)."""
    params = [torch.nn.Parameter(torch.randn(numel // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, **implementation(params))

    def step():
        norm = torch.stack([sum_of_squares(p.grad) for p in params]).sum().sqrt()
        torch._foreach_mul_([p.grad for p in params], torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        opt.step()

    return timed(step, repeat, _sync(device)) / numel * 1e9


SMALL_CALL_BYTES = 2**22
"""Sizes below this are timed in more calls (up to MAX_CALLS, this many bytes in all): one call disturbed by the
scheduler moved a mean of three by 10x (latency 116-1197 us in five runs minutes apart, 2026-11-28)."""
MAX_CALLS = 25


def link_calls(nbytes: int, repeat: int) -> int:
    """Timed all-reduces of a size: `repeat`, more for the small sizes."""
    return max(repeat, min(MAX_CALLS, SMALL_CALL_BYTES // max(nbytes, 1)))


def _median_seconds(call: Callable[[], object], calls: int) -> float:
    """The median of `calls` timed calls of a collective, after one untimed call and a barrier."""
    call()
    dist.barrier()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _all_reduce_times(rank: int, world: int, sizes: list[int], repeat: int) -> list[float]:
    """Per size, the median of its timed all-reduces (one untimed first, then a barrier)."""
    times = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        times.append(_median_seconds(lambda: dist.all_reduce(t), link_calls(nbytes, repeat)))
    return times


SHARE_SIZES = [2**24, 2**26, 2**27]
"""Bytes at which the all-gather and reduce-scatter are timed against an all-reduce: the sizes of the
data-parallel collectives, where bandwidth, not latency, sets the time."""


def _share_times(rank: int, world: int, sizes: list[int], repeat: int) -> list[tuple[float, float, float]]:
    """Per size, the median seconds of (an all-reduce, an all-gather into, a reduce-scatter from) a tensor of
    that many bytes, the last two as zero1 and fsdp make them on gloo (parallel/gloo_comms.py)."""
    out = []
    for nbytes in sizes:
        whole = torch.ones(nbytes // 4 // world * world)
        part = torch.ones(whole.numel() // world)
        calls = (lambda: dist.all_reduce(whole), lambda: all_gather(whole, part), lambda: reduce_scatter(part, whole))
        out.append(tuple(_median_seconds(call, repeat) for call in calls))
    return out


def measure_collective_shares(
    worlds: list[int], sizes: list[int] = SHARE_SIZES, repeat: int = 3
) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds as shares of an all-reduce's of the same bytes on the same ranks: the
    median over `worlds` and `sizes` of the slowest rank's ratios. A ring's are 0.5 each; gloo_comms' read
    0.44-0.46 and 0.97-1.02 on two ranks of the 2-core machine (2026-11-28; gloo's own: 1.2-1.9 and 1.9-2.0)."""
    gathers, scatters = [], []
    for world in worlds:
        per_rank = run_ranks(_share_times, world, sizes, repeat)
        for i in range(len(sizes)):
            reduce, gather, scatter = (max(r[i][k] for r in per_rank) for k in range(3))
            gathers.append(gather / reduce)
            scatters.append(scatter / reduce)
    return statistics.median(gathers), statistics.median(scatters)


def measure_links(worlds: list[int], sizes: list[int], repeat: int = 3) -> tuple[float, float]:
    """(bus GB/s, latency us) of gloo all-reduce on forked local ranks, fitted to the ring model by relative
    error."""
    rows, ys = [], []
    for world in worlds:
        per_rank = run_ranks(_all_reduce_times, world, sizes, repeat)
        for i, nbytes in enumerate(sizes):
            rows.append([2 * (world - 1) / world * nbytes, 2 * (world - 1)])
            ys.append(max(r[i] for r in per_rank))
    # relative errors: the microseconds of the small sizes count as much as the large sizes' seconds
    inv_bw, latency = fit_nonneg([[v / y for v in row] for row, y in zip(rows, ys)], [1.0] * len(ys))
    if inv_bw <= 0:
        raise RuntimeError(f"all-reduce times do not grow with size (try larger sizes): {list(zip(rows, ys))}")
    return 1e-9 / inv_bw, latency * 1e6


def calibrate(
    base: Hardware,
    name: str,
    worlds: list[int],
    device: torch.device,
    say: Callable[[str], None] = print,
    compiled: bool = False,
    model: ModelConfig | None = None,
) -> Hardware:
    """Measure this machine; the fields not measured come from `base` (`compiled_speedup` too, unless
    `compiled`); `model`: the job's model, whose width and vocabulary the CPU head and embedding are timed at."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hw = dataclasses.replace(
        base, name=name, device=device.type, compute_dtype="bf16" if device.type == "cuda" else "fp32"
    )
    gpu = device.type == "cuda"
    if gpu:  # clocks up and cuBLAS's choices made before anything is timed: on an H100 the first, smallest
        measure_blocks(device, dtype, GPU_SHAPES[-1:], repeat=20, seq_len=GPU_SEQ_LEN)  # shape took longer
        points = measure_blocks(device, dtype, GPU_SHAPES, repeat=10, seq_len=GPU_SEQ_LEN)
    else:
        points = measure_blocks(device, dtype, CPU_SHAPES, repeat=3)
    for f, n, t in points:
        say(
            f"[calibrate] block fwd+bwd {f / 1e9:8.2f} GFLOP, {n:5d} tokens: {t * 1e3:8.2f} ms "
            f"({f / t / 1e9:.1f} GFLOP/s)"
        )
    if gpu:
        tflops, half, activation, overhead = fit_device(GPU_SHAPES, points)
        hw = dataclasses.replace(
            hw, tflops=tflops, half_rate_tokens=half, activation_ns=activation, layer_overhead_ms=overhead
        )
    else:
        tflops, half, overhead = fit_compute(points)
        hw = dataclasses.replace(hw, tflops=tflops, half_rate_tokens=half, layer_overhead_ms=overhead)
    if compiled:
        shape = (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)[-1]
        speedup, seconds = measure_compiled_speedup(device, dtype, shape)
        say(f"[calibrate] block fwd+bwd compiled, {shape[1]:5d} tokens: {seconds * 1e3:8.2f} ms ({speedup:.2f}x eager)")
        hw = dataclasses.replace(hw, compiled_speedup=round(speedup, 3))
    head_half = embedding = 0.0  # on a GPU the embedding's gradient is charged at the memory bandwidth
    if gpu:
        head_tflops, logit_ns = measure_head(device, dtype)
    else:  # the tied table at the job's width and vocabulary, else the presets'
        vocab, widths = (model.vocab_size, (model.d_model,)) if model else (CPU_HEAD_VOCAB, CPU_HEAD_WIDTHS)
        head_tflops, head_half, logit_ns = measure_cpu_head(dtype, widths, vocab)
        embedding = measure_embedding_grad(vocab, widths[-1])
    hw = dataclasses.replace(
        hw,
        head_tflops=head_tflops,
        head_half_rate_tokens=head_half,
        logit_ns=logit_ns,
        embedding_grad_ns=embedding,
        memory_bandwidth_gbs=measure_memory_bandwidth(device),
        optimizer_ns_per_param=measure_optimizer(device),
    )
    if device.type == "cpu":
        hw = _cpu_host(hw, worlds)
    say(
        f"[calibrate] {hw.tflops * 1e3:.1f} GFLOP/s per rank (half rate at {hw.half_rate_tokens:.0f} tokens, "
        f"{hw.layer_overhead_ms:.2f} ms per block"
        f"{f', {hw.activation_ns:.4f} ns per token and width' if hw.activation_ns else ''}), "
        f"{hw.memory_bandwidth_gbs:.1f} GB/s memory, "
        f"{hw.optimizer_ns_per_param:.2f} ns/param optimizer, head {hw.head_tflops * 1e3:.1f} GFLOP/s"
        f"{f' (half rate at {hw.head_half_rate_tokens:.0f} tokens)' if hw.head_half_rate_tokens else ''} + "
        f"{hw.logit_ns:.3f} ns/logit{f', embedding {embedding:.3f} ns/element' if embedding else ''}, "
        f"links {hw.intra_host_gbs:.2f} GB/s + {hw.intra_host_latency_us:.0f} us"
        + (
            f" (all-gather {hw.all_gather_share:.2f}, reduce-scatter {hw.reduce_scatter_share:.2f} of an all-reduce)"
            if hw.shared_host
            else ""
        )
    )
    return hw


def _block_seconds(rank: int, world: int) -> float:
    dist.barrier()
    return measure_blocks(torch.device("cpu"), torch.float32, CPU_SHAPES[-1:], repeat=3)[0][2]


def measure_parallel_units(cores: int) -> float:
    """How many ranks' worth of block compute `cores` ranks deliver together (their speed-up over one)."""
    alone = run_ranks(_block_seconds, 1)[0]
    together = statistics.median(run_ranks(_block_seconds, cores))
    return min(float(cores), max(1.0, cores * alone / together))


def _cpu_host(hw: Hardware, worlds: list[int]) -> Hardware:
    """Cores, memory and gloo links of this host; all ranks are processes sharing it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # on idle ranks, a core each: the step-time model slows the links itself as a job's ranks share the cores
    idle = [w for w in worlds if w <= cores] or [min(worlds)]
    gbs, latency = measure_links(idle, LINK_SIZES)
    gather_share, scatter_share = measure_collective_shares(idle)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    if not hw.shared_host:  # a base from elsewhere: the heap CPU ranks keep, as measured on the reference machine
        hw = dataclasses.replace(hw, **CPU_KEPT_HEAP)
    return dataclasses.replace(
        hw,
        shared_host=True,
        compute_units=round(measure_parallel_units(cores), 2),
        memory_gb=round(memory, 1),
        reserved_gb=4.0,
        gpus_per_host=max(8, max(worlds)),
        overlap=0.0,
        ring_latency=True,
        all_gather_share=round(gather_share, 3),
        reduce_scatter_share=round(scatter_share, 3),
        intra_host_gbs=gbs,
        inter_host_gbs=gbs,
        intra_host_latency_us=latency,
        inter_host_latency_us=latency,
    )
