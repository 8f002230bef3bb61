"""`plan --explain` (plan/explain.py): the predicted step time term by term. The terms must add up to the
step time the planner ranks layouts by, for every valid layout, and the largest term is checked against a
hand computation of the model's formula."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_trainer import cli
from elastic_trainer.config import load_model_config
from elastic_trainer.plan import Request, load_hardware, measured, plan
from elastic_trainer.plan.explain import by_phase, terms
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import stage_numel
from elastic_trainer.plan.step_time import Links, dp_comm_time


@pytest.mark.parametrize(
    "model, gpus, batch, seq, hardware, compiled",
    [
        ("gpt3-small", 4, 8, 128, "cpu", False),
        ("gpt3-xl", 16, 64, 2048, "h100-80g", False),
        ("gpt3-xl", 16, 64, 2048, "h100-80g", True),
        ("gpt-tiny", 6, 12, 64, "v100-16g", False),
    ],
)
def test_the_terms_add_up_to_the_planned_step_time_of_every_layout(model, gpus, batch, seq, hardware, compiled):
    hw = dataclasses.replace(load_hardware(hardware), compiled_speedup=1.25)
    req = Request(load_model_config(model), gpus, batch, seq, hw, 8 if hardware != "cpu" else gpus, compiled=compiled)
    result = plan(req)
    assert len(result.candidates) > 10
    for c in result.candidates:
        rows = terms(req, Layout(c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.dp_mode, c.recompute))
        assert all(s >= 0 for _, s in rows)
        assert sum(s for _, s in rows) == pytest.approx(c.step_time_s, rel=1e-12), c


def test_the_blocks_term_by_hand():
    """One GPU, one micro-batch of 2 x 2048 tokens, GPT-3 XL on the data-sheet H100: 24 blocks of
    3 x (24 t d^2 + 2 t s d) FLOPs at the size-derated rate, plus the fixed time per block."""
    hw, model = load_hardware("h100-80g"), load_model_config("gpt3-xl")
    req = Request(model, 1, 2, 2048, hw, 1)
    rows = dict(terms(req, Layout(1, 1, 1, 2, 1, "fsdp")))
    t, d, s = 2 * 2048, 2048, 2048
    rate = 500e12 * t / (t + 256)  # tflops and half_rate_tokens of configs/hardware/h100-80g.toml
    blocks = 24 * (3 * (24 * t * d * d + 2 * t * s * d) / rate + 0.05e-3)
    assert rows["transformer blocks (forward + backward)"] == pytest.approx(blocks, rel=1e-12)
    assert rows["pipeline fill and drain"] == rows["tensor-parallel all-reduces"] == 0.0
    assert rows["data-parallel communication not hidden (fsdp)"] == 0.0  # one rank


def test_the_work_per_parameter_term_by_hand():
    """gpt3-small on the cpu profile, dp1 pp4, 8 micro-batches: the slowest stage's parameters times
    microbatch_ns_per_param, once per micro-batch, in its own row and not in the head's."""
    model = load_model_config("gpt3-small")
    hw = load_hardware("cpu")
    layout = Layout(1, 1, 4, 1, 8, "fsdp")
    with_term = dict(terms(Request(model, 4, 8, 128, hw, 4), layout))
    without = dict(terms(Request(model, 4, 8, 128, dataclasses.replace(hw, microbatch_ns_per_param=0.0), 4), layout))
    slowest = stage_numel(model, layout, 3)  # the last stage, with the output head, is the slowest
    assert with_term["work per micro-batch and parameter of the stage"] == pytest.approx(
        8 * slowest * hw.microbatch_ns_per_param * 1e-9, rel=1e-12
    )
    assert without["work per micro-batch and parameter of the stage"] == 0.0
    head = "output head and embedding gradient, gradient accumulation"  # fsdp's 8 micro-batches summed in full
    assert with_term[head] == pytest.approx(without[head])


