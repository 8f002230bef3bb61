"""The metrics file and the progress lines, against lines written out by hand."""

from __future__ import annotations

import json
import sys

from elastic_trainer.train.metrics import MetricsLog


def record(step: int) -> dict:
    return {
        "step": step,
        "loss": 10.83275 - step,
        "lr": 3e-4 * step,
        "grad_norm": 1.23456,
        "tokens_per_s": 12345.6,
        "step_time_s": 0.04321,
    }


def test_every_step_goes_to_the_file_with_the_tags_and_every_nth_to_stdout(tmp_path, capsys):
    path = tmp_path / "sub" / "dir" / "metrics.jsonl"
    log = MetricsLog(str(path), enabled=True, log_every=2, total_steps=5, tags={"phase": "b", "restart": 1})
    assert not path.parent.exists()  # opened at the first step: a run that never steps leaves no file
    for step in range(1, 6):
        log.write(record(step))
    log.info("[train] hello")
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{**record(s), "phase": "b", "restart": 1} for s in range(1, 6)]
    assert capsys.readouterr().out.splitlines() == [
        "step 2/5 | loss 8.8328 | lr 6.00e-04 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",
        "step 4/5 | loss 6.8328 | lr 1.20e-03 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",
        "step 5/5 | loss 5.8328 | lr 1.50e-03 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",  # the last
        "[train] hello",
    ]
    log.close()  # twice is harmless
    log.write(record(6))  # after close: appended, not truncated
    log.close()
    assert len(path.read_text().splitlines()) == 6


def test_without_a_total_or_a_file_only_the_progress_line(tmp_path, capsys):
    log = MetricsLog(None, enabled=True)
    log.write(record(3))
    log.close()
    assert (
        capsys.readouterr().out
        == "step 3 | loss 7.8328 | lr 9.00e-04 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_disabled_log_writes_nothing(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(str(path), enabled=False, tags={"phase": "a"})
    log.write(record(1))
    log.info("not shown")
    log.close()
    assert capsys.readouterr().out == "" and not path.exists() and log.path is None


class _PipeLike:
    """A stdout whose text reaches the reader only when flushed, as a pipe's block buffer does."""

    def __init__(self):
        self.pending, self.seen = "", ""

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        self.seen, self.pending = self.seen + self.pending, ""


def test_each_line_is_flushed_as_it_is_printed(monkeypatch):
    """In one process, without a pipe: every progress and info line is flushed when printed, so a log
    collector reading the job's stdout sees each step at once, not when a buffer fills."""
    out = _PipeLike()
    monkeypatch.setattr(sys, "stdout", out)
    log = MetricsLog(None, enabled=True, log_every=1, total_steps=2)
    log.info("[train] starting")
    assert out.seen == "[train] starting\n" and out.pending == ""
    log.write({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "step_time_s": 0.25})
    assert out.pending == ""
    assert (
        out.seen.splitlines()[-1]
        == "step 1/2 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | 1,000 tok/s | 0.250 s/step"
    )


def test_a_step_with_a_validation_loss_prints_it_even_between_log_lines(tmp_path, capsys):
    log = MetricsLog(str(tmp_path / "m.jsonl"), enabled=True, log_every=2, total_steps=5)
    evaluated = {**record(3), "val_loss": 7.123456, "val_samples": 32, "eval_time_s": 0.5}
    for r in (record(2), evaluated, record(4)):
        log.write(r)
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 2/5 | loss 8.8328 | lr 6.00e-04 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",
        "step 3/5 | loss 7.8328 | val 7.1235 | lr 9.00e-04 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",
        "step 4/5 | loss 6.8328 | lr 1.20e-03 | grad_norm 1.235 | 12,346 tok/s | 0.043 s/step",
    ]
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[1]) == evaluated
