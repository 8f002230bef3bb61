"""train/job.py's Job and run_job on a process group of one in this process (a micro model, a few steps): the
status, the saves, the events and the log lines of each way a fit ends, the resume choices, and, on two forked
ranks, the agreement on stops and periodic saves. The expectations are written out from job.py's docstring."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig, storage
from elastic_trainer.config import ConfigError, ModelConfig, TrainConfig
from elastic_trainer.elastic.events import EventLog, read_jsonl
from elastic_trainer.elastic.stop import StopRequest
from elastic_trainer.model import init as model_init
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job, run_job
from elastic_trainer.train.loop import Diverged
from elastic_trainer.train.metrics import MetricsLog

# 16 * 2902 + 3568 = 50,000 parameters: "0.1 M" in the log (0.05 rounds up)
MODEL = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=2902, context_length=16, name="micro")
B, T, STEPS = 4, 8, 5
# The tokens are always passed: a job that read the configured corpus instead fails on its missing file.
CFG = TrainConfig(global_batch=B, seq_len=T, steps=STEPS, seed=3, lr=1e-3, warmup_steps=2, data=("no-such-corpus.txt",))
LAYOUT = Layout(1, 1, 1, B, 1)
CPU = torch.device("cpu")
TOKENS = np.random.default_rng(1).integers(0, MODEL.vocab_size, 64 * T + 1).astype(np.uint16)


def job(**kwargs) -> Job:
    return Job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, **kwargs)


def events_of(path) -> list[dict]:
    return read_jsonl(path)


def kinds(events: list[dict]) -> list[str]:
    return [e["event"] for e in events]


def names(folder) -> list[str]:
    return [p.name for p in storage.complete_checkpoints(folder)]


def test_a_run_without_checkpoints_finishes_quietly(group, tmp_path, capsys):
    events = EventLog(tmp_path / "ev.jsonl")
    result = run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, events=events)
    events.close()
    assert result.status == "finished" and result.step == STEPS and result.layout == LAYOUT
    assert result.saves == [] and result.load is None
    assert [r["step"] for r in result.records] == list(range(1, STEPS + 1))
    loaded, first, finished = got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "first_step_done", "finished"]
    assert (loaded["step"], loaded["layout"], loaded["load"]) == (0, LAYOUT.to_dict(), None)
    assert (first["step"], first["step_time_s"], first["layout"]) == (
        1,
        result.records[0]["step_time_s"],
        LAYOUT.to_dict(),
    )
    assert finished["step"] == STEPS
    assert capsys.readouterr().out == ""  # no log given: nothing printed


def test_the_log_gets_the_header_the_steps_the_saves_and_the_stop(group, tmp_path, capsys):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True)
    result = run_job(
        MODEL,
        CFG,
        LAYOUT,
        CPU,
        tokens=TOKENS,
        log=log,
        until=3,
        ckpt=CheckpointConfig(dir=str(tmp_path / "ck"), save_every=2),
    )
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "[train] micro (0.1 M parameters) on 1 rank(s), cpu: dp=1 tp=1 pp=1 micro_batch=4 "
        "num_microbatches=1 (fsdp); global batch 4 x 8 tokens, until step 5"
    )
    assert [line.split(" |")[0] for line in out if line.startswith("step ")] == ["step 1", "step 2", "step 3"]
    saved = [line for line in out if line.startswith("[checkpoint]")]
    assert [line.split(" saved to ")[0] for line in saved] == ["[checkpoint] step 2", "[checkpoint] step 3"]
    assert "[train] stopped after step 3 (until step 3)" in out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert result.status == "stopped" and [s.step for s in result.saves] == [2, 3]


def test_without_a_log_the_checkpointer_is_quiet_too(group, tmp_path, capsys):
    run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, until=2, ckpt=CheckpointConfig(dir=str(tmp_path), save_every=1))
    assert capsys.readouterr().out == ""
    assert names(tmp_path) == ["step-00000002", "step-00000001"]


def test_periodic_saves_then_the_last_step_s(group, tmp_path):
    events = EventLog(tmp_path / "ev.jsonl")
    with job(ckpt=CheckpointConfig(dir=str(tmp_path / "ck"), save_every=2), events=events) as j:
        status = j.fit()
    events.close()
    result = j.result(status)
    assert status == "finished" and j.trainer.step == STEPS
    assert [s.step for s in result.saves] == [2, 4, 5] and result.saves is j.checkpointer.history
    assert names(tmp_path / "ck") == ["step-00000005", "step-00000004", "step-00000002"]
    got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "first_step_done", "saved", "finished"]
    assert got[2]["step"] == STEPS and got[2]["save"] == dataclasses.asdict(result.saves[-1])
    assert got[3]["step"] == STEPS


def test_a_save_interval_is_kept_by_rank_zero_s_clock(group, tmp_path):
    """An interval this short is due after every step: each step is saved, so the stop saves nothing more."""
    events = EventLog(tmp_path / "ev.jsonl")
    result = run_job(
        MODEL,
        CFG,
        LAYOUT,
        CPU,
        tokens=TOKENS,
        until=3,
        events=events,
        ckpt=CheckpointConfig(dir=str(tmp_path / "ck"), save_interval_s=1e-9, keep=0),
    )
    events.close()
    assert result.status == "stopped" and [s.step for s in result.saves] == [1, 2, 3]
    got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "first_step_done", "stopping", "saved"]
    stopping = got[2]
    assert (stopping["step"], stopping["reason"], stopping["layout"]) == (3, "until step 3", LAYOUT.to_dict())
    assert stopping["last_step_end"] == result.records[-1]["time"] != result.records[-2]["time"]


def test_the_final_save_blocks_even_when_saves_are_asynchronous(group, tmp_path):
    result = run_job(
        MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, until=2, ckpt=CheckpointConfig(dir=str(tmp_path), async_save=True)
    )
    [save] = result.saves
    assert save.step == 2 and save.stall_s == save.total_s  # a blocking save stalls until it is committed


def test_a_stop_request_saves_and_names_its_reason(group, tmp_path):
    stop_file = tmp_path / "STOP"
    stop_file.touch()  # seen after the first step
    stop = StopRequest(str(stop_file), signals=())
    events = EventLog(tmp_path / "ev.jsonl")
    result = run_job(
        MODEL,
        CFG,
        LAYOUT,
        CPU,
        tokens=TOKENS,
        stop=stop,
        events=events,
        ckpt=CheckpointConfig(dir=str(tmp_path / "ck")),
    )
    events.close()
    assert result.status == "stopped" and result.step == 1 and [s.step for s in result.saves] == [1]
    got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "first_step_done", "stopping", "saved"]
    stopping = got[2]
    assert (stopping["step"], stopping["reason"]) == (1, f"stop file {stop_file}")
    assert stopping["last_step_end"] == result.records[0]["time"] and stopping["layout"] == LAYOUT.to_dict()
    assert got[3]["step"] == 1


def test_a_resume_loads_without_initializing_and_reports_the_load(group, tmp_path, monkeypatch):
    ckpt = CheckpointConfig(dir=str(tmp_path / "ck"))
    straight = run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, until=3)
    first = run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, until=2, ckpt=ckpt)
    assert [r["loss"] for r in first.records] == pytest.approx([r["loss"] for r in straight.records[:2]], rel=1e-6)
    calls = []
    original = model_init.initial_value
    monkeypatch.setattr(model_init, "initial_value", lambda *a, **k: calls.append(a) or original(*a, **k))
    events = EventLog(tmp_path / "ev.jsonl")
    with job(ckpt=ckpt, events=events) as j:
        assert calls == [] and j.loaded.step == 2 and j.trainer.step == 2
        status = j.fit(until=1)  # already past it: no step, and nothing to save
        assert status == "stopped" and j.records == [] and j.checkpointer.history == []
        status = j.fit(until=3)
    events.close()
    assert status == "stopped" and [r["loss"] for r in j.records] == pytest.approx(
        [straight.records[2]["loss"]], rel=1e-6
    )
    got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "stopping", "first_step_done", "stopping", "saved"]
    loaded = got[0]
    expected = dataclasses.asdict(j.loaded)
    expected.pop("meta")
    assert (loaded["step"], loaded["layout"], loaded["load"]) == (2, LAYOUT.to_dict(), expected)
    assert expected["path"] == str(tmp_path / "ck" / "step-00000002")
    assert (got[1]["step"], got[1]["reason"], got[1]["last_step_end"]) == (2, "until step 1", None)
    assert names(tmp_path / "ck") == ["step-00000003", "step-00000002"]


def test_resume_never_starts_fresh_in_an_empty_folder_only(group, tmp_path):
    never = CheckpointConfig(dir=str(tmp_path), resume="never")
    with job(ckpt=never) as j:
        assert j.loaded is None and j.fit(until=1) == "stopped"
    assert names(tmp_path) == ["step-00000001"]
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(step-00000001, \.\.\.\)"):
        job(ckpt=never)


def test_a_named_checkpoint_that_fails_verification_is_the_error(group, tmp_path):
    run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS, until=1, ckpt=CheckpointConfig(dir=str(tmp_path)))
    [folder] = storage.complete_checkpoints(tmp_path)
    data = sorted(folder.glob("*.distcp"))[0]
    data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(storage.CheckpointError) as err:
        job(ckpt=CheckpointConfig(dir=str(tmp_path), resume=str(folder)))
    # the verification's own error, not "no checkpoint in ... can be resumed" (what skipping it would end in)
    assert str(err.value) == f"{folder.name}: file {data.name} fails its xxh3_128 checksum (corrupted)"


def test_divergence_raises_naming_the_newest_checkpoint(group, tmp_path):
    events = EventLog(tmp_path / "ev.jsonl")
    j = job(ckpt=CheckpointConfig(dir=str(tmp_path / "ck"), save_every=2), events=events)
    train_step = j.trainer.train_step

    def poisoned():
        if j.trainer.step == 3:
            raise Diverged(4, float("nan"), 2.5)
        return train_step()

    j.trainer.train_step = poisoned
    with pytest.raises(Diverged) as err:
        j.fit()
    j.close()
    events.close()
    e = err.value
    assert (e.step, e.grad_norm) == (4, 2.5) and str(e.loss) == "nan"
    assert f"the newest checkpoint is still step 2 ({tmp_path / 'ck' / 'step-00000002'})" in str(e)
    got = events_of(tmp_path / "ev.jsonl")
    assert kinds(got) == ["state_loaded", "first_step_done", "diverged"]
    assert names(tmp_path / "ck") == ["step-00000002"]


VAL = np.random.default_rng(2).integers(0, MODEL.vocab_size, 9 * T + 1).astype(np.uint16)  # 9 samples: 2 batches


def test_the_validation_loss_goes_into_the_records_of_every_kth_and_the_last_step(group, tmp_path, capsys):
    """eval_every=2 of 5 steps: after steps 2, 4 and 5; the training records are those of a run without
    validation; a run stopped at 3 and resumed evaluates at 4 and 5 as the straight run did."""
    cfg = dataclasses.replace(CFG, eval_every=2, eval_batches=3)
    plain = run_job(MODEL, CFG, LAYOUT, CPU, tokens=TOKENS)
    log = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True, log_every=10, total_steps=STEPS)
    with Job(MODEL, cfg, LAYOUT, CPU, tokens=TOKENS, val_tokens=VAL, log=log) as j:
        j.fit()
    log.close()
    records = j.records
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]
    for r, p in zip(records, plain.records):
        assert (r["loss"], r["grad_norm"]) == (p["loss"], p["grad_norm"])
    for before, r in zip(records, records[1:]):
        if "val_loss" in r:  # the record's time is the end of its evaluation, which began after the step
            assert r["val_samples"] == 2 * B and r["eval_time_s"] > 0
            assert before["time"] <= r["time"] - r["eval_time_s"] - r["step_time_s"] + 1e-3
    assert records[-1]["val_loss"] == pytest.approx(j.trainer.evaluate(), rel=1e-6)
    assert len({r["val_loss"] for r in records if "val_loss" in r}) == 3
    assert [r.get("val_loss") for r in read_jsonl(tmp_path / "metrics.jsonl")] == [r.get("val_loss") for r in records]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[:3] for line in printed] == [  # log_every=10: evaluated steps are printed anyway
        [f"step {r['step']}/5", f"loss {r['loss']:.4f}", f"val {r['val_loss']:.4f}"] for r in records if "val_loss" in r
    ]
    ckpt = CheckpointConfig(dir=str(tmp_path / "ck"))
    first = run_job(MODEL, cfg, LAYOUT, CPU, tokens=TOKENS, val_tokens=VAL, until=3, ckpt=ckpt)
    resumed = run_job(MODEL, cfg, LAYOUT, CPU, tokens=TOKENS, val_tokens=VAL, ckpt=ckpt)
    assert [r.get("val_loss") for r in first.records + resumed.records] == pytest.approx(
        [r.get("val_loss") for r in records], rel=1e-6
    )
    only_last = run_job(MODEL, dataclasses.replace(cfg, eval_every=0), LAYOUT, CPU, tokens=TOKENS, val_tokens=VAL)
    assert [r["step"] for r in only_last.records if "val_loss" in r] == [5]
    assert not any("val_loss" in r for r in plain.records)