def test_fsdp2s_copies_have_their_rows_on_cpu_ranks():
    """gpt3-small on the cpu profile, dp2 without a pipeline, 2 micro-batches of 2: fsdp's copies every
    micro-batch are in the compute row beside the head, by hand: each block's parameters gathered twice (8 / 2
    bytes copied in, 8 out), the root's once, every parameter's gradient copied into the reduce-scatter (8)
    and on the second micro-batch the shard added (12 / 2); at the bandwidth (the tied head's table gradient
    too: two passes of 4 bytes). ddp under a pipeline: its copies once per step, in the hooks row."""
    from elastic_trainer.plan.memory import stage_elements

    model, hw = load_model_config("gpt3-small"), load_hardware("cpu")
    fsdp = Layout(2, 1, 1, 2, 2, "fsdp")
    rows = dict(terms(Request(model, 4, 8, 128, hw, 4), fsdp))
    bare = dict(terms(Request(model, 4, 8, 128, dataclasses.replace(hw, memory_bandwidth_gbs=1e15), 4), fsdp))
    copies = "output head and embedding gradient, fsdp's copies around its collectives"
    root, block, n = stage_elements(model, fsdp, 0)
    per_microbatch = 2 * block * n * 12 + root * 12 + (root + block * n) * (8 + 6 / 2)
    tied_head = 2 * model.vocab_size * model.d_model * 4
    assert rows[copies] - bare[copies] == pytest.approx(
        2 * (per_microbatch + tied_head) / (hw.memory_bandwidth_gbs * 1e9), rel=1e-6
    )
    ddp = Layout(2, 1, 2, 2, 2, "ddp")
    hooks = "ddp's copies around its collectives and measured excess, per step"
    assert dict(terms(Request(model, 4, 8, 128, hw, 4), ddp))[hooks] > 0


