"""`elastic-trainer calibrate`'s pieces, each on a fake clock so that every figure it derives is exact.

No test here times anything for real (a busy 2-core machine makes timings noise; test_cli_plan.py runs the
real measurements with checks noise cannot fail). The clock, the collectives, the forked ranks and the host's
facts are replaced by known values; the shapes are tiny, or on torch's "meta" device, which runs a block's
forward + backward, the head and AdamW without computing anything.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elastic_trainer.config import ModelConfig
from elastic_trainer.model.gpt import Block, project_to_vocab
from elastic_trainer.parallel import calibrate
from elastic_trainer.plan.hardware import GIB, Hardware

META, CPU = torch.device("meta"), torch.device("cpu")
ADAMW = torch.optim.AdamW  # the real one (a test replaces it by a recorder)


class FakeClock:
    """perf_counter readings in (start, start + duration) pairs; `starts` offsets each pair's start."""

    def __init__(self, durations, starts=None):
        starts = starts if starts is not None else [0.0] * len(durations)
        self.readings = [r for s, d in zip(starts, durations) for r in (s, s + d)]
        self.log: list[str] | None = None

    def perf_counter(self):
        if self.log is not None:
            self.log.append("clock")
        return self.readings.pop(0)


@pytest.fixture
def clock(monkeypatch):
    """Install a FakeClock in calibrate's `time`: clock(durations, starts=None) -> the clock."""

    def install(durations, starts=None):
        fake = FakeClock(durations, starts)
        monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
        return fake

    return install


@pytest.fixture
def syncs(monkeypatch):
    """calibrate._sync(device) returns a recorder: the list of the devices of its calls, one per sync()."""
    done = []

    def sync_for(device):
        return lambda: done.append(device)

    monkeypatch.setattr(calibrate, "_sync", sync_for)
    return done


