"""Nothing is lost on a crash: a rank killed with SIGKILL mid-training, mid-write or just before the commit
leaves at most an uncommitted temporary folder; the restart (in another layout) resumes from the newest
complete checkpoint and its losses equal the uninterrupted run's. Also: corrupted checkpoints are skipped
in one line, asynchronous saves commit the state of their step, and stop requests save before stopping.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, storage
from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.elastic import StopRequest
from elastic_trainer.parallel import build_mesh
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job, Trainer
from tests.distributed.test_reshard import full_state

MODEL = load_model_config("gpt-tiny")
UNTIL = 8


def config(**kw) -> TrainConfig:
    return TrainConfig(global_batch=8, seq_len=32, steps=UNTIL, seed=1, lr=1e-3, warmup_steps=2, **kw)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def train_job(rank, world, layout, ckpt: CheckpointConfig, tokens, crash: str | None = None, stop_file=None):
    """fit() with checkpoints; `crash` = 'step5' | 'write' | 'commit' makes one rank SIGKILL itself."""
    if crash == "write" and rank == world - 1:
        import torch.distributed.checkpoint.filesystem as fs

        original_write = fs._write_item

        def write_one_item_then_die(transforms, stream, *args, **kwargs):
            result = original_write(transforms, stream, *args, **kwargs)
            if "step-00000006" in str(getattr(stream, "name", "")):
                stream.flush()
                kill_self()  # this rank's data file of the step-6 save is half-written
            return result

        fs._write_item = write_one_item_then_die
    if crash == "commit" and rank == 0:
        original_commit = storage.commit

        def die_before_commit(tmp, step, files):
            if step == 6:
                kill_self()
            return original_commit(tmp, step, files)

        storage.commit = die_before_commit
    with Job(MODEL, config(), layout, torch.device("cpu"), ckpt=ckpt, tokens=tokens) as job:
        trainer = job.trainer
        if crash == "step5" and rank == world - 1:
            original_step = trainer.train_step

            def step_then_die():
                record = original_step()
                if trainer.step == 5:
                    kill_self()
                return record

            trainer.train_step = step_then_die
        status = job.fit(StopRequest(stop_file) if stop_file else None)
        state = full_state(trainer)
    return {
        "resumed_from": job.loaded.step if job.loaded else 0,
        "losses": [r["loss"] for r in job.records],
        "status": status,
        "step": trainer.step,
        "stats": job.checkpointer.history,
        "state": state,
    }


@pytest.fixture(scope="module")
def uninterrupted(sotu_tokens, tmp_path_factory):
    ckpt = CheckpointConfig(dir=str(tmp_path_factory.mktemp("uninterrupted")), save_every=2)
    return run_ranks(train_job, 2, Layout(2, 1, 1, 4, 1), ckpt, sotu_tokens)[0]


def assert_resumed(result: dict, uninterrupted: dict, from_step: int) -> None:
    assert result["resumed_from"] == from_step
    expected = uninterrupted["losses"][from_step:]
    assert len(result["losses"]) == len(expected)
    for a, b in zip(result["losses"], expected):
        assert abs(a - b) / b <= 1e-5


@pytest.mark.parametrize("crash", ["step5", "write", "commit"])
def test_sigkill_then_resume_in_another_layout(crash, tmp_path, sotu_tokens, uninterrupted):
    ckpt = CheckpointConfig(dir=str(tmp_path), save_every=2)
    with pytest.raises(RuntimeError, match="exit code -9"):
        run_ranks(train_job, 2, Layout(2, 1, 1, 4, 1), ckpt, sotu_tokens, crash)
    assert storage.complete_checkpoints(tmp_path)[0].name == "step-00000004"
    if crash != "step5":  # the step-6 save died half-way: its folder exists but is not a checkpoint
        assert any(p.name.startswith(storage.TMP_PREFIX) for p in tmp_path.iterdir())
    result = run_ranks(train_job, 2, Layout(1, 1, 2, 4, 2), ckpt, sotu_tokens)[0]
    assert_resumed(result, uninterrupted, from_step=4)
    assert not any(p.name.startswith(storage.TMP_PREFIX) for p in tmp_path.iterdir())  # cleaned up


def test_corrupted_and_truncated_checkpoints_fall_back(tmp_path, sotu_tokens, capfd):
    ckpt = CheckpointConfig(dir=str(tmp_path), save_every=2, keep=0)
    run_ranks(train_job, 2, Layout(2, 1, 1, 4, 1), ckpt, sotu_tokens)
    newest, second = storage.complete_checkpoints(tmp_path)[:2]  # step 8, step 6
    data = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with open(sorted(second.glob("*.distcp"))[-1], "r+b") as f:
        f.truncate(100)

    def load_job(rank, world):
        layout = Layout(1, 1, 1, 8, 1)
        trainer = Trainer(MODEL, config(), layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=sotu_tokens)
        return Checkpointer(CheckpointConfig(dir=str(tmp_path))).load(trainer).step

    assert run_ranks(load_job, 1) == [4]
    err = capfd.readouterr().err
    assert "skipping step-00000008: step-00000008: file __" in err and "fails its xxh3_128 checksum" in err
    assert "skipping step-00000006" in err and "truncated" in err
    for older in storage.complete_checkpoints(tmp_path)[2:]:  # now every checkpoint is damaged
        with open(sorted(older.glob("*.distcp"))[0], "r+b") as f:
            f.truncate(100)
    # starting over would bury the damaged checkpoints under new saves (and --keep would delete them)
    with pytest.raises(RuntimeError, match="no checkpoint in .* can be resumed \\(4 damaged; newest: step-00000008"):
        run_ranks(load_job, 1)


def test_async_save_commits_the_state_of_its_step(tmp_path, sotu_tokens, uninterrupted):
    ckpt = CheckpointConfig(dir=str(tmp_path), save_every=3, async_save=True)
    result = run_ranks(train_job, 2, Layout(2, 1, 1, 4, 1), ckpt, sotu_tokens)[0]
    periodic, final = result["stats"][:2], result["stats"][2]
    assert [s.step for s in result["stats"]] == [3, 6, 8] and all(s.path for s in result["stats"])
    # steps 3 and 6 were written in the background: the loop waited for the staging, not for the commit (a
    # synchronous save stalls for exactly its total time, so async_save=False fails here); the last save blocks
    assert all(s.stall_s < s.total_s for s in periodic), periodic
    assert final.stall_s == final.total_s
    assert result["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-6)
    # the step-6 checkpoint holds step 6's state although training went on while it was written
    resumed = run_ranks(
        train_job,
        1,
        Layout(1, 1, 1, 8, 1),
        CheckpointConfig(dir=str(tmp_path), resume=str(tmp_path / "step-00000006")),
        sotu_tokens,
    )[0]
    assert resumed["resumed_from"] == 6  # the folder asked for, not the newest (step 8)
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][6:], rel=1e-5)


def test_stop_file_saves_and_stops_all_ranks(tmp_path, sotu_tokens, uninterrupted):
    stop_file = tmp_path / "STOP"

    def stop_after_three(rank, world, *args):
        original = Trainer.train_step

        def step(self):
            record = original(self)
            if self.step == 3 and rank == 0:  # only one rank sees the file appear
                stop_file.touch()
            return record

        Trainer.train_step = step
        return train_job(rank, world, *args)

    ckpt = CheckpointConfig(dir=str(tmp_path / "ck"))
    result = run_ranks(stop_after_three, 2, Layout(2, 1, 1, 4, 1), ckpt, sotu_tokens, None, str(stop_file))
    assert [r["status"] for r in result] == ["stopped", "stopped"] and result[0]["step"] == 3
    assert storage.complete_checkpoints(tmp_path / "ck")[0].name == "step-00000003"
    stop_file.unlink()
    resumed = run_ranks(train_job, 2, Layout(1, 2, 1, 8, 1), ckpt, sotu_tokens)[0]
    assert_resumed(resumed, uninterrupted, from_step=3)


def test_sigterm_is_a_stop_request():
    stop = StopRequest()
    try:
        assert not stop.local()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.local() and stop.reason == "SIGTERM"
    finally:
        stop.close()