def test_plan_explain_prints_the_chosen_and_the_compared_layout(capsys):
    code = cli.main(
        [
            "plan",
            "--model",
            "gpt3-small",
            "--gpus",
            "4",
            "--global-batch",
            "8",
            "--seq-len",
            "128",
            "--hardware",
            "cpu",
            "--explain",
            "--compare",
            "1,1,4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.count("\nexplain dp") == 2
    block = out[out.index("explain dp") :].splitlines()
    block = block[: next(i for i, line in enumerate(block) if line.startswith("  (predictions"))]
    total = float(block[0].split(": ")[1].split(" s per step")[0])
    assert block[0].startswith("explain dp2 tp1 pp2, micro-batch 4 x 1, zero1: ")
    assert block[1].lstrip().startswith("transformer blocks (forward + backward)")
    assert sum(float(line.split()[-4]) for line in block[1:]) == pytest.approx(total, rel=1e-3)  # 4 digits each


def test_the_phases_sum_the_terms_they_run_in():
    """zero1 on two stages: the tied embedding's all-reduce (fp32, 1/dp of it, 2 ranks over the pp link) is the
    clip phase's, zero1's all-gather of the stage in the compute dtype plus its copy (2 e bytes per element at
    memory bandwidth) the sync phase's, by hand; the phases add up to the step."""
    model, hw = load_model_config("gpt3-small"), load_hardware("h100-80g")
    req = Request(model, 4, 8, 128, hw, 8, dtype="bf16")
    layout = Layout(2, 1, 2, 4, 1, "zero1")
    phases = by_phase(req, layout)
    link_s = lambda nbytes, n: (n - 1) / n * nbytes / (hw.intra_host_gbs * 1e9) + hw.intra_host_latency_us * 1e-6  # noqa: E731
    tied = 2 * link_s(model.vocab_size * model.d_model * 4 / 2, 2)  # an all-reduce: twice a gather's terms
    assert phases["clip"] == pytest.approx(tied, rel=1e-9)
    stage = [
        s
        for s in range(2)
        if dp_comm_time(model, layout, "bf16", hw, Links.of(layout, hw, req.topology), s, 0.0)
        == max(dp_comm_time(model, layout, "bf16", hw, Links.of(layout, hw, req.topology), t, 0.0) for t in range(2))
    ][0]
    whole = stage_numel(model, layout, stage)
    assert phases["sync"] == pytest.approx(
        link_s(whole * 2, 2) + whole * 2 * 2 / (hw.memory_bandwidth_gbs * 1e9), rel=1e-9
    )
    assert sum(phases.values()) == pytest.approx(
        plan(dataclasses.replace(req, dp_modes=("zero1",), micro_batch=4, recompute=(False,)))
        .best_for(2, 1, 2)
        .step_time_s,
        rel=1e-12,
    )
    assert by_phase(req, Layout(2, 1, 2, 4, 1, "fsdp"))["sync"] == 0.0


def _job_record(path, layout: Layout, step_s: float, phases: dict, hosts=(4,)):
    key = measured.job_key("gpt-tiny", 8, 64, "auto", "cpu", False)
    records = [{"step_time_s": step_s, "phases_s": phases}] * 4
    measured.record(path, key, layout, hosts, records, 0.1)


def test_plan_run_dir_sets_the_measured_phases_beside_the_prediction(tmp_path, capsys):
    layout = Layout(1, 1, 4, 8, 1, "fsdp")
    phases = {"batch": 0.01, "forward_backward": 0.8, "clip": 0.05, "optimizer": 0.1, "sync": 0.0}
    _job_record(tmp_path / measured.FILE, layout, 0.96, phases)
    _job_record(tmp_path / measured.FILE, layout, 0.96, {**phases, "forward_backward": 1.2})  # more starts
    _job_record(tmp_path / measured.FILE, layout, 0.96, {**phases, "forward_backward": 3.0})
    _job_record(tmp_path / measured.FILE, layout, 9.0, {**phases, "forward_backward": 9.0}, hosts=(2, 2))  # others
    argv = [
        "plan",
        "--model",
        "gpt-tiny",
        "--gpus",
        "4",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "--hardware",
        "cpu",
        "--explain",
        "--compare",
        "1,1,4",
        "--micro-batch",
        "8",
        "--dp-mode",
        "fsdp",
        "--top",
        "6",
        "--run-dir",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    block = out[out.index("explain dp1 tp1 pp4") :].splitlines()
    assert "measured by this job (3 start(s)" in block[-6]
    rows = {line[:70].strip(): line[70:].split() for line in block[-4:]}
    assert (
        rows["forward + backward of every micro-batch, with their communication"][0] == "1.2s"
    )  # median of 0.8, 1.2, 3
    assert rows["tied embedding all-reduce, clipping, loss all-reduce, AdamW"][0] == "0.15s"  # clip + optimizer
    assert rows["reading the batch"][0] == "0.01s"
    assert rows["the whole step (the sum of the phases)"][0] == "1.36s"
    predicted = by_phase(
        plan(
            Request(load_model_config("gpt-tiny"), 4, 8, 64, load_hardware("cpu"), 8, micro_batch=8, dp_modes=("fsdp",))
        ).request,
        layout,
    )
    assert float(rows["tied embedding all-reduce, clipping, loss all-reduce, AdamW"][1][:-1]) == pytest.approx(
        predicted["clip"] + predicted["optimizer"], rel=1e-3
    )
    cells = [line.split() for line in out.splitlines()[2:]]
    table = {row[0]: row for row in cells if row and (row[0].isdigit() or row[0] == "cmp")}
    ran = [(k, row[3], row[-4:-1]) for k, row in table.items() if row[-1] == "measured" and k != "cmp"]
    assert [r[1:] for r in ran] == [("4", ["0.960", "533", "75.0%"])]  # pp4 at what the job measured
    assert (
        int(ran[0][0]) > 1 and table["1"][-1] == "predicted" and table["cmp"][-1] == "measured"
    )  # the rest: predictions
    assert cli.main(argv[:-1] + [str(tmp_path / "none")]) == 2
    assert "no measured.jsonl there" in capsys.readouterr().err
    assert cli.main([a if a != "64" else "32" for a in argv]) == 0  # another sequence length: not this job's
    out, err = capsys.readouterr()
    assert "no step time there was measured" in err and "measured by this job" not in out