@pytest.fixture
def threads():
    """calibrate sets one intra-op thread; give the rest of the session its threads back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# --- timed, _sync ------------------------------------------------------------------------------------------


def test_timed_warms_up_once_then_returns_the_fastest_of_repeat_calls_each_synced(clock):
    log = []
    fake = clock([0.5, 0.25, 0.75], starts=[100.0, 200.0, 300.0])
    fake.log = log
    assert calibrate.timed(lambda: log.append("fn"), 3, lambda: log.append("sync")) == 0.25
    assert log == ["fn", "sync"] + ["clock", "fn", "sync", "clock"] * 3
    assert not fake.readings


def test_timed_without_sync_and_with_one_repeat(clock):
    calls = []
    clock([0.125], starts=[7.0])
    assert calibrate.timed(lambda: calls.append(1), 1) == 0.125
    assert calls == [1, 1]


def test_sync_waits_for_cuda_and_is_a_no_op_elsewhere():
    assert calibrate._sync(torch.device("cuda")) is torch.cuda.synchronize
    assert calibrate._sync(torch.device("cuda", 1)) is torch.cuda.synchronize
    for device in (CPU, META):
        sync = calibrate._sync(device)
        assert sync is not torch.cuda.synchronize and sync() is None


# --- fit_nonneg, fit_compute -------------------------------------------------------------------------------


def test_fit_nonneg_is_least_squares_when_every_coefficient_is_positive():
    rows = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]]
    ys = [2 * x + 3 for x, _ in rows]
    assert calibrate.fit_nonneg(rows, ys) == pytest.approx([2.0, 3.0], rel=1e-12)


def test_fit_nonneg_drops_the_features_a_fit_would_make_negative():
    # y = 2 - x0: the fit of both features has x0's coefficient -1, x0 alone fits y with a negative one, so
    # the answer is the constant alone (the mean) and an exact 0 for x0.
    rows, ys = [[1.0, 1.0], [-1.0, 1.0], [0.0, 1.0]], [1.0, 3.0, 2.0]
    fit = calibrate.fit_nonneg(rows, ys)
    assert fit[0] == 0.0 and fit[1] == pytest.approx(2.0, rel=1e-12)
    # The same with the constant first: the best single feature is not the first one tried.
    fit = calibrate.fit_nonneg([[1.0, x] for x, _ in rows], ys)
    assert fit[1] == 0.0 and fit[0] == pytest.approx(2.0, rel=1e-12)


def test_fit_nonneg_prefers_a_pair_to_a_single_feature_and_zeroes_the_third():
    # y = 1 * x0 + 2 * x2 with x1 pulling the other way: the best non-negative fit is (x0, x2).
    rows = [[1.0, 3.0, 1.0], [2.0, 1.0, 1.0], [3.0, 2.0, 1.0], [5.0, 0.0, 1.0]]
    ys = [x0 + 2 * x2 - 0.5 * x1 + (0.1 if i % 2 else -0.1) for i, (x0, x1, x2) in enumerate(rows)]
    fit = calibrate.fit_nonneg(rows, ys)
    assert fit[1] == 0.0 and fit[0] > 0 and fit[2] > 0
    a = np.asarray(rows)[:, [0, 2]]
    assert fit[0:3:2] == pytest.approx(list(np.linalg.lstsq(a, np.asarray(ys), rcond=None)[0]), rel=1e-12)


def test_fit_nonneg_is_all_zeros_when_no_feature_can_be_positive():
    assert calibrate.fit_nonneg([[1.0], [2.0]], [-1.0, -2.0]) == [0.0]
    assert calibrate.fit_nonneg([[1.0, 2.0], [2.0, 1.0]], [-1.0, -2.0]) == [0.0, 0.0]


def test_fit_nonneg_keeps_the_first_of_equally_good_fits():
    # Two copies of one feature: each alone fits exactly; the first is kept, the copy gets 0, and the pair
    # (no better than one of them) does not replace it.
    fit = calibrate.fit_nonneg([[1.0, 1.0], [2.0, 2.0]], [2.0, 4.0])
    assert fit[0] == pytest.approx(2.0, rel=1e-12) and fit[1] == 0.0


def test_fit_nonneg_takes_integers_beyond_int64():
    # Python ints too large for int64 (FLOP counts can be) are converted to floats, not left as objects.
    big = 2**70
    assert calibrate.fit_nonneg([[big], [2 * big]], [1.0, 2.0]) == pytest.approx([1 / big], rel=1e-12)
    assert calibrate.fit_nonneg([[1.0], [2.0]], [big, 2 * big]) == pytest.approx([float(big)], rel=1e-12)


def test_fit_compute_refuses_block_timings_that_do_not_grow_with_flops():
    points = [(1e9, 128, 0.003), (2e9, 128, 0.002), (4e9, 128, 0.001)]  # slower for fewer FLOPs
    with pytest.raises(RuntimeError) as err:
        calibrate.fit_compute(points)
    assert str(err.value) == f"block timings do not grow with FLOPs: {points}"


def test_fit_device_tells_the_width_term_from_the_gemms():
    # t = f / 5e14 + (f / n) * 300 / 5e14 + n * d * 2e-11 + 1e-4 at three widths: 500 TFLOP/s, half rate at 300
    # tokens, 0.02 ns per token and unit of width, 0.1 ms
    shapes = calibrate.GPU_SHAPES
    points = []
    for d, n in shapes:
        f = 3 * (24 * n * d * d + 2 * n * 2048 * d)
        points.append((f, n, f / 5e14 + f / n * 300 / 5e14 + n * d * 2e-11 + 1e-4))
    assert calibrate.fit_device(shapes, points) == pytest.approx((500.0, 300.0, 0.02, 0.1), rel=1e-6)


def test_fit_compute_converts_units():
    # t = f / 1e11 + (f / n) * 64 / 1e11 + 0.001: 0.1 TFLOP/s, half rate at 64 tokens, 1 ms overhead
    points = [
        (f, n, f / 1e11 + f / n * 64 / 1e11 + 0.001) for f, n in [(1e9, 128), (4e9, 512), (4e9, 128), (16e9, 512)]
    ]
    assert calibrate.fit_compute(points) == pytest.approx((0.1, 64.0, 1.0), rel=1e-9)


# --- measure_blocks --------------------------------------------------------------------------------------


def test_measure_blocks_times_forward_and_backward_of_one_block_per_shape(monkeypatch, clock, syncs):
    made = []

    class Recorded(Block):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.cfg, self.inputs = cfg, []
            made.append(self)

        def forward(self, x, keys=None):
            self.inputs.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
            return super().forward(x, keys)

    monkeypatch.setattr(calibrate, "Block", Recorded)
    shapes = [(64, 128), (128, 256), (32, 128)]
    durations = [[0.3, 0.1, 0.2], [0.5, 0.7, 0.6], [0.25, 0.125, 0.0625]]  # 3 timings per shape by default
    fake = clock([d for per_shape in durations for d in per_shape])
    points = calibrate.measure_blocks(META, torch.float64, shapes)
    assert not fake.readings
    assert points == [(3 * (24 * n * d * d + 2 * n * 128 * d), n, min(ts)) for (d, n), ts in zip(shapes, durations)]
    assert [b.cfg for b in made] == [
        ModelConfig(n_layers=1, d_model=d, n_heads=h, context_length=128) for d, h in [(64, 1), (128, 2), (32, 1)]
    ]
    for block, (d, n) in zip(made, shapes):
        assert block.inputs == [((n // 128, 128, d), torch.float64, META, True)] * 4  # a warm-up and 3 timed
        assert all(p.device == META and p.dtype == torch.float64 and p.grad is not None for p in block.parameters())
    assert syncs == [META] * 12


def test_measure_blocks_repeats_as_asked(monkeypatch, clock, syncs):
    fake = clock([0.5, 0.25])
    points = calibrate.measure_blocks(META, torch.float32, [(64, 128)], repeat=2)
    assert points == [(3 * (24 * 128 * 64 * 64 + 2 * 128 * 128 * 64), 128, 0.25)]
    assert not fake.readings and syncs == [META] * 3


def test_block_seconds_times_the_largest_cpu_shape_after_a_barrier(monkeypatch):
    log = []
    monkeypatch.setattr(calibrate, "dist", types.SimpleNamespace(barrier=lambda: log.append("barrier")))

    def blocks(device, dtype, shapes, repeat):  # no default: the repetitions must be asked for
        log.append((device, dtype, shapes, repeat))
        return [(1.0, 512, 0.125)]

    monkeypatch.setattr(calibrate, "measure_blocks", blocks)
    monkeypatch.setattr(calibrate, "CPU_SHAPES", [(8, 128), (16, 256), (32, 512)])
    assert calibrate._block_seconds(1, 4) == 0.125
    assert log == ["barrier", (CPU, torch.float32, [(32, 512)], 3)]


# --- measure_head --------------------------------------------------------------------------------------------


HEAD_SHAPES = [(16, 64), (32, 64), (16, 128), (32, 128)]


@pytest.fixture
def head_calls(monkeypatch):
    """Record the head's projection (the model's project_to_vocab(x, w)) and F.cross_entropy(logits, target)
    calls."""
    calls = {"linear": [], "cross_entropy": []}

    def linear(x, w):
        calls["linear"].append((x, w))
        return project_to_vocab(x, w)

    def cross_entropy(logits, target):
        calls["cross_entropy"].append((logits.dtype, target))
        return F.cross_entropy(logits, target)

    monkeypatch.setattr(calibrate, "project_to_vocab", linear)
    monkeypatch.setattr(calibrate, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    monkeypatch.setattr(calibrate, "GPU_HEAD_SHAPES", HEAD_SHAPES)
    return calls


def test_measure_head_fits_rate_and_per_logit_cost_from_its_timings(head_calls, clock, syncs):
    tokens, rate, per_logit = 8, 2e10, 1.5e-9
    ys = [6 * tokens * d * v / rate + tokens * v * per_logit for d, v in HEAD_SHAPES]
    fake = clock([t for y in ys for t in (2 * y, y, 1.5 * y)])
    torch.manual_seed(0)
    head_tflops, logit_ns = calibrate.measure_head(CPU, torch.float64, tokens=tokens)
    assert not fake.readings and syncs == [CPU] * 16
    assert head_tflops == pytest.approx(0.02, rel=1e-9) and logit_ns == pytest.approx(1.5, rel=1e-9)
    # What it timed: x (tokens x d) and w (vocab x d, scaled by 0.02) of the dtype, both trained, an fp32
    # softmax over the vocabulary and random targets, drawn in this order.
    torch.manual_seed(0)
    linear, ce = head_calls["linear"], head_calls["cross_entropy"]
    assert len(linear) == len(ce) == 16
    for i, (d, v) in enumerate(HEAD_SHAPES):
        x, w = torch.randn(tokens, d, dtype=torch.float64), torch.randn(v, d, dtype=torch.float64) * 0.02
        target = torch.randint(0, v, (tokens,))
        for (seen_x, seen_w), (logits_dtype, seen_target) in zip(linear[4 * i : 4 * i + 4], ce[4 * i : 4 * i + 4]):
            assert seen_x.dtype == seen_w.dtype == torch.float64 and logits_dtype == torch.float32
            assert torch.equal(seen_x, x) and torch.equal(seen_w, w) and torch.equal(seen_target, target)
            assert seen_x.requires_grad and seen_w.requires_grad
            assert seen_x.grad is not None and seen_w.grad is not None  # backward ran


def test_measure_head_allocates_on_its_device_and_fits_rows_of_flops_and_logits(monkeypatch, head_calls, clock, syncs):
    seen = {}

    def fit(rows, ys):
        seen.update(rows=rows, ys=ys)
        return [4e-12, 3e-9]

    monkeypatch.setattr(calibrate, "fit_nonneg", fit)
    fake = clock([0.5, 0.25, 0.75, 1.0, 2.0] * 4)
    assert calibrate.measure_head(META, torch.float32, tokens=16, repeat=5) == pytest.approx((0.25, 3.0), rel=1e-12)
    assert not fake.readings and syncs == [META] * 24
    assert seen == {"rows": [[6.0 * 16 * d * v, 16.0 * v] for d, v in HEAD_SHAPES], "ys": [0.25] * 4}
    assert all(x.device == w.device == META for x, w in head_calls["linear"])
    assert all(target.device == META for _, target in head_calls["cross_entropy"])


def test_measure_head_refuses_timings_that_do_not_grow_with_flops(head_calls, clock, syncs):
    # Slower for the narrower width at each vocabulary: only the per-logit term can be non-negative.
    ys = [v * (3 - d / 16) * 1e-5 for d, v in HEAD_SHAPES]
    clock([t for y in ys for t in (y, y, y)])
    with pytest.raises(RuntimeError) as err:
        calibrate.measure_head(CPU, torch.float32, tokens=4)
    assert str(err.value) == f"head timings do not grow with FLOPs: {list(zip(HEAD_SHAPES, ys))}"


def test_cpu_head_times_the_softmax_alone_and_fits_the_gemms_over_two_micro_batch_sizes(
    monkeypatch, head_calls, clock, syncs
):
    """Per logit: the cross-entropy's own time; the rate and its size effect: a fit of the GEMMs' times at every
    width and number of tokens to t = F / H + (F / tokens) * h / H (each time the fastest of its repeats)."""
    monkeypatch.setattr(calibrate, "CPU_HEAD_TOKENS", (4, 16))
    monkeypatch.setattr(calibrate, "CPU_LOGIT_TOKENS", 8)
    rate, half, per_logit, widths, vocab = 2e10, 3.0, 1.5e-9, (16, 32), 64
    ce = 8 * vocab * per_logit
    gemms = [6 * n * d * vocab * (n + half) / n / rate for d in widths for n in (4, 16)]  # by hand: F (n + h) / (n H)
    fake = clock([2 * ce, ce, 1.5 * ce] + [t for g in gemms for t in (g, 1.5 * g, 3 * g)])
    torch.manual_seed(0)
    head_tflops, head_half, logit_ns = calibrate.measure_cpu_head(torch.float64, widths, vocab)
    assert not fake.readings and not syncs  # the CPU needs no synchronization
    assert head_tflops == pytest.approx(0.02, rel=1e-6) and head_half == pytest.approx(3.0, rel=1e-6)
    assert logit_ns == pytest.approx(1.5, rel=1e-9)
    # What it timed: fp32 logits (CPU_LOGIT_TOKENS x vocab) and random targets; then x (tokens x d) and w
    # (vocab x d) of the dtype through the model's projection, forward and backward, width by width and each
    # width at every number of tokens, drawn in this order.
    torch.manual_seed(0)
    torch.randn(8, vocab)  # the logits
    target = torch.randint(0, vocab, (8,))
    assert [dt for dt, _ in head_calls["cross_entropy"]] == [torch.float32] * 4
    assert all(torch.equal(t, target) for _, t in head_calls["cross_entropy"])
    linear = head_calls["linear"]
    assert len(linear) == 16
    for i, (d, n) in enumerate((d, n) for d in widths for n in (4, 16)):
        x, w = torch.randn(n, d, dtype=torch.float64), torch.randn(vocab, d, dtype=torch.float64) * 0.02
        torch.randn(n, vocab, dtype=torch.float64)  # the gradient fed to backward
        for seen_x, seen_w in linear[4 * i : 4 * i + 4]:
            assert torch.equal(seen_x, x) and torch.equal(seen_w, w) and seen_x.grad is not None


def test_cpu_head_without_a_size_effect_reads_none(monkeypatch):
    """Times proportional to the FLOPs: the fit's rate is theirs and the half-rate tokens 0."""
    monkeypatch.setattr(calibrate, "CPU_HEAD_TOKENS", (2, 4))
    monkeypatch.setattr(calibrate, "CPU_LOGIT_TOKENS", 2)
    times = iter([1.0] + [6 * n * d * 50257 / 1e11 for d in (256, 512) for n in (2, 4)])
    seen = []
    monkeypatch.setattr(calibrate, "timed", lambda fn, repeat, sync=None: seen.append(fn) or next(times))
    tflops, half, logit_ns = calibrate.measure_cpu_head(torch.float32)
    assert len(seen) == 5  # the softmax, then widths 256 and 512 (the presets' vocabulary) at 2 and 4 tokens
    assert tflops == pytest.approx(0.1, rel=1e-6) and half == pytest.approx(0.0, abs=1e-6)
    assert logit_ns == pytest.approx(1e9 / (2 * 50257))


