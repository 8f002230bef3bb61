"""The launcher's warm-start checks (launch/warm.py): host memory for two worlds and the state in memory, and
whether a GPU holds the old and the new model together (else the next world builds after the hand-over)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.launch import warm
from elastic_trainer.plan.hardware import load_hardware
from elastic_trainer.plan.layout import Layout

GIB = 1 << 30


def fake_job(
    model: str, layouts: list[Layout], ranks: list[int], hardware: str | None = None, metrics_file: str | None = None
):
    """What warm_refusal and builds_early read of the launcher's JobSetup: phases on one host."""
    phases = list(range(len(layouts)))
    host = SimpleNamespace(name="node1")
    return SimpleNamespace(
        model=load_model_config(model),
        train=SimpleNamespace(seq_len=1024, metrics_file=metrics_file),
        phases=phases,
        placements=lambda phase: [SimpleNamespace(host=host, nproc=ranks[phase])],
        plans=[(SimpleNamespace(layout=layout), "") for layout in layouts],
        spec=SimpleNamespace(hardware=load_hardware(hardware) if hardware else None),
    )


def test_a_small_job_starts_warm(monkeypatch):
    # gpt-tiny at 1024 tokens: 1.6 GiB of logits and loss per rank, which CPU ranks without a pipeline keep 2.8
    # times over (the cpu profile's kept_heap_unpipelined): about 20 GiB per world
    monkeypatch.setattr(warm, "available_bytes", lambda: (48 * GIB, 10 * GIB))
    job = fake_job("gpt-tiny", [Layout(4, 1, 1, 2, 1), Layout(8, 1, 1, 1, 1)], [4, 8])
    assert warm.warm_refusal(job, 0, 1) is None


def test_a_warm_start_that_would_not_fit_host_memory_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(warm, "available_bytes", lambda: (20 * GIB, 10 * GIB))
    job = fake_job("gpt3-xl", [Layout(8, 1, 1, 1, 16), Layout(4, 1, 1, 1, 32)], [8, 4])
    line = warm.warm_refusal(job, 0, 1)
    model = load_model_config("gpt3-xl")
    need = warm.memory_need(model, (job.plans[0][0].layout, 8), (job.plans[1][0].layout, 4), 1024, True)
    assert need.state == model.num_params() * 12  # fp32 weights and two AdamW moments
    assert need.current > 8 * (warm.PROCESS_BYTES + model.num_params() * 4)  # at least the weights per rank
    assert line is not None and "\n" not in line
    assert line.startswith("phase 2: no warm start: the current world (~") and "on node1, which has 20.0 GiB" in line
    assert f"the state in memory (~{need.state / GIB:.1f} GiB)" in line


def test_the_shared_memory_folder_must_hold_the_state(monkeypatch):
    job = fake_job("gpt-tiny", [Layout(4, 1, 1, 2, 1), Layout(2, 1, 1, 4, 1)], [4, 2])
    monkeypatch.setattr(warm, "available_bytes", lambda: (1000 * GIB, 0.05 * GIB))
    assert warm.warm_refusal(job, 0, 1) is None  # 3.4 M parameters x 12 bytes = 41 MB
    monkeypatch.setattr(warm, "available_bytes", lambda: (1000 * GIB, 0.03 * GIB))
    assert "(0.0 GiB in its shared-memory folder)" in warm.warm_refusal(job, 0, 1)


@pytest.mark.parametrize(
    "model, hardware, early",
    [
        ("gpt-tiny", None, True),
        ("gpt3-xl", "cpu", True),
        ("gpt-tiny", "h100-80g", True),
        ("gpt3-xl", "v100-16g", False),
    ],
)
def test_the_next_world_builds_before_the_hand_over_only_where_both_fit(model, hardware, early):
    job = fake_job(
        model, [Layout(8, 1, 1, 1, 16, dp_mode="ddp"), Layout(4, 1, 1, 1, 32, dp_mode="ddp")], [8, 4], hardware
    )
    assert warm.builds_early(job, 0, 1) is early


def test_a_gpu_world_waits_to_build_once_the_job_has_measured_step_times(tmp_path):
    """Rank 0 re-plans with the job's measurements (plan/measured.py), so the launcher's layouts, which
    device_fits checked, may not be the ones the worlds run: the next world builds after the hand-over."""
    layouts = [Layout(8, 1, 1, 1, 16, dp_mode="ddp"), Layout(4, 1, 1, 1, 32, dp_mode="ddp")]
    metrics = tmp_path / "metrics.jsonl"
    assert warm.builds_early(fake_job("gpt-tiny", layouts, [8, 4], "h100-80g", str(metrics)), 0, 1)
    (tmp_path / "measured.jsonl").write_text("{}\n")
    assert not warm.builds_early(fake_job("gpt-tiny", layouts, [8, 4], "h100-80g", str(metrics)), 0, 1)


def test_gpu_ranks_need_host_memory_for_the_staged_copy_too(monkeypatch):
    """GPU ranks copy the state into pinned host memory before writing it to shared memory
    (checkpoint/staging.py): for a moment the host holds it twice; CPU ranks write their tensors as they are."""
    model = load_model_config("gpt3-xl")
    layouts = [Layout(8, 1, 1, 1, 16), Layout(4, 1, 1, 1, 32)]
    state = model.num_params() * 12
    gpu = warm.memory_need(model, (layouts[0], 8), (layouts[1], 4), 1024, on_cpu=False)
    cpu = warm.memory_need(model, (layouts[0], 8), (layouts[1], 4), 1024, on_cpu=True)
    assert (gpu.staging, cpu.staging) == (state, 0)
    assert gpu.total == 12 * warm.PROCESS_BYTES + 2 * state  # processes only: the models are on the GPUs
    # 15.8 GB of state: 32 GiB fits one copy with the processes but not two
    monkeypatch.setattr(warm, "available_bytes", lambda: (32 * GIB, 64 * GIB))
    line = warm.warm_refusal(fake_job("gpt3-xl", layouts, [8, 4], "h100-80g"), 0, 1)
    assert line is not None and "twice while it is staged from the GPUs" in line
    monkeypatch.setattr(warm, "available_bytes", lambda: (40 * GIB, 64 * GIB))
    assert warm.warm_refusal(fake_job("gpt3-xl", layouts, [8, 4], "h100-80g"), 0, 1) is None


def test_cpu_worlds_are_charged_the_heap_their_ranks_keep():
    """On CPU a world's ranks hold their heap at its largest (launch/allocator.py): each is charged the profile's
    kept_heap figure times the live peak, beside its process (the `cpu` profile's figures by default)."""
    from elastic_trainer.plan.memory import stage_memories

    model = load_model_config("gpt3-small")
    pipelined, flat = Layout(2, 1, 2, 4, 1, dp_mode="ddp"), Layout(4, 1, 1, 2, 1, dp_mode="fsdp")
    cpu = load_hardware("cpu")
    for layout, factor in ((pipelined, cpu.kept_heap), (flat, cpu.kept_heap_unpipelined)):
        peak = max(m.total for m in stage_memories(model, layout, 128, "fp32"))
        assert warm.world_bytes(model, layout, 4, 128, True) == 4 * (warm.PROCESS_BYTES + int(factor * peak))
    mine = dataclasses.replace(cpu, kept_heap=1.0, kept_heap_unpipelined=0.0)
    peak = max(m.total for m in stage_memories(model, flat, 128, "fp32"))
    assert warm.world_bytes(model, flat, 4, 128, True, mine) == 4 * (warm.PROCESS_BYTES + peak)
