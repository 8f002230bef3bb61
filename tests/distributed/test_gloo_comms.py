"""parallel/gloo_comms.py against gloo's own collectives (an independent implementation) on forked ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_trainer.parallel import gloo_comms
from elastic_trainer.parallel.local_ranks import run_ranks


def _compare(rank: int, world: int) -> dict[str, bool]:
    """Each collective here and gloo's own on the same random inputs, over the whole group and a subgroup."""
    sub = dist.new_group([1, 2]) if world >= 3 else None
    torch.manual_seed(rank)
    out = {}
    for name, group, members in [("world", None, range(world)), ("sub", sub, [1, 2])]:
        if rank not in members or (name == "sub" and sub is None):
            continue
        n = len(members)
        whole = torch.randn(n * 100_003)
        theirs, mine = torch.empty(100_003), torch.full((100_003,), float("nan"))
        dist.reduce_scatter_tensor(theirs, whole.clone(), group=group)
        gloo_comms.reduce_scatter(mine, whole.clone(), group)
        out[f"{name} reduce-scatter"] = torch.equal(theirs, mine)  # the same sums, bit for bit
        part = torch.randn(3, 7) * (rank + 1)
        theirs, mine = torch.empty(3 * n, 7), torch.full((3 * n, 7), float("nan"))
        dist.all_gather_into_tensor(theirs, part, group=group)
        gloo_comms.all_gather(mine, part, group)
        out[f"{name} all-gather"] = torch.equal(theirs, mine)
    return out


def test_reduce_scatter_and_all_gather_equal_gloo_s_own():
    for world in (2, 3):
        results = run_ranks(_compare, world)
        assert all(all(r.values()) for r in results), results
        assert sum(len(r) for r in results) == (4 if world == 2 else 2 + 4 + 4)


def _faults(rank: int, world: int) -> dict[str, int]:
    """Minor page faults of the third call of each: gloo's reduce-scatter and all-gather copy the whole 32 MB
    buffer into a fresh temporary every call (8,192 pages), these do not."""
    import resource

    whole, part = torch.ones(world * 2**22), torch.ones(2**22)
    calls = {
        "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(part, whole),
        "reduce-scatter": lambda: gloo_comms.reduce_scatter(part, whole),
        "gloo all-gather": lambda: dist.all_gather_into_tensor(whole, part),
        "all-gather": lambda: gloo_comms.all_gather(whole, part),
    }
    out = {}
    for name, call in calls.items():
        call(), call()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        call()
        out[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return out


def test_no_temporary_the_size_of_the_buffer():
    for faults in run_ranks(_faults, 2):
        # half the pages of the smallest temporary (the 16 MB part); coverage tracing alone costs ~1,100
        assert faults["reduce-scatter"] < 2048 and faults["all-gather"] < 2048, faults
        assert faults["gloo all-gather"] > 4000, faults  # what this module is for (torch 2.13's gloo)


def _fsdp_comms(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from elastic_trainer.parallel.data_parallel import apply_data_parallel

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4), "1": torch.nn.Linear(4, 4)})
    apply_data_parallel(model, init_device_mesh("cpu", (world,)), "fsdp", torch.float32, True)
    return sorted(
        {
            type(g._all_gather_comm).__name__ + " " + type(g._reduce_scatter_comm).__name__
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups
        }
    )


def test_fsdp_units_on_gloo_take_them():
    assert run_ranks(_fsdp_comms, 2) == [["GlooAllGather GlooReduceScatter"]] * 2


def test_the_benchmark_compares_both_on_ranks_and_restores_ours(tmp_path):
    """benchmarks/collectives/run.py at toy sizes: one row per size with both implementations timed, a steps
    row per mode, and ours in place again afterwards (its A/B switch is this process's, not the product's)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "collectives" / "run.py"
    spec = importlib.util.spec_from_file_location("collectives_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tmp_path / "tiny.toml"
    model.write_text(
        '[model]\nname = "tiny"\nvocab_size = 64\ncontext_length = 128\nd_model = 16\nn_layers = 2\nn_heads = 2\n'
    )
    out = tmp_path / "r.json"
    result = bench.main(
        [
            "--ranks",
            "2:2",
            "--sizes",
            "1,2",
            "--repeat",
            "1",
            "--steps-model",
            str(model),
            "--layout",
            "2,1,1,1",
            "--steps",
            "3",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    assert [(r["ranks"], r["group"], r["mb"]) for r in result["collectives"]] == [(2, 2, 1.0), (2, 2, 2.0)]
    assert all(
        r[k] > 0
        for r in result["collectives"]
        for k in ("all-reduce", "gloo reduce-scatter", "our reduce-scatter", "gloo all-gather", "our all-gather")
    )
    assert [(s["dp_mode"], len(s["gloo_steps"]), len(s["our_steps"])) for s in result["steps"]] == [
        ("zero1", 1, 1),
        ("fsdp", 1, 1),
    ]
    from elastic_trainer.parallel import data_parallel

    assert gloo_comms.is_gloo.__module__ == gloo_comms.__name__ and data_parallel.use_in_fsdp is gloo_comms.use_in_fsdp