def test_cpu_head_refuses_timings_that_do_not_grow_with_tokens(monkeypatch):
    monkeypatch.setattr(calibrate, "CPU_HEAD_TOKENS", (2, 4))
    monkeypatch.setattr(calibrate, "CPU_LOGIT_TOKENS", 2)
    times = iter([1.0, 2.0, 1.0, 2.0, 1.0])  # the softmax; each width twice as fast at 4 tokens as at 2
    monkeypatch.setattr(calibrate, "timed", lambda fn, repeat, sync=None: next(times))
    with pytest.raises(
        RuntimeError,
        match="head timings do not grow with tokens: "
        r"\[\(\(256, 2\), 2.0\), \(\(256, 4\), 1.0\)",
    ):
        calibrate.measure_cpu_head(torch.float32)


def test_embedding_grad_times_a_step_of_micro_batches_per_table_element(monkeypatch):
    """What it times: a step that drops the table's gradient, then runs `microbatches` lookups of
    CPU_LOGIT_TOKENS tokens forward and backward. The gradient it leaves is each row's upstream gradient summed
    over every draw of its token (by hand: index_add), and a second step leaves the same (not twice it)."""
    tables = []

    class Recording(torch.nn.Embedding):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tables.append(self)

    def timed(fn, repeat, sync=None):
        fn()
        fn()
        calls.append(repeat)
        return 0.012

    calls = []
    monkeypatch.setattr(torch.nn, "Embedding", Recording)
    monkeypatch.setattr(calibrate, "CPU_LOGIT_TOKENS", 5)
    monkeypatch.setattr(calibrate, "timed", timed)
    torch.manual_seed(0)
    ns = calibrate.measure_embedding_grad(11, 3, microbatches=4, repeat=7)
    assert calls == [7] and ns == pytest.approx(0.012 / 4 / (11 * 3) * 1e9)
    torch.manual_seed(0)
    torch.randn(11, 3)  # the table's initial weights
    ids, grad = torch.randint(0, 11, (4, 5)), torch.randn(5, 3)
    expected = torch.zeros(11, 3).index_add_(0, ids.flatten(), grad.repeat(4, 1))
    assert len(tables) == 1 and tuple(tables[0].weight.shape) == (11, 3)
    assert torch.allclose(tables[0].weight.grad, expected, atol=1e-6)


