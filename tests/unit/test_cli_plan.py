"""`elastic-trainer plan` and `calibrate` as users run them: table, JSON, --compare, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_trainer import cli
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT
from elastic_trainer.plan import load_hardware

XL = [
    "plan",
    "--model",
    "gpt3-xl",
    "--gpus-per-host",
    "8",
    "--hardware",
    "h100-80g",
    "--global-batch",
    "128",
    "--seq-len",
    "1024",
]


def test_json_names_the_chosen_layout_and_the_comparison(capsys):
    assert cli.main([*XL, "--gpus", "16", "--json", "--compare", "2,2,4"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["chosen"]
    assert chosen["dp"] * chosen["tp"] * chosen["pp"] == 16
    assert chosen["dp"] * chosen["micro_batch"] * chosen["num_microbatches"] == 128
    assert chosen["memory_gb"] < 80 and chosen["step_time_s"] > 0
    assert out["candidates"][0] == chosen and len(out["candidates"]) > 10
    assert (out["compare"]["dp"], out["compare"]["tp"], out["compare"]["pp"]) == (2, 2, 4)
    assert out["compare"]["step_time_s"] >= chosen["step_time_s"]


def test_table_shows_top_rows_and_comparison(capsys):
    assert cli.main([*XL, "--gpus", "8", "--top", "3", "--compare", "1,2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpt3-xl on 8 x h100-80g (8 per host, bf16), global batch 128 x 1024 tokens")
    assert lines[1].split() == [
        "#",
        "dp",
        "tp",
        "pp",
        "micro",
        "accum",
        "mode",
        "recompute",
        "GiB/GPU",
        "step",
        "s",
        "tokens/s",
        "bubble",
    ]
    assert [line.split()[0] for line in lines[2:6]] == ["1", "2", "3", "cmp"]
    assert lines[6].startswith("compare 1,2,4: predicted ")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*XL, "--gpus", "29"], "no DP,TP,PP of 29 GPUs is valid"),
        ([*XL, "--gpus", "100000"], "100000 GPUs are more than gpt3-xl with global batch 128 can use"),
        ([*XL, "--gpus", "16", "--compare", "2,2,2"], "layout 2,2,2 has 8 GPUs, not 16"),
        (
            [*XL, "--gpus", "16", "--global-batch", "8", "--compare", "16,1,1"],
            "layout 16,1,1 is invalid: dp=16 does not divide the global batch 8",
        ),
        ([*XL, "--gpus", "0"], "argument --gpus: '0' is not an integer in [1, "),
        ([*XL, "--gpus", "8", "--hardware", "tpu"], "unknown hardware 'tpu'"),
        ([*XL, "--gpus", "8", "--seq-len", "4096"], "seq_len=4096 exceeds gpt3-xl's context_length=2048"),
        ([*XL, "--gpus", "8", "--micro-batch", "0"], "argument --micro-batch: '0' is not an integer in [1, "),
        ([*XL, "--gpus", "8", "--gpus-per-host", "0"], "argument --gpus-per-host: '0' is not an integer in [1, "),
        ([*XL, "--gpus", "8", "--compare", "2,x"], "--compare '2,x' must be three positive integers DP,TP,PP"),
        (["calibrate", "--ranks", "2,x"], "--ranks '2,x' must be rank counts from 2 to 64 separated by commas"),
    ],
)
def test_bad_plan_requests_are_one_line(capsys, argv, message):
    assert cli.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("elastic-trainer: error: "), err


# `calibrate` fits models to timings. Timings of the small shapes a test can afford are mostly scheduling noise
# on a busy machine (two of eight runs of a real calibration failed with 2 busy cores: head timings of
# 10-18 ms that did not grow with FLOPs, all-reduces of 64 KiB and 4 MiB both taking 8 ms, which the fits
# rightly refuse). So the fits get synthetic timings from known coefficients and must return them, and the
# real measurements run separately with checks that noise cannot fail.
RATE, HALF, OVERHEAD = 50e9, 40.0, 2e-3  # block: 50 GFLOP/s, half rate at 40 tokens, 2 ms per block
HEAD_RATE, HEAD_HALF, LOGIT = 20e9, 12.0, 1.5e-9  # head: 20 GFLOP/s, half rate at 12 tokens, 1.5 ns per logit
BANDWIDTH, PER_PARAM = 10e9, 3e-9  # 10 GB/s memory, 3 ns per parameter of clipping + AdamW
EMBEDDING = 0.4e-9  # the embedding's backward: 0.4 ns per table element and micro-batch
BUS, LATENCY = 2e9, 50e-6  # gloo all-reduce: 2 GB/s bus bandwidth, 50 us per ring step
GATHER, SCATTER = 0.45, 1.05  # an all-gather and a reduce-scatter, as shares of an all-reduce of the same bytes
ALONE, TOGETHER, CORES = 0.010, 0.016, 4  # one block alone and on 4 ranks at once: 2.5 ranks' worth
SMALL = 2**10  # elements of the bandwidth and optimizer measurements


def synthetic_timings(monkeypatch, calibrate):
    """Replace every clock reading of `calibrate` by the time the coefficients above give."""
    import functools
    import os
    import sys

    def blocks(device, dtype, shapes, repeat=3):
        out = []
        for d, tokens in shapes:
            flops = 3 * (24 * tokens * d * d + 2 * tokens * calibrate.SEQ_LEN * d)  # forward + backward
            out.append((flops, tokens, flops / (RATE * tokens / (tokens + HALF)) + OVERHEAD))
        return out

    vocab = calibrate.CPU_HEAD_VOCAB
    head = [calibrate.CPU_LOGIT_TOKENS * vocab * LOGIT] + [
        6 * n * d * vocab / (HEAD_RATE * n / (n + HEAD_HALF))
        for d in calibrate.CPU_HEAD_WIDTHS
        for n in calibrate.CPU_HEAD_TOKENS
    ]
    embedding = [4 * vocab * calibrate.CPU_HEAD_WIDTHS[-1] * EMBEDDING]  # a step of 4 micro-batches
    clock = {
        "measure_cpu_head": head,
        "measure_embedding_grad": embedding,
        "measure_memory_bandwidth": [3 * 4 * SMALL / BANDWIDTH],
        "measure_optimizer": [SMALL * PER_PARAM],
    }

    def timed(fn, repeat, sync=lambda: None):
        caller = sys._getframe(1).f_code.co_name  # a mutation tool may rename it (x_measure_head__mutmut_3)
        return clock[next(k for k in clock if k in caller)].pop(0)  # in the order the caller measures

    def ranks(fn, world, *args, **kwargs):
        if fn is calibrate._all_reduce_times:
            sizes, _ = args
            ring = [2 * (world - 1) / world * n / BUS + 2 * (world - 1) * LATENCY for n in sizes]
            return [[t * (1 - 0.1 * r) for t in ring] for r in range(world)]  # the slowest rank counts
        if fn is calibrate._share_times:
            sizes, _ = args
            return [
                [(t, GATHER * t, SCATTER * t) for t in [n / BUS * (1 + 0.1 * r) for n in sizes]] for r in range(world)
            ]
        assert fn is calibrate._block_seconds
        return [ALONE] if world == 1 else [TOGETHER] * world

    monkeypatch.setattr(calibrate, "measure_blocks", blocks)
    monkeypatch.setattr(calibrate, "timed", timed)
    monkeypatch.setattr(calibrate, "run_ranks", ranks)
    monkeypatch.setattr(
        calibrate, "measure_memory_bandwidth", functools.partial(calibrate.measure_memory_bandwidth, numel=SMALL)
    )
    monkeypatch.setattr(calibrate, "measure_optimizer", functools.partial(calibrate.measure_optimizer, numel=SMALL))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(CORES)), raising=False)
    return clock


def test_calibrate_fits_its_timings_and_writes_a_loadable_profile(tmp_path, monkeypatch, capsys):
    import torch

    from elastic_trainer.parallel import calibrate

    monkeypatch.setattr(calibrate, "CPU_HEAD_WIDTHS", (16, 32))
    monkeypatch.setattr(calibrate, "CPU_HEAD_VOCAB", 128)
    clock = synthetic_timings(monkeypatch, calibrate)
    threads = torch.get_num_threads()
    out = tmp_path / "here.toml"
    try:
        assert cli.main(["calibrate", "--output", str(out), "--ranks", "2,3"]) == 0
    finally:
        torch.set_num_threads(threads)  # calibrate measures with one thread per rank, as the trainer runs
    assert all(not left for left in clock.values())
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    hw = load_hardware(out)
    assert hw.optimizer_shapes == "" and "kept from the base profile" not in printed  # no base: no mode figures
    assert (hw.name, hw.device, hw.compute_dtype, hw.shared_host) == ("here", "cpu", "fp32", True)
    rel = 1e-5  # the profile keeps 6 significant digits
    assert hw.tflops == pytest.approx(RATE / 1e12, rel=rel)
    assert hw.half_rate_tokens == pytest.approx(HALF, rel=rel)
    assert hw.layer_overhead_ms == pytest.approx(OVERHEAD * 1e3, rel=rel)
    assert hw.head_tflops == pytest.approx(HEAD_RATE / 1e12, rel=rel)
    assert hw.head_half_rate_tokens == pytest.approx(HEAD_HALF, rel=rel)
    assert hw.logit_ns == pytest.approx(LOGIT * 1e9, rel=rel)
    assert hw.embedding_grad_ns == pytest.approx(EMBEDDING * 1e9, rel=rel)
    assert hw.memory_bandwidth_gbs == pytest.approx(BANDWIDTH / 1e9, rel=rel)
    assert hw.optimizer_ns_per_param == pytest.approx(PER_PARAM * 1e9, rel=rel)
    assert hw.intra_host_gbs == hw.inter_host_gbs == pytest.approx(BUS / 1e9, rel=rel)
    assert hw.intra_host_latency_us == hw.inter_host_latency_us == pytest.approx(LATENCY * 1e6, rel=rel)
    assert hw.compute_units == CORES * ALONE / TOGETHER == 2.5
    assert hw.ring_latency and hw.overlap == 0.0 and hw.gpus_per_host == 8
    assert (hw.all_gather_share, hw.reduce_scatter_share) == (GATHER, SCATTER)
    assert hw.memory_gb > hw.reserved_gb


def test_calibrate_says_it_keeps_the_base_s_dp_mode_figures(tmp_path, monkeypatch, capsys):
    """The shipped cpu profile's dp-mode figures stand in for the common optimizer figure calibrate measures:
    a calibration from it without --model keeps them and says where they were measured."""
    from elastic_trainer.parallel import calibrate

    monkeypatch.setattr(calibrate, "calibrate", lambda base, name, *a, **k: dataclasses.replace(base, name=name))
    out = tmp_path / "again.toml"
    assert cli.main(["calibrate", "--base", "cpu", "--output", str(out)]) == 0
    base, hw = load_hardware("cpu"), load_hardware(out)
    assert (hw.zero1_hooks_ns_per_param, hw.optimizer_shapes) == (base.zero1_hooks_ns_per_param, base.optimizer_shapes)
    assert f"kept from the base profile (measured at {base.optimizer_shapes})" in capsys.readouterr().out
