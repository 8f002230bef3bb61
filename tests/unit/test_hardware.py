"""Hardware profiles: the shipped presets, matching a GPU by name, TOML round trip, calibration's fit."""

from __future__ import annotations

import pytest

from elastic_trainer.config import ConfigError
from elastic_trainer.plan.hardware import GIB, Hardware, hardware_for_device, hardware_presets, load_hardware
from elastic_trainer.plan.layout import Layout


def test_presets_load_and_describe_8_gpu_hosts():
    assert {"a100-80g", "h100-80g", "cpu"} <= set(hardware_presets())
    for name in ("a100-80g", "h100-80g"):
        hw = load_hardware(name)
        assert hw.name == name and hw.device == "cuda" and hw.gpus_per_host == 8
        assert hw.intra_host_gbs > hw.inter_host_gbs and 70 < hw.memory_gb < 81
    cpu = load_hardware("cpu")
    assert cpu.device == "cpu" and cpu.shared_host and cpu.compute_units >= 1 and cpu.compute_dtype == "fp32"


@pytest.mark.parametrize("gpu, profile", [("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA A100-SXM4-80GB", "a100-80g")])
def test_gpu_name_picks_profile(gpu, profile):
    assert hardware_for_device("cuda", gpu).name == profile
    assert hardware_for_device("cpu").name == "cpu"


def test_unknown_gpu_asks_for_hardware_flag():
    with pytest.raises(ConfigError) as err:
        hardware_for_device("cuda", "Tesla T4")
    assert "no hardware profile matches GPU 'Tesla T4': pass --hardware NAME (valid: a100-80g, cpu" in str(err.value)
    assert "\n" not in str(err.value)


def test_presets_model_the_hand_over_through_host_memory():
    for name in hardware_presets():
        hw = load_hardware(name)
        assert hw.shm_write_gbs > 0 and hw.shm_read_gbs > 0 and hw.handover_setup_s >= 0, name
    cpu = load_hardware("cpu")  # measured by hand on the CPU machine (configs/hardware/cpu.toml)
    assert (cpu.shm_write_gbs, cpu.shm_read_gbs, cpu.handover_setup_s) == (2.8, 5.0, 1.0)
    with pytest.raises(ConfigError, match="shm_read_gbs=0.0 must be positive"):
        Hardware(name="x", shm_read_gbs=0.0)
    with pytest.raises(ConfigError, match="handover_setup_s=-1.0 must not be negative"):
        Hardware(name="x", handover_setup_s=-1.0)


def test_unknown_profile_and_bad_values_name_the_choices():
    with pytest.raises(ConfigError, match=r"unknown hardware 'tpu' \(valid: a100-80g, cpu, h100-80g"):
        load_hardware("tpu")
    with pytest.raises(ConfigError, match="overlap=2 must be in"):
        Hardware(name="x", overlap=2)


def test_toml_round_trip(tmp_path):
    hw = Hardware(
        name="mine",
        device_names=("X 1",),
        tflops=123.5,
        memory_bandwidth_gbs=1e-3,
        shared_host=True,
        compute_units=3,
        shm_write_gbs=1.25,
        handover_setup_s=0.5,
    )
    path = tmp_path / "mine.toml"
    path.write_text(hw.to_toml())
    assert load_hardware(path) == hw


def test_calibration_fit_recovers_rate_size_effect_and_overhead():
    from elastic_trainer.parallel.calibrate import fit_compute

    rate, half, overhead = 50e9, 40.0, 2e-3  # 50 GFLOP/s, half rate at 40 tokens, 2 ms per block
    points = [
        (f, n, f / (rate * n / (n + half)) + overhead) for f, n in [(1e9, 128), (4e9, 512), (4e9, 128), (16e9, 512)]
    ]
    assert fit_compute(points) == pytest.approx((0.05, 40.0, 2.0), rel=1e-6)


def test_cpu_ranks_take_their_base_and_the_heap_they_keep():
    cpu = load_hardware("cpu")  # measured by benchmarks/planner/heap.py (configs/hardware/cpu.toml)
    assert cpu.kept_heap > 1 and cpu.rank_base_gb > 0
    one = Layout(1, 1, 1, 1, 1)
    assert cpu.rank_bytes(2 * GIB, one) == pytest.approx((cpu.rank_base_gb + 2 * cpu.kept_heap) * GIB)
    flat = Layout(2, 1, 1, 1, 1)  # dp > 1 without a pipeline
    assert cpu.rank_bytes(2 * GIB, flat) == pytest.approx((cpu.rank_base_gb + 2 * cpu.kept_heap_unpipelined) * GIB)
    gpu = load_hardware("h100-80g")  # a GPU's peak is its allocator's: the model's figure
    assert gpu.rank_bytes(2 * GIB, one) == 2 * GIB
    with pytest.raises(ConfigError, match="kept_heap=0.5 must be at least 1"):
        Hardware(name="x", kept_heap=0.5)


def test_collective_shares_are_positive_and_gpu_presets_keep_a_ring_s():
    with pytest.raises(ConfigError, match="all_gather_share=0.0 must be positive"):
        Hardware(name="x", all_gather_share=0.0)
    with pytest.raises(ConfigError, match="reduce_scatter_share=0.0 must be positive"):
        Hardware(name="x", reduce_scatter_share=0.0)
    for name in hardware_presets():
        hw = load_hardware(name)
        if hw.device == "cuda":  # NCCL's ring: half an all-reduce each, the formula before the shares
            assert (hw.all_gather_share, hw.reduce_scatter_share) == (0.5, 0.5), name
