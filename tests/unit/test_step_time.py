"""The step-time model against hand computations on a made-up device with round numbers."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_trainer.config import ConfigError, ModelConfig
from elastic_trainer.plan.hardware import Hardware, load_hardware
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.step_time import Link, accumulation_bytes, step_time

# 1 TFLOP/s, 1 GB/s inside a host, 0.5 GB/s across, no latency, no overlap, 512 GB/s memory
HW = Hardware(
    name="toy",
    tflops=1.0,
    memory_bandwidth_gbs=512.0,
    logit_ns=0.0,
    optimizer_ns_per_param=0.0,
    intra_host_gbs=1.0,
    inter_host_gbs=0.5,
    intra_host_latency_us=0.0,
    inter_host_latency_us=0.0,
    overlap=0.0,
    gpus_per_host=8,
)
MODEL = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=1000, context_length=32)
SEQ = 32
# By hand, micro-batch 2 (64 tokens), in microseconds:
BLOCK = 3 * (24 * 64 * 64**2 + 2 * 64 * 32 * 64) / 1e6  # forward + backward of a block: 19.6608
HEAD = 3 * 2 * 64 * 64 * 1000 / 1e6  # output head: 24.576
EMB = 2 * 1000 * 64 * 4 / 512e3  # embedding gradient (zero + accumulate): 1.0
HIDDEN = 64 * 64 * 4 / 1e3  # one (2, 32, 64) fp32 activation at 1 GB/s: 16.384
BLOCK_PARAMS = 12 * 64**2 + 13 * 64  # 49984
ROOT_PARAMS = 1000 * 64 + 32 * 64 + 2 * 64  # 66176


def predicted_us(layout: Layout, hw: Hardware = HW, gpus_per_host: int = 8) -> float:
    return step_time(MODEL, layout, SEQ, "fp32", hw, gpus_per_host).total * 1e6


def test_single_device_is_flops_over_rate():
    per_micro_batch = 4 * BLOCK + HEAD + 2 * EMB  # the one stage is first and last
    assert predicted_us(Layout(1, 1, 1, 2, 3)) == pytest.approx(3 * per_micro_batch)


def test_the_head_runs_at_its_own_rate_slowed_for_small_micro_batches():
    """head_tflops 2, head_half_rate_tokens 64: at micro-batch 2 (64 tokens) the head runs at half of 2 TFLOP/s,
    at 8 (256 tokens) at 4/5 of it."""
    hw = dataclasses.replace(HW, head_tflops=2.0, head_half_rate_tokens=64.0)
    assert predicted_us(Layout(1, 1, 1, 2, 1), hw) == pytest.approx(4 * BLOCK + HEAD + 2 * EMB)
    big = Layout(1, 1, 1, 8, 1)
    blocks = 4 * 3 * (24 * 256 * 64**2 + 2 * 256 * 32 * 64) / 1e6
    head = 3 * 2 * 256 * 64 * 1000 / 1e6 / (2.0 * 256 / (256 + 64))
    assert predicted_us(big, hw) == pytest.approx(blocks + head + 2 * EMB)


def test_work_per_micro_batch_and_parameter_is_charged_on_every_stage():
    """microbatch_ns_per_param 1000: 1 us per parameter of the stage, every micro-batch."""
    hw = dataclasses.replace(HW, microbatch_ns_per_param=1000.0)
    single = 4 * BLOCK + HEAD + 2 * EMB + 4 * BLOCK_PARAMS + ROOT_PARAMS
    assert predicted_us(Layout(1, 1, 1, 2, 3), hw) == pytest.approx(3 * single)
    plain = step_time(MODEL, Layout(1, 1, 2, 2, 3), SEQ, "fp32", HW, 8).stages
    charged = step_time(MODEL, Layout(1, 1, 2, 2, 3), SEQ, "fp32", hw, 8).stages
    assert [(c.compute - p.compute) * 1e6 for c, p in zip(charged, plain)] == pytest.approx(
        [
            2 * BLOCK_PARAMS + 1000 * 64 + 32 * 64,  # the first stage: its blocks and the embeddings
            2 * BLOCK_PARAMS + 1000 * 64 + 2 * 64,
        ]
    )  # the last: its blocks, the tied head and the final norm


def test_the_gradients_summed_over_a_step_s_micro_batches_are_charged_in_every_mode_that_reduces_once():
    """By hand, bytes per parameter of the stage over a step of 4 micro-batches. fp32: autograd keeps the first
    micro-batch's gradient and adds 3 in place (read 4 + 4, write 4); zero1 copies the first into its buffer
    (read 4, write 4) and adds 3. bf16 with fp32 reduction: FSDP2 casts the first into its fp32 accumulator (read
    2, write 4) and adds 3 (read 2 + 4, write 4), as zero1 does. fsdp without a pipeline reduces every
    micro-batch: nothing summed in full size."""

    def per_step(dp, pp, a, mode, dtype="fp32"):
        return accumulation_bytes(Layout(dp, 1, pp, 1, a, dp_mode=mode), dtype) * a

    assert per_step(2, 2, 4, "fsdp") == per_step(2, 1, 4, "ddp") == per_step(2, 2, 4, "ddp") == 3 * 12
    assert per_step(2, 2, 4, "zero1") == 8 + 3 * 12 and per_step(2, 1, 4, "zero1") == 8 + 3 * 12
    assert per_step(2, 1, 4, "fsdp") == 0
    assert per_step(2, 2, 4, "fsdp", "bf16") == per_step(2, 2, 4, "zero1", "bf16") == 6 + 3 * 10
    assert per_step(2, 2, 1, "fsdp") == per_step(2, 1, 1, "ddp") == 0 and per_step(2, 2, 1, "zero1") == 8
    # charged at the memory bandwidth on the stage's parameters: ddp on one device, 3 micro-batches, 2 adds
    ddp = predicted_us(Layout(1, 1, 1, 2, 3, dp_mode="ddp"))
    assert ddp == pytest.approx(3 * (4 * BLOCK + HEAD + 2 * EMB) + STAGE_PARAMS * 2 * 12 / 512e3)


def test_a_measured_embedding_gradient_replaces_the_bandwidth_estimate_on_the_first_stage_only():
    """embedding_grad_ns 2: 2 ns per element of the 1000 x 64 table per micro-batch, 128 us, where two passes at
    512 GB/s charge 1 us (EMB); the last stage's head gradient keeps the bandwidth's figure."""
    hw = dataclasses.replace(HW, embedding_grad_ns=2.0)
    assert predicted_us(Layout(1, 1, 1, 2, 3), hw) == pytest.approx(3 * (4 * BLOCK + HEAD + EMB + 128.0))
    plain = step_time(MODEL, Layout(1, 1, 2, 2, 3), SEQ, "fp32", HW, 8).stages
    charged = step_time(MODEL, Layout(1, 1, 2, 2, 3), SEQ, "fp32", hw, 8).stages
    assert [(c.compute - p.compute) * 1e6 for c, p in zip(charged, plain)] == pytest.approx([128.0 - EMB, 0.0])


def test_recompute_adds_a_forward():
    plain = predicted_us(Layout(1, 1, 1, 2, 1))
    assert predicted_us(Layout(1, 1, 1, 2, 1, recompute=True)) - plain == pytest.approx(4 * BLOCK / 3)


def test_tensor_parallel_halves_blocks_and_adds_four_all_reduces_per_block():
    all_reduce = 2 * (2 - 1) / 2 * HIDDEN
    expected = 4 * BLOCK / 2 + HEAD + 2 * EMB + 4 * 4 * all_reduce  # the head is replicated, not split
    assert predicted_us(Layout(1, 2, 1, 2, 1)) == pytest.approx(expected)


def test_pipeline_is_sum_of_stages_plus_slowest_for_each_further_micro_batch():
    # each stage sums its gradients over the 3 micro-batches in full size (fp32, in place: 2 adds of 12 bytes
    # per parameter), a third of it per micro-batch
    sums = [
        n * 2 * 12 / 3 / 512e3 for n in (2 * BLOCK_PARAMS + 1000 * 64 + 32 * 64, 2 * BLOCK_PARAMS + 1000 * 64 + 2 * 64)
    ]
    first = 2 * BLOCK + EMB + HIDDEN + sums[0]  # sends activations forward
    last = 2 * BLOCK + HEAD + EMB + HIDDEN + sums[1]  # sends their gradients backward
    tied = 2 * (2 - 1) / 2 * 1000 * 64 * 4 / 1e3  # all-reduce of the tied embedding's gradient
    result = step_time(MODEL, Layout(1, 1, 2, 2, 3), SEQ, "fp32", HW, 8)
    assert result.total * 1e6 == pytest.approx(first + last + 2 * last + tied)
    assert result.bubble == pytest.approx(1 / 4)


def test_fsdp_without_pipeline_gathers_twice_and_reduces_every_micro_batch():
    params = 4 * BLOCK_PARAMS + ROOT_PARAMS
    gather, regather, scatter = (0.5 * n * 4 / 1e3 for n in (params, 4 * BLOCK_PARAMS, params))
    compute = 4 * BLOCK + HEAD + 2 * EMB
    assert predicted_us(Layout(2, 1, 1, 2, 2)) == pytest.approx(2 * (compute + gather + regather + scatter))
    # ddp: one all-reduce per step, the 2 micro-batches' gradients summed in full size before it (one add of 12
    # bytes per parameter, half of it per micro-batch); with overlap it hides behind 2/3 of the last micro-batch
    all_reduce = 2 * 0.5 * params * 4 / 1e3
    ddp_mb = compute + params * 12 / 2 / 512e3
    assert predicted_us(Layout(2, 1, 1, 2, 2, dp_mode="ddp")) == pytest.approx(2 * ddp_mb + all_reduce)
    hidden = dataclasses.replace(HW, overlap=1.0)
    assert predicted_us(Layout(2, 1, 1, 2, 2, dp_mode="ddp"), hidden) == pytest.approx(
        2 * ddp_mb + all_reduce - 2 / 3 * ddp_mb
    )


def test_fsdp_pays_latency_per_unit_and_each_collective_its_share_of_an_all_reduce():
    layout = Layout(2, 1, 1, 2, 1)
    slow = dataclasses.replace(HW, intra_host_latency_us=10.0)  # one tree step for 2 ranks
    # per micro-batch: gather root + 4 blocks, gather the 4 blocks again for backward, reduce-scatter all 5
    assert predicted_us(layout, slow) - predicted_us(layout) == pytest.approx((5 + 4 + 5) * 10.0)
    params = 4 * BLOCK_PARAMS + ROOT_PARAMS
    all_reduce = 2 * 0.5 * params * 4 / 1e3  # 2 (n-1)/n of the bytes at 1 GB/s (1e3 bytes per us)
    # a reduce-scatter at 1.0 of an all-reduce instead of a ring's 0.5; the two gathers (the root's once) at 0.3
    gloo = dataclasses.replace(HW, reduce_scatter_share=1.0, all_gather_share=0.3)
    gathered = (params + 4 * BLOCK_PARAMS) / params * all_reduce
    assert predicted_us(layout, gloo) - predicted_us(layout) == pytest.approx(0.5 * all_reduce - 0.2 * gathered)
    assert load_hardware("cpu").reduce_scatter_share == pytest.approx(1.0, abs=0.3)  # this machine's gloo_comms


def test_zero1_reduces_and_gathers_once_per_step_and_copies_at_memory_bandwidth():
    params = 4 * BLOCK_PARAMS + ROOT_PARAMS
    hooks = params * (8 + 12) / 2 / 512e3  # per micro-batch: the first copied into the fp32 buffer, the second added
    scatter = gather = 0.5 * params * 4 / 1e3  # fp32 buffer and master shard over 2 ranks, not overlapped
    copy = params * (4 + 4) / 512e3  # the gathered fp32 weights into the parameters
    compute = 4 * BLOCK + HEAD + 2 * EMB
    layout = Layout(2, 1, 1, 2, 2, dp_mode="zero1")
    assert predicted_us(layout) == pytest.approx(2 * (compute + hooks) + scatter + gather + copy)
    # overlap hides none of it; bf16 moves 2-byte gradients and gathers and copies 2-byte parameters (the
    # reduce-scatter stays fp32)
    assert predicted_us(layout, dataclasses.replace(HW, overlap=1.0)) == pytest.approx(predicted_us(layout))
    bf16 = step_time(MODEL, layout, SEQ, "bf16", HW, 8).total * 1e6
    assert predicted_us(layout) - bf16 == pytest.approx(
        2 * params * 2 / 512e3 + params * 4 / 512e3 + 0.5 * params * 2 / 1e3
    )
    # one collective each way per step, whatever the micro-batches: two latencies; each at its share of an
    # all-reduce (a ring's: 0.5)
    slow = dataclasses.replace(HW, intra_host_latency_us=10.0)
    for accumulation in (1, 4):
        more = Layout(2, 1, 1, 2, accumulation, dp_mode="zero1")
        assert predicted_us(more, slow) - predicted_us(more) == pytest.approx(2 * 10.0)
    gloo = dataclasses.replace(HW, reduce_scatter_share=1.0, all_gather_share=0.25)
    assert predicted_us(layout, gloo) - predicted_us(layout) == pytest.approx(scatter - gather / 2)


def test_an_old_profile_s_reduce_scatter_as_all_reduce_reads_as_a_share_of_one(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text(
        load_hardware("cpu").to_toml().replace("reduce_scatter_share = ", "# ")
        + "reduce_scatter_as_all_reduce = true\n"
    )
    assert load_hardware(old).reduce_scatter_share == 1.0
    old.write_text(
        old.read_text().replace("reduce_scatter_as_all_reduce = true", "reduce_scatter_as_all_reduce = false")
    )
    assert load_hardware(old).reduce_scatter_share == 0.5
    old.write_text(
        old.read_text().replace("reduce_scatter_as_all_reduce = false", 'reduce_scatter_as_all_reduce = "yes"')
    )
    with pytest.raises(ConfigError, match="reduce_scatter_as_all_reduce='yes' must be true or false"):
        load_hardware(old)


def test_zero1_pipeline_stages_communicate_their_own_parameters_and_a_shard_of_the_tied_embedding():
    first, last = 2 * BLOCK_PARAMS + 1000 * 64 + 32 * 64, 2 * BLOCK_PARAMS + 1000 * 64 + 2 * 64
    stage_first = 2 * BLOCK + EMB + HIDDEN + first * 8 / 512e3  # one micro-batch: its gradients copied, 8 bytes
    stage_last = 2 * BLOCK + HEAD + EMB + HIDDEN + last * 8 / 512e3
    comm = 2 * 0.5 * first * 4 / 1e3 + first * 8 / 512e3  # the first stage's, the larger
    tied = 2 * (2 - 1) / 2 * 1000 * 64 * 4 / 2 / 1e3  # all-reduce of this rank's half of the embedding gradient
    result = step_time(MODEL, Layout(2, 1, 2, 2, 1, dp_mode="zero1"), SEQ, "fp32", HW, 8)
    assert result.total * 1e6 == pytest.approx(stage_first + stage_last + comm + tied)
    assert result.dp_comm * 1e6 == pytest.approx(comm + tied)


def test_data_parallel_across_hosts_uses_the_slower_link():
    layout = Layout(4, 1, 1, 2, 1, dp_mode="ddp")
    within, across = predicted_us(layout, gpus_per_host=4), predicted_us(layout, gpus_per_host=2)
    all_reduce = 2 * 3 / 4 * (4 * BLOCK_PARAMS + ROOT_PARAMS) * 4 / 1e3
    assert across - within == pytest.approx(all_reduce)  # half the bandwidth: twice the time


def test_optimizer_time_counts_local_parameters():
    hw = dataclasses.replace(HW, optimizer_ns_per_param=1000.0)  # 1 us per parameter
    params = 4 * BLOCK_PARAMS + ROOT_PARAMS
    base = predicted_us(Layout(2, 1, 1, 2, 1, dp_mode="ddp"))
    assert predicted_us(Layout(2, 1, 1, 2, 1, dp_mode="ddp"), hw) - base == pytest.approx(params)
    for mode in ("fsdp", "zero1"):  # both update their shard of the master weights
        layout = Layout(2, 1, 1, 2, 1, dp_mode=mode)
        assert predicted_us(layout, hw) - predicted_us(layout) == pytest.approx(params / 2)


def test_shared_host_bounds_the_step_by_total_work_over_cores():
    cpu = dataclasses.replace(HW, shared_host=True, compute_units=1)
    compute = 4 * BLOCK + HEAD + 2 * EMB
    all_reduce = 2 * 0.5 * (4 * BLOCK_PARAMS + ROOT_PARAMS) * 4 / 1e3
    # ddp's copies on CPU ranks (wrapper_bytes): the parameters copied into place once (8 bytes), the
    # gradient copied into the all-reduce's input (8), divided into a new buffer and copied out (16)
    copies = (4 * BLOCK_PARAMS + ROOT_PARAMS) * (8 + 8 + 16) / 512e3
    # 2 ranks on 1 core: the two replicas' work runs one after the other, and so does their communication
    assert predicted_us(Layout(2, 1, 1, 2, 1, dp_mode="ddp"), cpu) == pytest.approx(2 * (compute + all_reduce + copies))
    two = dataclasses.replace(cpu, compute_units=2)
    assert predicted_us(Layout(2, 1, 1, 2, 1, dp_mode="ddp"), two) == pytest.approx(compute + all_reduce + copies)


def test_shared_host_slows_the_tensor_parallel_links_as_the_data_parallel_ones():
    """calibrate measures a CPU host's links on idle ranks, a core each; a job's tp and dp collectives run while
    the host's ranks share its cores, so both links are ranks / compute_units times slower (the pipeline's sends
    are not: one rank waits on the other)."""
    from elastic_trainer.plan.step_time import Links
    from elastic_trainer.plan.topology import Topology

    cpu = dataclasses.replace(HW, shared_host=True, compute_units=2, intra_host_gbs=3.0, intra_host_latency_us=50.0)
    links = Links.of(Layout(2, 2, 2, 1, 1), cpu, Topology((8,)))
    assert links.tp == Link(3.0 / 4, 50.0 * 4) and links.dp == Link(3.0 / 4, 50.0 * 4)
    assert links.pp == Link(3.0, 50.0)
    idle = Links.of(Layout(2, 2, 2, 1, 1), dataclasses.replace(cpu, shared_host=False), Topology((8,)))
    assert idle.tp == idle.dp == idle.pp == Link(3.0, 50.0)


def test_link_latency_tree_or_ring():
    tree, ring = Link(1.0, 10.0), Link(1.0, 10.0, ring_latency=True)
    assert tree.all_reduce(0, 8) == pytest.approx(2 * 3 * 10e-6)
    assert ring.all_reduce(0, 8) == pytest.approx(2 * 7 * 10e-6)
    assert ring.gather(8e9, 8) == pytest.approx(7 + 7 * 10e-6)
    assert tree.all_reduce(1e9, 1) == 0.0


def test_a_compiled_job_runs_its_blocks_compiled_speedup_times_faster():
    """--compile divides the blocks' forward + backward (and nothing else) by the profile's measured
    compiled_speedup; the planner applies it to a compiled job's request only. Hand computation on one rank
    (no communication): the step shrinks by micro-batches x layers x block time x (1 - 1/speedup)."""
    from elastic_trainer.config import load_model_config
    from elastic_trainer.plan import Request, load_hardware
    from elastic_trainer.plan.candidates import evaluate
    from elastic_trainer.plan.step_time import block_flops

    model, hw = load_model_config("gpt3-xl"), dataclasses.replace(load_hardware("h100-80g"), compiled_speedup=1.25)
    layout, seq = Layout(1, 1, 1, 2, 4, "ddp"), 2048
    tokens = layout.micro_batch * seq
    block = (
        3 * block_flops(model, tokens, seq, 1) / (hw.tflops * 1e12 * tokens / (tokens + hw.half_rate_tokens))
        + hw.layer_overhead_ms * 1e-3
    )
    eager = step_time(model, layout, seq, "bf16", hw, 8).total
    compiled = step_time(model, layout, seq, "bf16", hw, 8, block_speedup=1.25).total
    assert eager - compiled == pytest.approx(4 * model.n_layers * block * (1 - 1 / 1.25), rel=1e-9)
    request = Request(model, 1, 8, seq, hw, 8, dtype="bf16")
    assert evaluate(request, layout).time.total == pytest.approx(eager)
    assert evaluate(dataclasses.replace(request, compiled=True), layout).time.total == pytest.approx(compiled)


# --- a GPU whose host was measured (calibrate --model on the GPU) -----------------------------------------------

STAGE_PARAMS = 4 * BLOCK_PARAMS + ROOT_PARAMS  # the one stage's parameters (tied embedding once)


def test_the_host_s_time_per_block_bounds_a_micro_batch_when_it_exceeds_the_device_s():
    slow_host = dataclasses.replace(HW, zero1_host_block_ms=1.0)  # 4 blocks: 4 ms per micro-batch on the host
    zero1_adds = STAGE_PARAMS * (8 + 2 * 12) / 3 / 512e3  # us: copy then 2 adds into the fp32 buffer, per mb
    copy = STAGE_PARAMS * 2 * 4 / 512e3  # us: the gathered weights into the parameters
    device = 4 * BLOCK + HEAD + 2 * EMB + zero1_adds
    assert device < 4000
    assert predicted_us(Layout(1, 1, 1, 2, 3, dp_mode="zero1"), slow_host) == pytest.approx(3 * 4000 + copy)
    fast_host = dataclasses.replace(HW, zero1_host_block_ms=0.001)  # the device's time wins
    assert predicted_us(Layout(1, 1, 1, 2, 3, dp_mode="zero1"), fast_host) == pytest.approx(3 * device + copy)


def test_recompute_makes_the_host_issue_a_third_more():
    slow_host = dataclasses.replace(HW, fsdp_host_block_ms=1.0)
    step = step_time(MODEL, Layout(1, 1, 1, 2, 1, recompute=True), SEQ, "fp32", slow_host, 8)
    assert step.stages[0].compute == pytest.approx(4 * 4 / 3 * 1e-3)


def test_layer_overhead_is_not_charged_where_the_host_s_time_is_known():
    overhead = dataclasses.replace(HW, layer_overhead_ms=0.001)  # 1 us per block
    assert predicted_us(Layout(1, 1, 1, 2, 1), overhead) - predicted_us(Layout(1, 1, 1, 2, 1)) == pytest.approx(4.0)
    hosted = dataclasses.replace(overhead, fsdp_host_block_ms=1e-6)
    plain_hosted = dataclasses.replace(HW, fsdp_host_block_ms=1e-6)
    assert predicted_us(Layout(1, 1, 1, 2, 1), hosted) == pytest.approx(
        predicted_us(Layout(1, 1, 1, 2, 1), plain_hosted)
    )


def test_fsdp2s_copies_are_charged_by_bytes_on_a_gpu_only_where_its_host_was_measured():
    # by hand, bf16 (e = 2) on one rank, bytes per parameter: an unshard reads 4 and writes 2 (the cast into the
    # all-gather's input), the gather writes 2, the copy-out reads 2 and writes 2: 14 (with the collective's
    # read of its input, (4 + e) / dp + 4e); a reduction reads 2, writes 4 (the cast), the reduce-scatter writes
    # 4, the add into the sharded gradient reads 8 and writes 4: e + 4 + 16 / dp = 22
    hosted = dataclasses.replace(HW, fsdp_host_block_ms=1e-6, ddp_host_block_ms=1e-6, zero1_host_block_ms=1e-6)

    def us(layout, hw):
        return step_time(MODEL, layout, SEQ, "bf16", hw, 8).total * 1e6

    for mode, per_microbatch, per_step in [("fsdp", 2 * 14 + 22, 0), ("ddp", 14, 22)]:
        layout = Layout(1, 1, 1, 2, 3, dp_mode=mode)
        extra = us(layout, hosted) - us(
            layout, dataclasses.replace(hosted, fsdp_host_block_ms=0.0, ddp_host_block_ms=0.0, zero1_host_block_ms=0.0)
        )
        assert extra == pytest.approx(STAGE_PARAMS * (3 * per_microbatch + per_step) / 512e3), mode
    # with a pipeline fsdp gathers and reduces once per step: 14 + 22 on the larger stage
    two = Layout(1, 1, 2, 2, 3, dp_mode="fsdp")
    step, plain = (step_time(MODEL, two, SEQ, "bf16", hw, 8) for hw in (hosted, HW))
    larger = max(2 * BLOCK_PARAMS + 1000 * 64 + 32 * 64, 2 * BLOCK_PARAMS + 1000 * 64 + 2 * 64)
    assert step.hooks - plain.hooks == pytest.approx(larger * 36 / 512e9)
    # a data-sheet profile (no host time measured) lumps such work into its sustained rate: nothing added
    assert us(Layout(1, 1, 1, 2, 3, dp_mode="ddp"), HW) == pytest.approx(
        step_time(MODEL, Layout(1, 1, 1, 2, 3, dp_mode="ddp"), SEQ, "bf16", HW, 8).total * 1e6
    )
    assert step_time(MODEL, Layout(1, 1, 1, 2, 3, dp_mode="ddp"), SEQ, "bf16", HW, 8).hooks == 0.0


def test_fsdp2s_copies_on_cpu_ranks_by_hand():
    """CPU ranks (fp32, gloo, whose collectives calibrate timed with their own writes), bytes per parameter of the
    stage at dp 2 with 4 micro-batches (how often: tests/unit/test_fsdp_copies.py counts it in torch): fsdp's
    unshard copies the shard into the all-gather's input (read 4, write 4: 8 / dp) and the gathered buffer out
    (8); its reduction copies the gradient into the reduce-scatter's input (8) and, from the second reduction
    of a step, adds the shard into the sharded gradient (read 8, write 4: 12 / dp). Without a pipeline the
    blocks unshard twice a micro-batch and the root (a share of the stage) once. ddp copies the parameters into
    place (8) each micro-batch and reduces once (8 in, 16 for the division's buffer and its copy out); bf16
    casts before that copy (4 + 3 x 2)."""
    from elastic_trainer.plan.step_time import Links, stage_time
    from elastic_trainer.plan.topology import Topology
    from elastic_trainer.plan.traffic import wrapper_bytes

    unshard = 8 / 2 + 8
    assert wrapper_bytes(Layout(2, 1, 1, 1, 4, dp_mode="fsdp"), "fp32", True, 0.5) == pytest.approx(
        (1.5 * unshard + 8 + 6 * 3 / 4, 0.0)
    )
    assert wrapper_bytes(Layout(2, 1, 2, 1, 4, dp_mode="fsdp"), "fp32", True) == (0.0, unshard + 8)
    assert wrapper_bytes(Layout(2, 1, 1, 1, 4, dp_mode="ddp"), "fp32", True) == (8, 8 + 16)
    assert wrapper_bytes(Layout(2, 1, 2, 1, 4, dp_mode="ddp"), "fp32", True) == (0.0, 8 + 8 + 16)
    assert wrapper_bytes(Layout(2, 1, 2, 1, 4, dp_mode="ddp"), "bf16", True) == (0.0, 10 + 6 + 16)
    assert wrapper_bytes(Layout(2, 1, 2, 1, 4, dp_mode="zero1"), "fp32", True) == (0.0, 0.0)
    assert wrapper_bytes(Layout(1, 1, 2, 1, 4, dp_mode="fsdp"), "fp32", True) == (0.0, 0.0)  # nothing wrapped
    # charged in the step at the bandwidth: per step as hooks, per micro-batch in the stage's compute
    cpu = dataclasses.replace(HW, shared_host=True, compute_units=8)  # as many units as ranks: nothing slowed
    layout = Layout(2, 1, 2, 1, 4, dp_mode="ddp")
    larger = max(2 * BLOCK_PARAMS + 1000 * 64 + 32 * 64, 2 * BLOCK_PARAMS + 1000 * 64 + 2 * 64)
    assert step_time(MODEL, layout, SEQ, "fp32", cpu, 8).hooks == pytest.approx(larger * 32 / 512e9)
    assert step_time(MODEL, layout, SEQ, "fp32", HW, 8).hooks == 0.0  # a data-sheet GPU profile: none
    unpiped = Layout(2, 1, 1, 1, 4, dp_mode="fsdp")
    links = Links.of(unpiped, HW, Topology((8,)))
    extra = (
        stage_time(MODEL, unpiped, SEQ, "fp32", cpu, links, 0).compute
        - stage_time(MODEL, unpiped, SEQ, "fp32", HW, links, 0).compute
    )
    params = 4 * BLOCK_PARAMS + ROOT_PARAMS
    assert extra == pytest.approx(
        (4 * BLOCK_PARAMS * 2 * unshard + ROOT_PARAMS * unshard + params * (8 + 6 * 3 / 4)) / 512e9
    )


def test_the_activation_term_is_per_token_and_unit_of_width_on_each_tp_rank():
    act = dataclasses.replace(HW, activation_ns=1.0)  # 1 ns per token and unit of width
    # micro-batch 2: 64 tokens x 64 wide = 4.096 us per block, 4 blocks, 3 micro-batches
    one = Layout(1, 1, 1, 2, 3)
    assert predicted_us(one, act) - predicted_us(one) == pytest.approx(3 * 4 * 4.096)
    tp2 = Layout(1, 2, 1, 2, 1)
    assert predicted_us(tp2, act) - predicted_us(tp2) == pytest.approx(4 * 4.096 / 2)


def test_on_a_shared_host_a_pipelined_stage_s_reduction_runs_in_its_schedule():
    """4 ranks on 2 cores, dp2 x pp2, zero1: each stage's gradient reduce-scatter (at idle link speed, the
    cores shared by shared_cores.makespan) ends that stage's schedule; only the all-gather after the
    optimizer step, with every rank in it (slowed 2x), and the tied embedding's all-reduce stay after it."""
    from elastic_trainer.plan.memory import stage_elements
    from elastic_trainer.plan.shared_cores import makespan

    cpu = dataclasses.replace(
        HW,
        shared_host=True,
        compute_units=2.0,
        reduce_scatter_share=1.0,
        all_gather_share=0.5,
        memory_bandwidth_gbs=512.0,
    )
    layout = Layout(2, 1, 2, 2, 1, dp_mode="zero1")
    result = step_time(MODEL, layout, SEQ, "fp32", cpu, 4)
    whole = [sum((r, b * n)) for r, b, n in (stage_elements(MODEL, layout, s) for s in range(2))]
    reduce = [w * 4 / 1e9 for w in whole]  # an all-reduce over 2 ranks at 1 GB/s: the bytes' time, idle
    gather = [0.5 * w * 4 / 1e9 * 2 + w * 8 / 512e9 for w in whole]  # slowed 4 ranks / 2 cores; the copy
    tied = 1000 * 64 * 4 / 2 / 1e9  # this rank's half of the embedding gradient between the stages (not slowed)
    computes = tuple(t.compute for t in result.stages)
    stages = makespan(computes, 1, 2, 2.0, 1 / 3, (0.0, 0.0), tuple(reduce))
    assert result.pipeline == pytest.approx(stages + max(t.tp_comm + t.p2p for t in result.stages))
    assert result.dp_comm == pytest.approx(max(gather) + tied) and result.tied == pytest.approx(tied)
    idle = dataclasses.replace(cpu, shared_host=False)  # dedicated devices: the reduction after the schedule
    assert step_time(MODEL, layout, SEQ, "fp32", idle, 4).dp_comm == pytest.approx(
        max(r + 0.5 * w * 4 / 1e9 + w * 8 / 512e9 for r, w in zip(reduce, whole)) + tied
    )
