"""The job spec: what every rank reads instead of the flags; GPU counts no layout fits; rank 0's choice between
the spec's plan and its own."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_trainer import cli_parser, rank, resolve
from elastic_trainer.config import ConfigError, load_model_config
from elastic_trainer.job_spec import JobSpec, PhaseSpec
from elastic_trainer.plan import PlanError, Request, load_hardware, plan
from elastic_trainer.plan.topology import Topology
from elastic_trainer.plan.use_gpus import plan_gpus


def spec_of(*argv: str, world: int = 4, known: bool = True) -> JobSpec:
    return resolve.train_spec(
        cli_parser.train_args(list(argv)), built_by="test", world_size=world, local_world_size=world, hosts_known=known
    )


def test_the_spec_survives_json_exactly(tmp_path):
    spec = spec_of(
        "--hardware",
        "h100-80g",
        "--global-batch",
        "12",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--micro-batch",
        "2",
        "--data",
        "sotu",
        "--events-file",
        str(tmp_path / "e.jsonl"),
    )
    spec = dataclasses.replace(spec, phases=(*spec.phases, PhaseSpec(3, 40, (3, 2), None)))
    again = JobSpec.read(spec.write(tmp_path / "run" / "job.json"))
    assert again == spec and again.hardware.name == "h100-80g" and again.train.data == ("sotu",)
    assert again.phase(3).hosts == (3, 2) and again.phase(None) == spec.phases[0]
    assert json.loads((tmp_path / "run" / "job.json").read_text())["version"] == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not JSON"),
        ('{"version": 99}', "is not a version-1 job spec"),
    ],
)
def test_a_bad_spec_is_one_line(tmp_path, text, message):
    (tmp_path / "job.json").write_text(text)
    with pytest.raises(ConfigError, match=message):
        JobSpec.read(tmp_path / "job.json")
    with pytest.raises(ConfigError, match="every host must see"):
        JobSpec.read(tmp_path / "missing.json")


def request(world: int, hosts=None, batch: int = 12) -> Request:
    return Request(load_model_config("gpt-tiny"), world, batch, 32, load_hardware("cpu"), 8, host_sizes=hosts)


@pytest.mark.parametrize("world, used", [(8, 8), (5, 4), (7, 6), (3, 3), (13, 12)])
def test_a_count_no_layout_fits_trains_on_the_largest_that_one_does(world, used):
    """gpt-tiny (4 heads, 4 layers), global batch 12: a layout needs dp | 12, tp | 4, pp <= 4."""
    with pytest.raises(PlanError) if used < world else pytest.raises(AssertionError):
        plan(request(world))
        raise AssertionError("a plan exists")
    chosen = plan_gpus(request(world))
    assert (chosen.held, chosen.used, chosen.plan.request.world_size) == (world, used, used)
    assert (chosen.note() == "") == (used == world)
    if used < world:
        assert (
            chosen.note() == f"training on {used} of the {world} GPUs, {world - used} idle: no layout of "
            f"{world} GPUs is valid"
        )


def test_the_first_ranks_train_and_keep_their_hosts():
    chosen = plan_gpus(request(5, hosts=(3, 2)))
    assert chosen.used == 4 and chosen.plan.request.host_sizes == (3, 1)
    assert Topology((3, 2)).first(4) == Topology((3, 1)) and Topology((3, 2)).same_hosts((2, 3))


def test_no_count_at_all_is_the_error_of_all_gpus():
    req = dataclasses.replace(request(2), micro_batch=5)  # 5 splits no share of 12
    with pytest.raises(PlanError, match="micro"):
        plan_gpus(req)


def test_fastest_idles_gpus_only_when_predicted_faster():
    """The experiment's 12 H100s and global batch 128: dp8 on 8 of them beats every layout of all 12; `all`
    keeps all 12."""
    req = Request(load_model_config("gpt3-xl"), 12, 128, 1024, load_hardware("h100-80g"), 8)
    every, fastest = plan_gpus(req, "all"), plan_gpus(req, "fastest")
    assert every.used == 12 and fastest.used < 12
    assert fastest.plan.chosen.step_time_s < every.plan.chosen.step_time_s
    assert "predicted faster than 12" in fastest.why


def test_rank0_takes_the_spec_plan_for_its_hosts_and_plans_when_they_differ():
    spec = spec_of("--global-batch", "12", world=5)
    phase = dataclasses.replace(spec.phases[0], hosts=(3, 2))
    layout = resolve.plan_for_hosts(spec, spec.hardware, Topology((3, 2)))[0]
    phase = dataclasses.replace(phase, layout=layout)
    taken = rank.decide(spec, phase, Topology((2, 3)), "s1")
    assert (taken.source, taken.reason, taken.layout, taken.idle) == ("spec", "", layout, 1)
    lost = rank.decide(spec, phase, Topology((3,)), "s2")
    assert lost.source == "planned" and lost.reason == "planned for 3+2 per host, got 3 per host"
    assert lost.layout.world_size == 3 and lost.idle == 0
    detected = rank.decide(dataclasses.replace(spec, hardware=None), phase, Topology((3, 2)), "s3")
    assert detected.source == "planned" and detected.reason == "the job's hardware is detected on the hosts"


def test_a_given_layout_is_taken_whatever_the_hosts_and_checked_against_them():
    spec = spec_of("--layout", "2,2,1", world=4)
    assert rank.decide(spec, spec.phases[0], Topology((4,)), "s").source == "given"
    with pytest.raises(ConfigError, match=r"tp=2 groups would span hosts \(3\+1 per host\)"):
        rank.decide(spec, spec.phases[0], Topology((3, 1)), "s")


def test_the_builder_plans_only_for_hosts_it_knows():
    assert spec_of(world=4).phases[0].layout is not None
    unknown = spec_of(world=4, known=False).phases[0]
    assert unknown.layout is None and unknown.hosts is None


def test_a_spec_with_a_missing_key_is_one_line(tmp_path):
    spec = json.loads(spec_of().to_json())
    del spec["use_gpus"]
    (tmp_path / "job.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"is not a complete job spec \(KeyError: 'use_gpus'\)"):
        JobSpec.read(tmp_path / "job.json")


def test_the_torchrun_wrapper_s_spec_leaves_the_gpus_to_rank0(monkeypatch):
    """Detecting the GPU in the agent would initialize CUDA before it forks its workers."""
    import elastic_trainer.parallel.mesh as mesh

    monkeypatch.setattr(mesh, "accelerator", lambda: pytest.fail("the agent looked at the GPU"))
    args = cli_parser.train_args(["--global-batch", "12"])
    spec = resolve.train_spec(
        args, built_by="torchrun", world_size=None, local_world_size=4, hosts_known=False, detect_hardware=False
    )
    assert spec.hardware is None and spec.phases[0].layout is None
    bad = cli_parser.train_args(["--micro-batch", "5", "--global-batch", "12"])
    with pytest.raises(PlanError, match="micro"):  # the settings are still checked, memory aside
        resolve.train_spec(
            bad, built_by="torchrun", world_size=4, local_world_size=4, hosts_known=True, detect_hardware=False
        )


def test_a_restarted_group_resumes_its_newest_save(tmp_path):
    from elastic_trainer.elastic.torchrun_env import TorchrunEnv

    spec = spec_of("--checkpoint-dir", str(tmp_path), "--resume", "never")
    assert rank.for_restart(spec, TorchrunEnv(restart_count=0)) is spec
    assert rank.for_restart(spec, TorchrunEnv(restart_count=1)).checkpoint.resume == "auto"


def test_idle_ranks_read_the_trainers_code_and_give_up_on_a_dead_store():
    import torch.distributed as dist

    from elastic_trainer.parallel import active

    store = dist.HashStore()
    active.release(store, "s", 75, idle=0)
    assert active.wait_idle(store, "s", lambda: False) == 75 and store.add("elastic_trainer/active/s/read", 0) == 1
    assert active.wait_idle(store, "other", lambda: True) is None  # a signal ends the wait

    class Dead:
        def check(self, keys):
            raise dist.DistNetworkError("connection refused")

    assert active.wait_idle(Dead(), "s", lambda: False, unreachable_s=0.0) == 1
