"""The planner against an exhaustive search written here (its own loops over every dp, tp, pp, micro-batch,
mode and recompute, its own rules, the memory filter and the documented ranking): the same valid candidates
in the same order, the same rejections with their reasons, for GPT-3 XL and gpt-tiny on hosts of 4 and 8,
with roomy and tight memory. Memory numbers by hand from parameter counts, Tenplex's layouts at their best
micro-batch, and one-line advice when nothing works."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.plan import PlanError, Request, load_hardware, plan
from elastic_trainer.plan.candidates import enumerate_candidates, evaluate
from elastic_trainer.plan.hardware import GIB
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import StateBytes, optimizer_step_bytes, stage_memory, state_bytes, working_bytes
from elastic_trainer.plan.report import candidate_dict, plan_dict
from elastic_trainer.plan.step_time import step_time

XL = load_model_config("gpt3-xl")
TINY = load_model_config("gpt-tiny")
H100 = load_hardware("h100-80g")
TENPLEX = {16: (2, 2, 4), 8: (1, 2, 4), 4: (1, 2, 2)}  # dp, tp, pp of Tenplex's GPT-3 XL runs
MODES = ("fsdp", "ddp", "zero1")  # every data-parallel mode, in the ranking's tie-break order


def xl_request(gpus: int, hardware=H100, **kw) -> Request:
    return Request(XL, gpus, 128, 1024, hardware, 8, **kw)


def brute_force(req: Request) -> set:
    """Every (dp, tp, pp, micro, accumulation, mode, recompute) satisfying the rules, by exhaustive search."""
    n, b = req.world_size, req.global_batch
    found = set()
    for dp, tp, pp, m, a in itertools.product(
        range(1, n + 1), range(1, n + 1), range(1, n + 1), range(1, b + 1), range(1, b + 1)
    ):
        hosts_of_tp = {{r // req.gpus_per_host for r in range(g, g + tp)}.__len__() for g in range(0, n, tp)}
        if (
            dp * tp * pp != n
            or dp * m * a != b
            or req.model.n_heads % tp
            or pp > req.model.n_layers
            or hosts_of_tp != {1}
        ):
            continue
        for mode in MODES if dp > 1 else ("fsdp",):
            for rc in (False, True):
                found.add((dp, tp, pp, m, a, mode, rc))
    return found


@pytest.mark.parametrize("model, gpus, per_host, batch", [(TINY, 6, 8, 12), (XL, 12, 8, 16), (XL, 16, 4, 8)])
def test_enumeration_matches_brute_force(model, gpus, per_host, batch):
    req = Request(model, gpus, batch, 128, H100, per_host)
    sized = [c for c in enumerate_candidates(req) if c.micro_batch is not None]
    keys = [(c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.dp_mode, c.recompute) for c in sized]
    assert len(keys) == len(set(keys)) and set(keys) == brute_force(req)


def tp_within_hosts(n: int, per_host: int, tp: int) -> bool:
    """Every group of tp consecutive ranks (the mesh's innermost dimension) on one host of `per_host`."""
    return all(g // per_host == (g + tp - 1) // per_host for g in range(0, n, tp))


def brute_force_plan(req: Request) -> tuple[list, dict, set]:
    """The plan by exhaustive search, with its own loops and rules: (valid keys ranked fastest first, with
    their time and memory; {key: peak bytes} of those that do not fit; the invalid (dp, tp, pp)).
    Ranking as documented: step time, then less memory, fewer pp, fewer tp, no recompute, fsdp, ddp, zero1."""
    model, n, batch, hw = req.model, req.world_size, req.global_batch, req.hardware
    dtype = hw.compute_dtype
    ranked, too_big, bad_degrees = [], {}, set()
    for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3):
        if dp * tp * pp != n:
            continue
        if model.n_heads % tp or not tp_within_hosts(n, req.gpus_per_host, tp) or pp > model.n_layers or batch % dp:
            bad_degrees.add((dp, tp, pp))
            continue
        for micro in range(1, batch // dp + 1):
            if (batch // dp) % micro:
                continue
            for mode in MODES if dp > 1 else ("fsdp",):
                for rc in (False, True):
                    layout = Layout(dp, tp, pp, micro, batch // dp // micro, dp_mode=mode, recompute=rc)
                    key = (dp, tp, pp, micro, batch // dp // micro, mode, rc)
                    peak = max(stage_memory(model, layout, req.seq_len, dtype, s).total for s in range(pp))
                    if peak > hw.usable_bytes:
                        too_big[key] = peak
                        continue
                    seconds = step_time(model, layout, req.seq_len, dtype, hw, req.gpus_per_host).total
                    ranked.append(((round(seconds, 12), peak, pp, tp, rc, MODES.index(mode)), seconds, key))
    ranked.sort(key=lambda r: r[0])
    return [(key, seconds, order[1]) for order, seconds, key in ranked], too_big, bad_degrees


def key_of(c) -> tuple:
    return c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.dp_mode, c.recompute


TIGHT = dataclasses.replace(H100, memory_gb=30.0)  # 26 GiB usable: GPT-3 XL's smaller micro-batches only
TINY_TIGHT = dataclasses.replace(H100, memory_gb=3.5, reserved_gb=3.0)  # 512 MiB: about half of gpt-tiny's layouts
PLAN_REQUESTS = [
    *(xl_request(gpus) for gpus in (16, 8, 4, 12, 6, 2, 1)),
    Request(XL, 8, 64, 1024, TIGHT, 8),
    Request(XL, 16, 32, 2048, TIGHT, 4),  # hosts of 4: tp = 8 would span two
    Request(XL, 1, 16, 1024, TIGHT, 8),
    Request(TINY, 8, 16, 128, H100, 8),
    Request(TINY, 6, 24, 256, TINY_TIGHT, 4),  # hosts 4 + 2
    Request(TINY, 4, 8, 256, TINY_TIGHT, 4),
]


@pytest.mark.parametrize(
    "req",
    PLAN_REQUESTS,
    ids=lambda r: (
        f"{r.model.name}-{r.world_size}gpus-hosts{r.gpus_per_host}-b{r.global_batch}-{r.hardware.memory_gb:g}GB"
    ),
)
def test_plan_is_the_brute_force_optimum(req):
    ranked, too_big, bad_degrees = brute_force_plan(req)
    assert ranked, "the request must have valid layouts"
    result = plan(req)
    # the valid candidates are exactly the brute-force ones, in its order; the first is the fastest
    assert [key_of(c) for c in result.candidates] == [key for key, _, _ in ranked]
    assert result.chosen.step_time_s == min(seconds for _, seconds, _ in ranked)
    assert [(c.step_time_s, c.memory.total) for c in result.candidates] == [(t, m) for _, t, m in ranked]
    for c in result.candidates:
        c.layout.validate(req.world_size, req.model, req.global_batch)
    # everything else is rejected, with its reason: the memory it needs, or the rule the degrees break
    sized = {key_of(c): c.reason for c in result.rejected if c.micro_batch is not None}
    usable = req.hardware.usable_bytes / GIB
    assert sized == {
        key: f"needs {peak / GIB:.1f} GiB per GPU > {usable:.1f} GiB usable" for key, peak in too_big.items()
    }
    assert {c.degrees for c in result.rejected if c.micro_batch is None} == bad_degrees
    assert all(c.reason for c in result.rejected if c.micro_batch is None)
    if req.hardware in (TIGHT, TINY_TIGHT):  # the memory filter is exercised: some fit, some do not
        assert too_big


@pytest.mark.parametrize("gpus", sorted(TENPLEX))
def test_tenplex_layouts_are_evaluated_at_their_best_micro_batch(gpus):
    """`--compare` (best_for) is the fastest valid candidate with Tenplex's degrees, found by brute force; the
    chosen layout is strictly faster (README's table)."""
    req = xl_request(gpus)
    ranked, _, _ = brute_force_plan(req)
    theirs = [(key, seconds) for key, seconds, _ in ranked if key[:3] == TENPLEX[gpus]]
    tenplex = plan(req).best_for(*TENPLEX[gpus])
    assert key_of(tenplex) == theirs[0][0] and tenplex.step_time_s == min(t for _, t in theirs)
    assert ranked[0][1] < 0.9 * tenplex.step_time_s


# gpt-tiny by hand: vocab 50257, d_model 64, 4 blocks, context 256
TINY_BLOCK = (
    (64 + 64)
    + (3 * 64 * 64 + 3 * 64)
    + (64 * 64 + 64)  # ln_1, qkv_proj, o_proj
    + (64 + 64)
    + (4 * 64 * 64 + 4 * 64)
    + (64 * 4 * 64 + 64)
)  # ln_2, mlp.fc, mlp.proj
TINY_EMB = 50257 * 64
TINY_ROOT = TINY_EMB + 256 * 64 + 2 * 64  # token and position embeddings, final LayerNorm
TINY_TENSORS = 4 + 4 * 12


def test_memory_numbers_by_hand():
    assert TINY_BLOCK == 49_984 and TINY_ROOT + 4 * TINY_BLOCK == TINY.num_params() == 3_432_896
    # fp32 AdamW: 4 bytes of parameter, 4 of gradient, 8 of exp_avg + exp_avg_sq per parameter, 4-byte steps
    whole = state_bytes(TINY, Layout(1, 1, 1, 1, 1), 0)
    assert (whole.params, whole.grads) == (4 * 3_432_896, 4 * 3_432_896)
    assert whole.optimizer == 8 * 3_432_896 + 4 * TINY_TENSORS
    assert whole.total == 54_926_544
    # FSDP over 2: every tensor split in halves of ceil(rows / 2) rows; only the embedding's 50257 rows are odd,
    # so parameters and gradients are padded to 25129 rows on both ranks and rank 1's AdamW holds 25128
    half_rest = (3_432_896 - TINY_EMB) // 2
    for rank, emb_rows in [(0, 25129), (1, 25128)]:
        shard = state_bytes(TINY, Layout(2, 1, 1, 1, 1), 0, dp_rank=rank)
        assert shard.params == shard.grads == 4 * (25129 * 64 + half_rest) == 6_865_920
        assert shard.optimizer == 8 * (emb_rows * 64 + half_rest) + 4 * TINY_TENSORS
        # zero1 in bf16: the whole bf16 parameters besides the master shard; the fp32 buffer of both padded
        # shards besides the reduced one; AdamW as FSDP's
        zero1 = state_bytes(TINY, Layout(2, 1, 1, 1, 1, dp_mode="zero1"), 0, dp_rank=rank, dtype="bf16")
        assert zero1 == StateBytes(2 * 3_432_896 + 6_865_920, 3 * 6_865_920, shard.optimizer)
    # the last of 2 pipeline stages: blocks 2 and 3, the final LayerNorm and its own copy of the tied embedding
    last = state_bytes(TINY, Layout(1, 1, 2, 1, 2), 1)
    assert last.params == 4 * (TINY_EMB + 2 * 64 + 2 * TINY_BLOCK)
    # working buffers of bf16 FSDP without a pipeline: the root and 2 blocks gathered (2 bytes) and their
    # gradient buffers (2 bytes + 4 for the fp32 reduction); ddp: the whole stage
    live = TINY_ROOT + 2 * TINY_BLOCK
    assert working_bytes(TINY, Layout(2, 1, 1, 1, 1), 0, "bf16") == live * (2 + 2 + 4) == 26_663_424
    assert working_bytes(TINY, Layout(2, 1, 2, 1, 2, dp_mode="ddp"), 1, "bf16") == (
        TINY_EMB + 2 * 64 + 2 * TINY_BLOCK
    ) * (2 + 4)
    # the optimizer step on the first of 4 stages: the clipping's square of a 2^20-element chunk of the
    # embedding's gradient (fused AdamW allocates nothing); the same for GPT-3 XL on one GPU, and a block's
    # largest matrix (64 x 256) when it is alone
    assert optimizer_step_bytes(TINY, Layout(1, 1, 4, 1, 4), 0) == 4 * 2**20
    assert optimizer_step_bytes(XL, Layout(1, 1, 1, 1, 1), 0) == 4 * 2**20
    assert optimizer_step_bytes(TINY, Layout(1, 1, 4, 1, 4), 1) == 4 * 64 * 256
    # one 1F1B pipeline stage of 4 with one block, 3 micro-batches in flight of 1 x 64 tokens (fp32): the
    # block's input, LayerNorm inputs and outputs, QKV, attention output and MLP hidden (4 d + 12 d floats
    # per token), LayerNorm statistics and the attention log-sum-exp of 4 heads, and the stage's output
    per_mb = 64 * (16 * 64) * 4 + 2 * 2 * 64 * 4 + 64 * 4 * 4 + 64 * 64 * 4
    assert stage_memory(TINY, Layout(1, 1, 4, 1, 4), 64, "fp32", 1).activations == 3 * per_mb == 841_728


def test_rejected_candidates_keep_their_reasons():
    result = plan(xl_request(12))
    reasons = {c.degrees: c.reason for c in result.rejected if c.micro_batch is None}
    assert reasons[(1, 12, 1)] == "tp=12 does not divide n_heads=16"
    assert reasons[(3, 4, 1)] == "dp=3 does not divide the global batch 128"
    assert (1, 1, 12) not in reasons and any(c.degrees == (1, 1, 12) for c in result.candidates)
    small = dataclasses.replace(H100, memory_gb=30.0)
    tight = plan(xl_request(1, hardware=small))
    assert tight.rejected and tight.candidates
    assert all(c.reason.startswith("needs ") and "GiB per GPU > 26.0 GiB usable" in c.reason for c in tight.rejected)
    assert all(c.memory.total <= small.usable_bytes for c in tight.candidates)


def test_tp_stays_within_a_host():
    reasons = {c.degrees: c.reason for c in plan(xl_request(32)).rejected if c.micro_batch is None}
    assert reasons[(2, 16, 1)] == "tp=16 groups would span hosts (8 per host)"


def test_many_gpus_plan_and_constraints():
    result = plan(xl_request(1024))
    assert result.chosen.dp * result.chosen.tp * result.chosen.pp == 1024
    assert result.chosen.dp <= 128 and result.chosen.tp <= 8 and result.chosen.pp <= 24


def test_forced_choices_are_respected():
    result = plan(xl_request(8, micro_batch=2, dp_modes=("ddp",), recompute=(True,)))
    assert {(c.micro_batch, c.dp_mode, c.recompute) for c in result.candidates if c.dp > 1} == {(2, "ddp", True)}
    # zero1 alone runs even on one dp rank (the engine keeps its buffers there too); listed with another mode,
    # that one stands for dp = 1, where fsdp and ddp run alike and zero1 only adds buffers
    only = plan(xl_request(8, dp_modes=("zero1",)))
    assert {c.dp_mode for c in only.candidates} == {"zero1"} and any(c.dp == 1 for c in only.candidates)
    mixed = plan(xl_request(8, dp_modes=("zero1", "ddp")))
    assert {c.dp_mode for c in mixed.candidates if c.dp == 1} == {"ddp"}
    assert {c.dp_mode for c in mixed.candidates if c.dp > 1} == {"zero1", "ddp"}


@pytest.mark.parametrize(
    "req, message",
    [
        (
            xl_request(29),
            "no DP,TP,PP of 29 GPUs is valid (29,1,1: dp=29 does not divide the global batch 128; "
            "1,1,29: pp=29 exceeds n_layers=24; 1,29,1: tp=29 does not divide n_heads=16); "
            "nearest GPU count that works: 28, nearest global batch that works on 29 GPUs: 116",
        ),
        (
            xl_request(100_000),
            "100000 GPUs are more than gpt3-xl with global batch 128 can use: at most dp=128 x tp=8 x pp=24 = 24576",
        ),
        (
            xl_request(1, hardware=dataclasses.replace(H100, memory_gb=12.0)),
            "no layout of 1 GPU(s) fits in memory: the smallest (dp=1 tp=1 pp=1 micro_batch=1 recompute) "
            "needs 22.1 GiB per GPU",
        ),
        (xl_request(2, micro_batch=3), "micro_batch=3 does not divide the per-replica batch 128/2 = 64"),
    ],
)
def test_impossible_requests_say_why_in_one_line(req, message):
    with pytest.raises(PlanError) as err:
        plan(req)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_memory_shortage_suggests_more_gpus_that_work():
    req = xl_request(1, hardware=dataclasses.replace(H100, memory_gb=12.0))
    with pytest.raises(PlanError, match=r"; (\d+) GPUs would work$") as err:
        plan(req)
    more = int(str(err.value).rsplit("; ", 1)[1].split()[0])
    assert plan(dataclasses.replace(req, world_size=more)).chosen.valid
    with pytest.raises(PlanError):
        plan(dataclasses.replace(req, world_size=more - 1))


def test_json_has_chosen_and_ranked_candidates():
    result = plan(xl_request(16))
    out = plan_dict(result, result.best_for(2, 2, 4))
    assert {"dp", "tp", "pp", "micro_batch", "num_microbatches", "memory_gb", "step_time_s"} <= set(out["chosen"])
    assert out["chosen"] == candidate_dict(result.chosen, result.request) == out["candidates"][0]
    assert out["compare"]["step_time_s"] >= out["chosen"]["step_time_s"]
    assert all("reason" in r for r in out["rejected"])


def test_one_gpu_considers_every_dp_mode_only_where_the_host_was_measured():
    """At dp = 1 a data-sheet profile predicts fsdp and ddp alike and zero1 worse, so fsdp stands in for all; a
    profile with each mode's measured host time (h200) tells them apart, and zero1 was measured fastest there."""
    xl = load_model_config("gpt3-xl")

    def modes(hw):
        return {c.dp_mode for c in enumerate_candidates(Request(xl, 1, 8, 2048, load_hardware(hw), 1))}

    assert modes("h100-80g") == {"fsdp"}
    assert modes("h200") == {"fsdp", "ddp", "zero1"}
    best = plan(Request(xl, 1, 8, 2048, load_hardware("h200"), 1)).candidates[0]
    assert (best.dp_mode, best.micro_batch, best.recompute) == ("zero1", 8, False)  # the fastest measured


def test_cpu_ranks_are_planned_with_the_heap_they_keep():
    """On a host whose ranks share its memory, each rank takes its base and `kept_heap` times the peak the
    memory model counts (CPU ranks keep what they free): a host with just that much usable memory admits the
    layout, one with 0.1 GiB less refuses it, naming the figure; counted on live bytes alone it would fit."""
    model = load_model_config("gpt3-small")
    layout = Layout(2, 1, 2, 4, 1, dp_mode="ddp")
    cpu = dataclasses.replace(load_hardware("cpu"), kept_heap=1.5, rank_base_gb=0.25)
    live = [stage_memory(model, layout, 128, "fp32", s).total for s in range(2)]
    need = layout.dp * sum(0.25 * GIB + 1.5 * b for b in live)  # dp ranks of each stage, on the one host
    assert need > layout.dp * sum(live) + 0.1 * GIB

    def evaluated(memory_gb: float):
        hw = dataclasses.replace(cpu, memory_gb=memory_gb)
        return evaluate(Request(model, 4, 8, 128, hw, 4, dtype="fp32", recompute=(False,)), layout)

    assert evaluated(need / GIB + cpu.reserved_gb + 0.05).reason is None
    assert evaluated(need / GIB + cpu.reserved_gb - 0.1).reason == (
        f"needs {need / GIB:.1f} GiB per host > {need / GIB - 0.1:.1f} GiB usable"
    )
    cpu = dataclasses.replace(cpu, kept_heap=1.0, rank_base_gb=0.0)
    assert evaluated(need / GIB + cpu.reserved_gb - 0.1).reason is None
