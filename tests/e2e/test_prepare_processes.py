"""prepare-data with real processes: a parquet file prepared in pieces by workers, a run killed and run again,
Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from elastic_trainer.data import prepare, stream
from tests.unit.test_prepare import _shard_bytes, expected


def run_cli(*argv, cwd, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", *map(str, argv)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
        **kw,
    )


def test_a_parquet_file_of_many_row_groups_is_prepared_in_pieces(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document number {i}, " * 20 for i in range(200)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "p.parquet", row_group_size=10)
    manifest = prepare.prepare([tmp_path / "p.parquet"], tmp_path / "out", chunk_bytes=2000, quiet=True, workers=2)
    assert len(manifest["shards"]) > 5 and manifest["documents"] == 200
    assert np.asarray(stream.TokenStream(stream.prepared_files(tmp_path / "out"))).tolist() == expected(docs)


def _corpus(folder: Path, files: int = 6, lines: int = 3000) -> None:
    folder.mkdir()
    for f in range(files):
        (folder / f"part-{f}.jsonl").write_text(
            "".join(json.dumps({"text": f"file {f} line {i} " * 6}) + "\n" for i in range(lines))
        )


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_killed_then_run_again_gives_the_same_shards_and_a_change_rewrites_only_its_own(tmp_path):
    _corpus(tmp_path / "c")
    args = ["prepare-data", tmp_path / "c", "--chunk-mb", "0.1", "--workers", "2"]
    full = run_cli(*args, "--out", tmp_path / "full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    assert "[prepare] done: " in full.stderr and "0 reused" in full.stderr

    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_trainer.cli", *map(str, args), "--out", tmp_path / "part"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    shards = tmp_path / "part" / "shards"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(shards.glob("*.json"))) < 3:
        time.sleep(0.01)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "part" / "manifest.json").exists(), "the run ended before it was killed"
    deadline = time.monotonic() + 10  # its workers die with it (they would wait forever on their queue)
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers and not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    again = run_cli(*args, "--out", tmp_path / "part", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _shard_bytes(tmp_path / "part") == _shard_bytes(tmp_path / "full")
    assert "0 reused" not in again.stderr

    one = tmp_path / "c" / "part-3.jsonl"
    one.write_text(one.read_text().replace("line 7 ", "LINE 7 "))
    before = json.loads((tmp_path / "full" / "manifest.json").read_text())
    changed = run_cli(*args, "--out", tmp_path / "full", cwd=tmp_path)
    after = json.loads((tmp_path / "full" / "manifest.json").read_text())
    own = [s for s in after["sources"] if s["path"].endswith("part-3.jsonl")][0]["pieces"]
    total = len(after["shards"])
    assert f"({len(own)} written, {total - len(own)} reused, {len(own)} stale removed)" in changed.stderr
    assert before["digest"] != after["digest"] and before["tokens"] == after["tokens"]


def test_ctrl_c_keeps_complete_shards_and_says_one_line(tmp_path):
    _corpus(tmp_path / "c", files=8, lines=6000)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "prepare-data",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "o"),
            "--chunk-mb",
            "0.1",
            "--workers",
            "2",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a terminal's Ctrl-C, even when this test process ignores SIGINT (children inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    shards = tmp_path / "o" / "shards"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(shards.glob("*.json"))) < 2:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("prepare-data: interrupted; ")
    assert not list(shards.glob("*.tmp*")) and not (tmp_path / "o" / "manifest.json").exists()
    assert all((shards / f"{p.stem}.bin").is_file() for p in shards.glob("*.json"))
