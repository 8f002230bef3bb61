"""--profile-steps A:B (train/profile.py) on forked gloo ranks: each rank writes one Chrome-trace file of steps
A..B that `json` reads, with the step's labelled phases and the collectives the profiler saw; steps outside
the window are not in it; the losses are those of a run without the profiler."""

from __future__ import annotations

import json

import pytest
import torch

from elastic_trainer.config import ConfigError, TrainConfig, load_model_config
from elastic_trainer.data.corpus import load
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job
from elastic_trainer.train.profile import parse

MODEL = load_model_config("gpt-tiny")


@pytest.fixture(scope="module")
def tokens(data_cache):
    return load(TrainConfig(data_cache=data_cache), quiet=True).train


def train(rank, world, layout, tokens, metrics, profile):
    cfg = TrainConfig(
        global_batch=8,
        seq_len=32,
        steps=4,
        seed=0,
        lr=1e-3,
        warmup_steps=1,
        metrics_file=metrics,
        profile_steps=profile,
    )
    with Job(MODEL, cfg, layout, torch.device("cpu"), tokens=tokens) as job:
        job.fit()


def names(path) -> list[str]:
    trace = json.loads(path.read_text())
    return [e.get("name", "") for e in trace["traceEvents"]]


@pytest.mark.parametrize(
    "layout, labels",
    [
        (
            Layout(2, 1, 1, 2, 2, "zero1"),
            [
                "forward 0",
                "backward 1",
                "zero1 reduce-scatter",
                "clip grad norm",
                "loss all-reduce",
                "optimizer",
                "sync params",
            ],
        ),
        (Layout(1, 1, 2, 2, 4, "ddp"), ["forward 0", "backward 3", "optimizer"]),  # 1F1B
    ],
)
def test_each_rank_writes_a_trace_of_the_window(tmp_path, tokens, layout, labels):
    run_ranks(train, 2, layout, tokens, str(tmp_path / "m.jsonl"), "3:4")
    for rank in (0, 1):
        path = tmp_path / "profile" / f"rank{rank}-steps3-4.json"
        seen = names(path)
        assert all(label in seen for label in labels), (rank, sorted(set(seen))[:80])
        assert any(n.startswith("gloo:") for n in seen), sorted(set(seen))[:80]  # the collectives
        assert sum(n == "optimizer" for n in seen) == 2  # steps 3 and 4, not 1 and 2


def test_the_profiler_leaves_the_losses_alone(tmp_path, tokens):
    layout = Layout(2, 1, 1, 4, 1, "zero1")

    def losses(rank, world, profile):
        cfg = TrainConfig(
            global_batch=8,
            seq_len=32,
            steps=3,
            seed=0,
            lr=1e-3,
            warmup_steps=1,
            metrics_file=str(tmp_path / "m.jsonl"),
            profile_steps=profile,
        )
        with Job(MODEL, cfg, layout, torch.device("cpu"), tokens=tokens) as job:
            job.fit()
            return [r["loss"] for r in job.records]

    assert run_ranks(losses, 2, "1:3")[0] == run_ranks(losses, 2, None)[0]


@pytest.mark.parametrize("text", ["3", "0:2", "5:4", "a:b", "1:2:3", ""])
def test_bad_windows_are_one_line(text):
    with pytest.raises(ConfigError, match="--profile-steps .* must be A:B"):
        parse(text)
    assert parse(" 2 : 5 ") == (2, 5) and parse(None) is None