# --- memory bandwidth, optimizer ---------------------------------------------------------------------------


@pytest.fixture
def timed_once(monkeypatch):
    """calibrate.timed calls fn once and takes `seconds`; records (fn's result, repeat, sync)."""
    seen = {"seconds": 0.5}

    def timed(fn, repeat, sync=None):
        seen.update(result=fn(), repeat=repeat, sync=sync)
        return seen["seconds"]

    monkeypatch.setattr(calibrate, "timed", timed)
    return seen


def test_memory_bandwidth_counts_two_reads_and_a_write_of_fp32_per_element(timed_once, syncs):
    assert calibrate.measure_memory_bandwidth(CPU, numel=1024, repeat=2) == pytest.approx(2.4576e-5, rel=1e-12)
    assert timed_once["repeat"] == 2
    assert torch.equal(timed_once["result"], torch.full((1024,), 2.0))  # ones += ones, in place
    timed_once["sync"]()
    assert syncs == [CPU]


def test_memory_bandwidth_defaults_to_32_mi_elements_on_the_device_five_times(monkeypatch, timed_once, syncs):
    made, ones = [], torch.ones

    def recorded_ones(*args, **kwargs):
        made.append(ones(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch, "ones", recorded_ones)
    timed_once["seconds"] = 0.25
    assert calibrate.measure_memory_bandwidth(META) == pytest.approx(12 * 32 * 2**20 / 0.25 / 1e9, rel=1e-12)
    assert [(t.numel(), t.dtype, t.device) for t in made] == [(32 * 2**20, torch.float32, META)] * 2
    assert timed_once["repeat"] == 5 and timed_once["result"] is made[0]


@pytest.fixture
def adamw(monkeypatch):
    """Record the AdamW that measure_optimizer makes, with its parameters and gradients as they were."""
    made = []

    class Recorded(ADAMW):
        def __init__(self, params, **kwargs):
            params = list(params)
            self.before = [(p.detach().clone(), p.grad.clone()) for p in params]
            super().__init__(params, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    return made


@pytest.mark.parametrize("grad", [1.0, 0.125])  # a global norm of 4 (clipped to 1) and of 0.5 (kept)
def test_optimizer_clips_gradients_and_steps_adamw(monkeypatch, timed_once, syncs, adamw, grad):
    monkeypatch.setattr(torch, "randn_like", lambda p: torch.full_like(p, grad))
    assert calibrate.measure_optimizer(CPU, numel=16, repeat=2) == 0.5 / 16 * 1e9
    assert timed_once["repeat"] == 2 and timed_once["result"] is None
    timed_once["sync"]()
    assert syncs == [CPU]
    [opt] = adamw
    params = [p for group in opt.param_groups for p in group["params"]]
    assert len(params) == 8 and all(p.shape == (2,) and p.device == CPU for p in params)
    assert [group["lr"] for group in opt.param_groups] == [1e-4]
    # The same step, by torch's own clipping and a fresh AdamW.
    expected = [torch.nn.Parameter(p.clone()) for p, _ in opt.before]
    for e, (_, g) in zip(expected, opt.before):
        e.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(expected, 1.0)
    assert all(torch.equal(p.grad, e.grad) for p, e in zip(params, expected))
    ADAMW(expected, lr=1e-4).step()
    for p, e, (before, _) in zip(params, expected, opt.before):
        torch.testing.assert_close(p.detach(), e.detach(), rtol=0, atol=1e-7)
        assert not torch.equal(p.detach(), before)


def test_optimizer_defaults_to_8_mi_parameters_timed_three_times(timed_once, syncs, adamw):
    timed_once["seconds"] = 0.25
    assert calibrate.measure_optimizer(META) == pytest.approx(0.25 / (8 * 2**20) * 1e9, rel=1e-12)
    assert timed_once["repeat"] == 3
    [opt] = adamw
    assert [(p.numel(), p.device) for p, _ in opt.before] == [(2**20, META)] * 8


# --- links ------------------------------------------------------------------------------------------------


def test_all_reduce_times_take_the_median_of_each_size_s_calls_after_a_warm_up(monkeypatch, clock):
    """Each call timed on its own; one disturbed call (here 40x the others) does not move the figure."""
    log = []
    big = calibrate.SMALL_CALL_BYTES  # timed `repeat` times
    fake = clock([0.25, 10.0, 0.25, 0.5, 0.5, 0.75])
    fake.log = log
    monkeypatch.setattr(
        calibrate,
        "dist",
        types.SimpleNamespace(
            all_reduce=lambda t: log.append(("all_reduce", t.numel(), t.dtype, float(t.sum()))),
            barrier=lambda: log.append("barrier"),
        ),
    )
    assert calibrate._all_reduce_times(0, 2, [big, 2 * big], 3) == [0.25, 0.5]
    expected = []
    for numel in [big // 4, big // 2]:  # fp32 ones of the size in bytes: a warm-up, a barrier, then 3 timed
        step = ("all_reduce", numel, torch.float32, float(numel))
        expected += [step, "barrier"] + ["clock", step, "clock"] * 3
    assert log == expected and not fake.readings


def test_small_sizes_are_timed_in_more_calls():
    assert [calibrate.link_calls(n, 3) for n in [2**14, 2**18, 2**20, 2**21, 2**22, 2**27]] == [25, 16, 4, 3, 3, 3]
    assert calibrate.link_calls(2**27, 7) == 7 and calibrate.link_calls(0, 3) == 25


def test_measure_links_fits_the_ring_model_to_the_slowest_rank(monkeypatch):
    bus, latency, sizes = 2e9, 50e-6, [2**10, 2**14, 2**18]
    calls, fits, real_fit = [], [], calibrate.fit_nonneg

    def ranks(fn, world, *args):
        calls.append((fn, world, args))
        ring = [2 * (world - 1) / world * n / bus + 2 * (world - 1) * latency for n in sizes]
        return [[t * (1 - 0.1 * (world - 1 - r)) for t in ring] for r in range(world)]  # the last is slowest

    def fit(rows, ys):
        fits.append((rows, ys))
        return real_fit(rows, ys)

    monkeypatch.setattr(calibrate, "run_ranks", ranks)
    monkeypatch.setattr(calibrate, "fit_nonneg", fit)
    gbs, latency_us = calibrate.measure_links([2, 4], sizes)
    assert gbs == pytest.approx(2.0, rel=1e-9) and latency_us == pytest.approx(50.0, rel=1e-9)
    assert calls == [(calibrate._all_reduce_times, 2, (sizes, 3)), (calibrate._all_reduce_times, 4, (sizes, 3))]
    [(rows, ys)] = fits  # by relative error: each row over its time
    times = [2 * (w - 1) / w * n / bus + 2 * (w - 1) * latency for w in [2, 4] for n in sizes]
    assert rows == [
        [2 * (w - 1) / w * n / t, 2 * (w - 1) / t] for (w, n), t in zip([(w, n) for w in [2, 4] for n in sizes], times)
    ]
    assert ys == [1.0] * len(times)
    calls.clear()
    calibrate.measure_links([3], sizes, repeat=7)
    assert calls == [(calibrate._all_reduce_times, 3, (sizes, 7))]


def test_measure_links_weighs_the_small_sizes_latency_as_much_as_the_large_sizes_bandwidth(monkeypatch):
    """The two large sizes 5 % off the ring model either way: a fit by absolute error takes a latency of 510 us
    from their residuals; by relative error the small sizes set it, within 5 % of the true 100 us."""
    bus, latency, sizes = 1.5e9, 100e-6, [2**14, 2**18, 2**26, 2**27]
    times = [(n / bus + 2 * latency) * f for n, f in zip(sizes, [1.0, 1.0, 1.05, 0.95])]  # 2 ranks: 2 (n-1)/n = 1
    monkeypatch.setattr(calibrate, "run_ranks", lambda fn, world, sizes, repeat: [times] * world)
    gbs, latency_us = calibrate.measure_links([2], sizes)
    assert latency_us == pytest.approx(100, rel=0.05) and gbs == pytest.approx(1.5, rel=0.05)
    absolute = calibrate.fit_nonneg([[n, 2] for n in sizes], times)
    assert absolute[1] * 1e6 == pytest.approx(510, rel=0.01)  # what the weighting is for


def test_collective_shares_are_the_median_ratio_of_the_slowest_ranks(monkeypatch):
    """Per world and size, the slowest rank's all-gather and reduce-scatter over its all-reduce; the median of
    those ratios (by hand: all-gathers 0.5, 0.6, 0.7, 0.8; reduce-scatters 1.1, 1.0, 0.9, 1.2)."""
    calls = []

    def ranks(fn, world, sizes, repeat):
        calls.append((fn, world, sizes, repeat))
        slowest = [(2.0, 1.0, 2.2), (4.0, 2.4, 4.0)] if world == 2 else [(1.0, 0.7, 0.9), (1.0, 0.8, 1.2)]
        return [[(r * 0.5, g * 0.5, s * 0.5) for r, g, s in slowest]] + [slowest]

    monkeypatch.setattr(calibrate, "run_ranks", ranks)
    gather, scatter = calibrate.measure_collective_shares([2, 4], [10, 20], repeat=5)
    assert calls == [(calibrate._share_times, 2, [10, 20], 5), (calibrate._share_times, 4, [10, 20], 5)]
    assert (gather, scatter) == pytest.approx((0.65, 1.05), rel=1e-12)


def test_link_sizes_reach_the_job_s_collectives():
    assert min(calibrate.LINK_SIZES) <= 2**14 and max(calibrate.LINK_SIZES) >= 2**27


def test_measure_links_converts_the_fit_to_gb_per_s_and_microseconds(monkeypatch):
    monkeypatch.setattr(calibrate, "run_ranks", lambda fn, world, sizes, repeat: [[1.0] * len(sizes)] * world)
    monkeypatch.setattr(calibrate, "fit_nonneg", lambda rows, ys: [4e-10, 3e-6])
    assert calibrate.measure_links([2], [1, 2]) == pytest.approx((2.5, 3.0), rel=1e-12)


def test_measure_links_refuses_times_that_do_not_grow_with_size(monkeypatch):
    times = [0.003, 0.001]  # the larger all-reduce faster
    monkeypatch.setattr(calibrate, "run_ranks", lambda fn, world, sizes, repeat: [times] * world)
    with pytest.raises(RuntimeError) as err:
        calibrate.measure_links([2], [1000, 2000])
    rows = [[2 * (2 - 1) / 2 * n, 2 * (2 - 1)] for n in [1000, 2000]]
    assert str(err.value) == f"all-reduce times do not grow with size (try larger sizes): {list(zip(rows, times))}"


# --- parallel units, host ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cores, together, units",
    [
        (4, [0.020, 0.016, 0.016, 0.018], 4 * 0.010 / 0.017),  # the median of an even count: the middle two's mean
        (3, [0.012, 0.030, 0.015], 3 * 0.010 / 0.015),
        (4, [0.005] * 4, 4.0),  # at most the cores
        (2, [0.050, 0.040], 1.0),  # at least one rank's worth
    ],
)
def test_parallel_units_are_the_speed_up_of_all_cores_over_one(monkeypatch, cores, together, units):
    calls = []

    def ranks(fn, world):
        calls.append((fn, world))
        return [0.010] if world == 1 else together

    monkeypatch.setattr(calibrate, "run_ranks", ranks)
    got = calibrate.measure_parallel_units(cores)
    assert got == units and type(got) is float
    assert calls == [(calibrate._block_seconds, 1), (calibrate._block_seconds, cores)]


BASE = Hardware(
    name="base",
    device="cpu",
    compute_dtype="fp32",
    memory_gb=999.0,
    reserved_gb=1.5,
    gpus_per_host=3,
    overlap=0.5,
    intra_host_gbs=7.0,
    inter_host_gbs=3.0,
    intra_host_latency_us=9.0,
    inter_host_latency_us=11.0,
)


@pytest.fixture
def host(monkeypatch):
    """A host of 6 cores and 15.679073 GiB whose links measure 1.25 GB/s + 75 us and whose cores deliver
    2.34567 ranks' worth; records the calls."""
    seen = {"links": [], "units": [], "shares": []}

    def links(worlds, sizes):
        seen["links"].append((worlds, sizes))
        return 1.25, 75.0

    def shares(worlds):
        seen["shares"].append(worlds)
        return 0.4321, 1.0234

    def units(cores):
        seen["units"].append(cores)
        return 2.34567

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4110175}  # 15.679073 GiB
    monkeypatch.setattr(calibrate, "measure_links", links)
    monkeypatch.setattr(calibrate, "measure_collective_shares", shares)
    monkeypatch.setattr(calibrate, "measure_parallel_units", units)
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: {0, 2, 3, 5, 7, 9}, raising=False)
    monkeypatch.setattr(calibrate.os, "sysconf", lambda name: pages[name])
    return seen


