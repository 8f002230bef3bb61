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
    result = run_job(
        MODEL,
        CFG,
        second,
        torch.device("cpu"),
        ckpt=CheckpointConfig(dir=ckpt_dir),
        until=5,
        tokens=tokens,
        events=events,
    )
    events.close()
    return {
        "init_calls": counter["calls"],
        "loaded": result.load,
        "losses": [r["loss"] for r in result.records],
        "status": result.status,
        "step": result.step,
    }


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
    with pytest.raises(
        RuntimeError,
        match=r"no checkpoint in .*ck can be resumed \(1 damaged; newest: "
        r"step-00000003: file __0_0.distcp fails its xxh3_128 checksum",
    ):
        run_ranks(train_then_resume, 2, str(ckpt), sotu_tokens, str(tmp_path / "ev.jsonl"), True)
    assert [p.name for p in storage.complete_checkpoints(ckpt)] == ["step-00000003"]


def hosts_and_agreement(rank, world, groups):
    topology = gather_topology(groups[rank])
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
    """... and keeps the garbage collector off the world's objects while it runs, not after (train/heap.py)."""
    import gc

    def job(rank, world):
        with Job(
            MODEL,
            CFG,
            Layout(2, 1, 1, 4, 1),
            torch.device("cpu"),
            ckpt=CheckpointConfig(dir=str(tmp_path)),
            tokens=sotu_tokens,
        ) as j:
            frozen = gc.get_freeze_count()
            status = j.fit(until=2)
        return (
            status,
            j.trainer.step,
            [p.name for p in storage.complete_checkpoints(tmp_path)],
            frozen,
            gc.get_freeze_count(),
        )

    status, step, saved, frozen, after = run_ranks(job, 2)[0]
    assert (status, step, saved) == ("stopped", 2, ["step-00000002"])
    assert frozen > 10_000 and after == 0, (frozen, after)


def diverge_at(rank, world, ckpt_dir, events_dir, at_steps):
    """Three jobs, each poisoned (NaN loss on rank 1 only) in the step of at_steps[i]: checkpointing from the
    seed, resumed from that run's checkpoint, and without checkpoints. Returns what each raised and emitted."""
    from elastic_trainer.parallel.engine import Engine
    from elastic_trainer.train.loop import Diverged, Trainer

    poison = {"at": None, "step": 0}
    train_step, loss_fn = Trainer.train_step, Engine.loss_fn

    def counted(self):
        poison["step"] = self.step + 1
        return train_step(self)

    def poisoned(self, logits, targets):
        loss = loss_fn(self, logits, targets)
        return loss * float("nan") if poison["step"] == poison["at"] and rank == 1 else loss

    Trainer.train_step, Engine.loss_fn = counted, poisoned
    out = []
    for i, (at, ckpt) in enumerate(
        zip(
            at_steps, [CheckpointConfig(dir=ckpt_dir, save_every=2), CheckpointConfig(dir=ckpt_dir, save_every=2), None]
        )
    ):
        poison["at"] = at
        events = EventLog(os.path.join(events_dir, f"{i}.jsonl"), enabled=rank == 0)
        job = Job(MODEL, CFG, Layout(2, 1, 1, 4, 1), torch.device("cpu"), ckpt=ckpt, tokens=TOKENS[0], events=events)
        try:
            job.fit()
            raised = None
        except Diverged as e:
            raised = (str(e), e.step, str(e.loss), str(e.grad_norm))  # str: nan != nan
        finally:
            job.close()
            events.close()
        out.append((raised, job.trainer.step, [p.name for p in storage.complete_checkpoints(ckpt_dir)]))
    return out


TOKENS: list = []


def test_divergence_names_the_newest_checkpoint_and_saves_nothing(tmp_path, sotu_tokens):
    """A NaN on one rank stops every rank in the same step, with one line naming the checkpoint that is still
    the newest: the last periodic save, the checkpoint the run resumed from, or none."""
    TOKENS[:] = [sotu_tokens]
    ckpt, events = tmp_path / "ck", tmp_path / "ev"
    events.mkdir()
    results = run_ranks(diverge_at, 2, str(ckpt), str(events), [6, 5, 2])
    assert results[0] == results[1]
    (fresh, resumed, plain) = results[0]
    tail = " (lower --lr, check the data, or resume from an earlier checkpoint)"
    assert fresh == (
        (
            "training diverged at step 6: loss nan, gradient norm nan; the step was not applied and the "
            f"newest checkpoint is still step 4 ({ckpt / 'step-00000004'})" + tail,
            6,
            "nan",
            "nan",
        ),
        5,
        ["step-00000004", "step-00000002"],
    )
    assert resumed[0][0] == (
        "training diverged at step 5: loss nan, gradient norm nan; the step was not applied "
        "and the newest checkpoint is still step 4 (resumed from)" + tail
    )
    assert resumed[1:] == (4, ["step-00000004", "step-00000002"])
    assert plain[0][0] == (
        "training diverged at step 2: loss nan, gradient norm nan; the step was not applied and "
        "no checkpoint was saved" + tail
    )
    assert plain[1] == 1
    got = [read_jsonl(events / f"{i}.jsonl") for i in range(3)]
    diverged = [[e for e in g if e["event"] == "diverged"] for g in got]
    assert [len(d) for d in diverged] == [1, 1, 1]
    assert [(d[0]["step"], d[0]["loss"], d[0]["grad_norm"], d[0]["last_saved_step"]) for d in diverged] == [
        (6, "nan", "nan", 4),
        (5, "nan", "nan", 4),
        (2, "nan", "nan", None),
    ]
    assert all(e["event"] not in ("saved", "finished") for g in got for e in g)
