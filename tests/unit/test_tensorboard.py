"""train/tensorboard.py, read back with TensorBoard's own reader (EventAccumulator): the scalars of every
step, one value per step across starts (a restart that trains steps again replaces them), the downtime
between starts, the layout as text."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from elastic_trainer.train.metrics import MetricsLog  # noqa: E402
from elastic_trainer.train.tensorboard import TensorBoardLog, default_dir, last_record, missing  # noqa: E402


def record(step: int, loss: float, world: int, t: float, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": 1.0 / step,
        "tokens_per_s": 100.0 * world,
        "step_time_s": 0.5,
        "world_size": world,
        "time": t,
        "layout": {"dp": world, "tp": 1, "pp": 1, "micro_batch": 2, "num_microbatches": 1, "dp_mode": "ddp"},
        **extra,
    }


def start(tmp_path, records: list[dict]) -> None:
    """One start of a run: its own MetricsLog (rank 0) writing the metrics file and the event files."""
    metrics = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(metrics, enabled=True, board=TensorBoardLog(str(tmp_path / "tb"), metrics))
    for r in records:
        log.write(r)
    log.close()


def scalars(tmp_path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_every_step_once_across_starts(tmp_path, capsys):
    start(tmp_path, [record(s, 10.0 - s, 4, 100.0 + s) for s in range(1, 7)])
    # a crash after step 6; the restart resumed from step 4's checkpoint and trains 5.. again on 2 ranks
    start(tmp_path, [record(s, 20.0 - s, 2, 110.0 + s) for s in range(5, 9)])
    # a planned reconfiguration after step 8, 1.5 s after its end
    start(
        tmp_path, [record(s, 30.0 - s, 8, 120.0 + s, **({"val_loss": 1.25} if s == 10 else {})) for s in range(9, 11)]
    )
    assert scalars(tmp_path, "train/loss") == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 6.0),
        (5, 15.0),
        (6, 14.0),
        (7, 13.0),
        (8, 12.0),
        (9, 21.0),
        (10, 20.0),
    ]
    assert [s for s, _ in scalars(tmp_path, "train/learning_rate")] == list(range(1, 11))
    assert scalars(tmp_path, "elastic/world_size") == [(s, 4.0) for s in (1, 2, 3, 4)] + [
        (s, 2.0) for s in (5, 6, 7, 8)
    ] + [(9, 8.0), (10, 8.0)]
    assert scalars(tmp_path, "val/loss") == [(10, 1.25)]
    # downtime: from the last step recorded before the start to the start of its first step (time - step time)
    assert scalars(tmp_path, "elastic/downtime_s") == [
        (5, pytest.approx(115.0 - 0.5 - 106.0)),
        (9, pytest.approx(129.0 - 0.5 - 118.0)),
    ]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("elastic/layout/text_summary")]
    assert texts[-1] == (9, "8 ranks: dp8 tp1 pp1, micro-batch 2 x 1, ddp")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 + 4 + 2 and json.loads(lines[-1])["step"] == 10  # the metrics file is unchanged


def test_last_record_skips_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    assert last_record(str(path)) is None
    path.write_text(json.dumps({"step": 3, "time": 1.0}) + "\n" + '{"step": 4, "ti')
    assert last_record(str(path)) == {"step": 3, "time": 1.0}


def test_defaults_and_the_missing_package(monkeypatch):
    assert default_dir("/runs/x/metrics.jsonl") == "/runs/x/tensorboard" and default_dir(None) == "tensorboard"
    assert missing() is None
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name == "tensorboard":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert "pip install" in missing() and "tensorboard" in missing()
