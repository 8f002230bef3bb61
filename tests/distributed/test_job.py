"""The job sequence and one decision per job, on forked gloo ranks:
- a resume allocates the weights but never computes the seed's initial values (the load overwrites them);
  when every checkpoint fails verification it falls back to the seed's weights;
- its events say what happened, in order, with the load's timings and the layouts before and after;
- ranks learn the real hosts from torchrun's GROUP_RANK and take rank 0's plan, even where their own view
  differs; a refusal on rank 0 is the same one-line error on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig, storage
from elastic_trainer.config import ConfigError, TrainConfig, load_model_config
from elastic_trainer.elastic.events import EventLog, read_jsonl
from elastic_trainer.model import init as model_init
from elastic_trainer.parallel.agree import agree, gather_topology
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job, run_job

MODEL = load_model_config("gpt-tiny")
CFG = TrainConfig(global_batch=8, seq_len=32, steps=6, seed=5, lr=1e-3, warmup_steps=2)


def counting_init(monkeypatch_target: dict) -> None:
    """Count calls of the seed initializer (every parameter's full value is computed through it)."""
    original = model_init.initial_value

    def counted(*args, **kwargs):
        monkeypatch_target["calls"] += 1
        return original(*args, **kwargs)

    model_init.initial_value = counted


def train_then_resume(rank, world, ckpt_dir, tokens, events_path, corrupt=False):
    first = Layout(2, 1, 1, 4, 1)
    run_job(MODEL, CFG, first, torch.device("cpu"), ckpt=CheckpointConfig(dir=ckpt_dir), until=3, tokens=tokens)
    if corrupt and rank == 0:
        for folder in storage.complete_checkpoints(ckpt_dir):
            data = sorted(folder.glob("*.distcp"))[0]
            data.write_bytes(b"\0" * data.stat().st_size)
    torch.distributed.barrier()
    counter = {"calls": 0}
    counting_init(counter)
    events = EventLog(events_path, enabled=rank == 0)
    second = Layout(1, 1, 2, 4, 2)  # another layout: the load reshards
    result = run_job(MODEL, CFG, second, torch.device("cpu"), ckpt=CheckpointConfig(dir=ckpt_dir), until=5,
                     tokens=tokens, events=events)
    events.close()
    return {"init_calls": counter["calls"], "loaded": result.load, "losses": [r["loss"] for r in result.records],
            "status": result.status, "step": result.step}


def straight(rank, world, tokens):
    return [r["loss"] for r in run_job(MODEL, CFG, Layout(1, 1, 1, 8, 1), torch.device("cpu"), tokens=tokens).records]


@pytest.fixture(scope="module")
def reference(sotu_tokens):
    return run_ranks(straight, 1, sotu_tokens)[0]


def test_resume_loads_without_initializing_and_records_events(tmp_path, sotu_tokens, reference):
    events_path = tmp_path / "events.jsonl"
    results = run_ranks(train_then_resume, 2, str(tmp_path / "ck"), sotu_tokens, str(events_path))
    for r in results:
        assert r["init_calls"] == 0, "a resume computed initial weights it then overwrote"
        assert r["loaded"].step == 3 and r["status"] == "stopped" and r["step"] == 5
        assert r["losses"] == pytest.approx(reference[3:5], rel=1e-5)
    load = results[0]["loaded"]
    assert load.saved_layout["dp"] == 2 and load.saved_layout["pp"] == 1
    assert load.total_s == pytest.approx(load.verify_s + load.read_s + load.apply_s, rel=1e-6)
    kinds = [e["event"] for e in read_jsonl(events_path)]
    assert kinds == ["state_loaded", "first_step_done", "stopping", "saved"]
    loaded, first, stopping, saved = read_jsonl(events_path)
    assert loaded["step"] == 3 and loaded["layout"]["pp"] == 2 and loaded["load"]["saved_layout"]["dp"] == 2
    assert first["step"] == 4 and stopping["reason"] == "until step 5" and saved["step"] == 5
    assert loaded["time"] <= first["time"] <= stopping["time"] <= saved["time"]
    assert stopping["last_step_end"] <= stopping["time"]


def test_every_checkpoint_corrupt_stops_instead_of_starting_over(tmp_path, sotu_tokens):
    """Starting from the seed would bury the damaged checkpoints under new saves (and --keep would delete
    them): the resume stops in one line and leaves them as they are."""
    ckpt = tmp_path / "ck"
    with pytest.raises(RuntimeError, match=r"no checkpoint in .*ck can be resumed \(1 damaged; newest: "
                                           r"step-00000003: file __0_0.distcp fails its xxh3_128 checksum"):
        run_ranks(train_then_resume, 2, str(ckpt), sotu_tokens, str(tmp_path / "ev.jsonl"), True)
    assert [p.name for p in storage.complete_checkpoints(ckpt)] == ["step-00000003"]


def hosts_and_agreement(rank, world, groups):
    os.environ["GROUP_RANK"] = str(groups[rank])
    topology = gather_topology()
    chosen = agree(lambda: ("rank", rank, topology.sizes))  # each rank would "decide" differently
    try:
        agree(lambda: (_ for _ in ()).throw(ConfigError("no layout of 5 GPUs")))
        refused = None
    except ConfigError as e:
        refused = str(e)
    return topology.sizes, chosen, refused


def test_ranks_learn_the_hosts_and_take_rank_zeros_decision():
    results = run_ranks(hosts_and_agreement, 4, [0, 0, 0, 1])
    assert {r[0] for r in results} == {(3, 1)}
    assert {r[1] for r in results} == {("rank", 0, (3, 1))}
    assert {r[2] for r in results} == {"no layout of 5 GPUs"}
    assert run_ranks(hosts_and_agreement, 4, [1, 0, 1, 1])[0][0] == (1, 3)  # host order: GROUP_RANK's


def test_job_is_a_context_manager_that_closes_its_checkpointer(tmp_path, sotu_tokens):
    def job(rank, world):
        with Job(MODEL, CFG, Layout(2, 1, 1, 4, 1), torch.device("cpu"), ckpt=CheckpointConfig(dir=str(tmp_path)),
                 tokens=sotu_tokens) as j:
            status = j.fit(until=2)
        return status, j.trainer.step, [p.name for p in storage.complete_checkpoints(tmp_path)]

    assert run_ranks(job, 2)[0] == ("stopped", 2, ["step-00000002"])