HOST = dataclasses.replace(
    BASE,
    shared_host=True,
    compute_units=2.35,
    memory_gb=15.7,
    reserved_gb=4.0,
    gpus_per_host=8,
    overlap=0.0,
    ring_latency=True,
    all_gather_share=0.432,
    reduce_scatter_share=1.023,
    intra_host_gbs=1.25,
    inter_host_gbs=1.25,
    intra_host_latency_us=75.0,
    inter_host_latency_us=75.0,
    kept_heap=1.5,
    kept_heap_unpipelined=2.8,
    rank_base_gb=0.2,
)


def test_cpu_host_describes_this_host_and_its_gloo_links(host):
    assert 4110175 * 4096 / GIB == pytest.approx(15.679073, abs=1e-6)
    assert calibrate._cpu_host(BASE, [2, 3]) == HOST
    assert host == {"links": [([2, 3], calibrate.LINK_SIZES)], "units": [6], "shares": [[2, 3]]}


@pytest.mark.parametrize("worlds, measured", [([2, 4, 8], [2, 4]), ([8, 12], [8]), ([2, 6], [2, 6])])
def test_cpu_host_measures_links_on_no_more_ranks_than_cores(host, worlds, measured):
    """Ranks beyond the host's 6 cores would share them, which the step-time model charges itself (Links.of);
    with none that fit, the smallest count."""
    calibrate._cpu_host(BASE, worlds)
    assert host["links"] == [(measured, calibrate.LINK_SIZES)] and host["shares"] == [measured]


