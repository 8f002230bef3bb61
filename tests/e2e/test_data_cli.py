"""The data path from the command line: prepare-data, then train on the prepared dataset with a held-out
validation fraction; the checkpoint knows its data by content (a copied dataset resumes, a changed one is
refused in one line)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.e2e.test_bad_input import CLI, TINY, base_env


def run(argv, cwd: Path, timeout=300):
    return subprocess.run(
        CLI + [str(a) for a in argv], cwd=cwd, env=base_env(cwd), capture_output=True, text=True, timeout=timeout
    )


def corpus(folder: Path, word: str) -> None:
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"body": f"{word} {i}: " + "some words here " * (i % 9 + 3)}) + "\n" for i in range(400))
    )


def test_prepare_train_validate_and_resume_by_content(tmp_path):
    corpus(tmp_path / "text", "Document")
    prep = run(["prepare-data", "text", "--out", "ds", "--text-field", "body"], tmp_path)
    assert prep.returncode == 0, prep.stderr
    assert prep.stdout.startswith("ds: ") and "train on it with --data ds" in prep.stdout
    assert "[prepare] done: " in prep.stderr

    common = [*TINY, "--val-fraction", "0.1", "--eval-every", "2", "--eval-batches", "2", "--checkpoint-dir", "ck"]
    first = run(["train", *common, "--data", "ds", "--steps", "4", "--metrics-file", "m.jsonl"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "validation: 0.1 of the documents held out" in first.stderr
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert all(r["val_samples"] == 8 for r in records if "val_loss" in r)
    assert "| val " in first.stdout

    shutil.copytree(tmp_path / "ds", tmp_path / "moved")  # the same data under another path: the same digest
    check = run(["train", *common, "--data", "moved", "--steps", "6", "--check"], tmp_path)
    assert check.returncode == 0 and "resumes step 4" in check.stdout, check.stdout + check.stderr

    shutil.rmtree(tmp_path / "text")
    corpus(tmp_path / "text", "Changed")  # the same sizes, other words: other tokens under the same path
    assert run(["prepare-data", "text", "--out", "ds", "--text-field", "body"], tmp_path).returncode == 0
    changed = run(["train", *common, "--data", "ds", "--steps", "8"], tmp_path)
    assert changed.returncode == 2, changed.stdout + changed.stderr
    lines = changed.stderr.strip().splitlines()
    assert len(lines) == 1 and "was trained on other data: the content digest of --data ds is " in lines[0], lines