def test_cpu_host_keeps_a_cpu_base_s_heap_figures(host):
    """A GPU or blank base gets the heap CPU ranks keep (plan/hardware.py CPU_KEPT_HEAP); a CPU base keeps its own."""
    mine = dataclasses.replace(
        BASE, shared_host=True, compute_units=1.0, kept_heap=1.2, kept_heap_unpipelined=0.0, rank_base_gb=0.3
    )
    out = calibrate._cpu_host(mine, [2, 3])
    assert (out.kept_heap, out.kept_heap_unpipelined, out.rank_base_gb) == (1.2, 0.0, 0.3)


def test_cpu_host_has_room_for_its_largest_world(host):
    assert calibrate._cpu_host(BASE, [2, 12]) == dataclasses.replace(HOST, gpus_per_host=12)


@pytest.mark.parametrize("cpu_count, cores", [(5, 5), (None, 1)])
def test_cpu_host_counts_cpus_without_an_affinity_mask(monkeypatch, host, cpu_count, cores):
    monkeypatch.delattr(calibrate.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: cpu_count)
    assert calibrate._cpu_host(BASE, [2]) == HOST
    assert host["units"] == [cores]


# --- calibrate -----------------------------------------------------------------------------------------------

# Block timings whose progress line rounds differently under any change of its arithmetic (50.025000025
# GFLOP, 100.05000005 GFLOP/s: 1e9 + 1 instead of 1e9 moves them across the rounding).
POINTS = [(50025000025.0, 512, 0.5), (3e9, 128, 0.025)]
POINT_LINES = [
    "[calibrate] block fwd+bwd    50.03 GFLOP,   512 tokens:   500.00 ms (100.1 GFLOP/s)",
    "[calibrate] block fwd+bwd     3.00 GFLOP,   128 tokens:    25.00 ms (120.0 GFLOP/s)",
]


@pytest.fixture
def measured(monkeypatch, threads):
    """Replace the measurements by recorders with known results."""
    seen = {}
    seed0 = torch.Generator().manual_seed(0)
    seen["seed0"] = torch.randn(4, generator=seed0)

    def blocks(device, dtype, shapes, repeat=3, seq_len=calibrate.SEQ_LEN):
        seen.setdefault("block_calls", []).append((shapes, repeat, seq_len))
        seen.update(blocks=(device, dtype, shapes), threads=torch.get_num_threads(), draw=torch.randn(4))
        return POINTS

    def fit(points):
        seen["fit"] = points
        return 0.1234, 40.4, 2.3456

    def fit_device(shapes, points):
        seen["fit"], seen["fit_shapes"] = points, shapes
        return 0.1234, 40.4, 0.0125, 2.3456

    def head(device, dtype):
        seen["head"] = (device, dtype)
        return 0.0567, 1.5

    def cpu_head(dtype, widths=None, vocab=None):
        seen["head"], seen["cpu_head"] = (CPU, dtype), (widths, vocab)
        return 0.0567, 14.2, 1.5

    def embedding(vocab, d):
        seen["embedding"] = (vocab, d)
        return 0.321

    def memory(device):
        seen["memory"] = device
        return 12.34

    def optimizer(device):
        seen["optimizer"] = device
        return 3.456

    def cpu_host(hw, worlds):
        seen["cpu_host"] = (hw, worlds)
        return dataclasses.replace(hw, intra_host_gbs=1.25, intra_host_latency_us=75.0)

    for name, fn in [
        ("measure_blocks", blocks),
        ("fit_compute", fit),
        ("fit_device", fit_device),
        ("measure_head", head),
        ("measure_cpu_head", cpu_head),
        ("measure_embedding_grad", embedding),
        ("measure_memory_bandwidth", memory),
        ("measure_optimizer", optimizer),
        ("_cpu_host", cpu_host),
    ]:
        monkeypatch.setattr(calibrate, name, fn)
    torch.set_num_threads(2)
    return seen


MEASURED = dict(
    tflops=0.1234,
    half_rate_tokens=40.4,
    layer_overhead_ms=2.3456,
    head_tflops=0.0567,
    logit_ns=1.5,
    memory_bandwidth_gbs=12.34,
    optimizer_ns_per_param=3.456,
)


def test_calibrate_on_cuda_measures_bf16_on_the_device_and_keeps_the_links(measured):
    cuda, lines = torch.device("cuda"), []
    base = dataclasses.replace(BASE, memory_gb=80.0, reserved_gb=3.0)
    hw = calibrate.calibrate(base, "gpu-here", [2, 4], cuda, say=lines.append)
    assert hw == dataclasses.replace(
        base, name="gpu-here", device="cuda", compute_dtype="bf16", activation_ns=0.0125, **MEASURED
    )
    assert measured["blocks"] == (cuda, torch.bfloat16, calibrate.GPU_SHAPES)
    # a warm-up at the largest shape first (clocks, cuBLAS's choices), then every shape, 10 times each, all in
    # sequences of GPU_SEQ_LEN
    assert measured["block_calls"] == [(calibrate.GPU_SHAPES[-1:], 20, 2048), (calibrate.GPU_SHAPES, 10, 2048)]
    assert (measured["head"], measured["memory"], measured["optimizer"]) == ((cuda, torch.bfloat16), cuda, cuda)
    assert measured["fit"] == POINTS and measured["fit_shapes"] == calibrate.GPU_SHAPES
    assert "cpu_host" not in measured
    assert lines == POINT_LINES + [
        "[calibrate] 123.4 GFLOP/s per rank (half rate at 40 tokens, 2.35 ms per block, 0.0125 ns per token and "
        "width), 12.3 GB/s memory, "
        "3.46 ns/param optimizer, head 56.7 GFLOP/s + 1.500 ns/logit, links 7.00 GB/s + 9 us"
    ]


def test_calibrate_on_cpu_measures_fp32_with_one_thread_from_seed_0_and_the_host(measured, capsys):
    hw = calibrate.calibrate(BASE, "here", [2, 3], CPU)  # progress to stdout by default
    measured_hw = dataclasses.replace(
        BASE,
        name="here",
        device="cpu",
        compute_dtype="fp32",
        head_half_rate_tokens=14.2,
        embedding_grad_ns=0.321,
        **MEASURED,
    )
    assert measured["cpu_host"] == (measured_hw, [2, 3])
    assert hw == dataclasses.replace(measured_hw, intra_host_gbs=1.25, intra_host_latency_us=75.0)
    assert measured["blocks"] == (CPU, torch.float32, calibrate.CPU_SHAPES)
    assert measured["block_calls"] == [(calibrate.CPU_SHAPES, 3, calibrate.SEQ_LEN)]
    assert (measured["head"], measured["memory"], measured["optimizer"]) == ((CPU, torch.float32), CPU, CPU)
    assert measured["threads"] == 1 and torch.get_num_threads() == 1
    assert torch.equal(measured["draw"], measured["seed0"])
    assert capsys.readouterr().out.splitlines() == POINT_LINES + [
        "[calibrate] 123.4 GFLOP/s per rank (half rate at 40 tokens, 2.35 ms per block), 12.3 GB/s memory, "
        "3.46 ns/param optimizer, head 56.7 GFLOP/s (half rate at 14 tokens) + 1.500 ns/logit, embedding 0.321 "
        "ns/element, links 1.25 GB/s + 75 us"
    ]


def test_calibrate_times_the_cpu_head_at_the_job_s_width_and_vocabulary(measured):
    calibrate.calibrate(BASE, "here", [2], CPU, say=lambda line: None)
    assert measured["cpu_head"] == ((256, 512), 50257)  # CPU_HEAD_WIDTHS at CPU_HEAD_VOCAB
    assert measured["embedding"] == (50257, 512)  # the embedding at the widest of them
    model = ModelConfig(n_layers=2, d_model=96, n_heads=2, vocab_size=1000, context_length=64)
    calibrate.calibrate(BASE, "here", [2], CPU, say=lambda line: None, model=model)
    assert measured["cpu_head"] == ((96,), 1000) and measured["embedding"] == (1000, 96)


def test_calibrate_on_cuda_does_not_keep_a_cpu_base_s_embedding_figure(measured):
    base = dataclasses.replace(BASE, embedding_grad_ns=0.3)
    hw = calibrate.calibrate(base, "gpu-here", [2], torch.device("cuda"), say=lambda line: None)
    assert hw.embedding_grad_ns == 0.0 and "embedding" not in measured  # charged at the memory bandwidth


def test_calibrate_profile_from_a_cuda_base_on_cpu_is_fp32(measured):
    base = dataclasses.replace(BASE, device="cuda", compute_dtype="bf16", memory_gb=80.0, reserved_gb=3.0)
    hw = calibrate.calibrate(base, "cpu-here", [2], CPU, say=lambda line: None)
    assert (hw.device, hw.compute_dtype) == ("cpu", "fp32")
