"""Bad input, as a new user types it, on every command: exit code 2, one line on stderr naming what is wrong,
where it came from and what would be valid, no traceback, no file created or changed, and nothing started.

"Nothing started" is checked, not timed: every process of a case imports a sitecustomize hook that turns the
first call of torch.distributed.init_process_group, or a TorchElastic agent's run, into exit code 99 with a
marker file. A case that reached either (a process group forming, a torchrun agent starting workers) fails.

The first case of each command, every `run.sh` and `torchrun` case and every case that sets the environment run
as users run them, a new `python -m elastic_trainer.cli` process (so a warning printed while torch or the
package imports is a second line, and fails). The others run `cli.main` in a child forked from this process,
where torch is imported already, with the same guard, folder, environment and streams: the same code path
from the parser on, without an interpreter start per case.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "elastic_trainer.cli"]
TINY = ["--model", "gpt-tiny", "--global-batch", "4", "--seq-len", "16"]

GUARD = r"""
import importlib.abc
import os
import sys

MARK = os.environ["ET_TEST_STARTED"]


def refuse(what):
    def started(*args, **kwargs):
        with open(MARK, "a") as out:
            out.write(what + "\n")
        os._exit(99)
    return started


def patch_dist(module):
    module.init_process_group = refuse("init_process_group")
    module.distributed_c10d.init_process_group = module.init_process_group


def patch_agent(module):
    module.SimpleElasticAgent.run = refuse("torchrun agent run")


PATCHES = {"torch.distributed": patch_dist, "torch.distributed.elastic.agent.server.api": patch_agent}


class After(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = run
        return spec


sys.meta_path.insert(0, After())
"""


def corpus_text(lines: int = 400) -> str:
    return "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog, number {i}." for i in range(lines))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real two-step gpt-tiny checkpoint of a small text corpus (global batch 4, seq_len 16)."""
    root = tmp_path_factory.mktemp("bad-input-ckpt")
    (root / "corpus.txt").write_text(corpus_text())
    run = subprocess.run(
        CLI
        + [
            "train",
            *TINY,
            "--steps",
            "2",
            "--data",
            "corpus.txt",
            "--data-cache",
            "cache",
            "--checkpoint-dir",
            "ck",
            "--save-every",
            "2",
        ],
        cwd=root,
        env=base_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return root


def base_env(home: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ELASTIC_TRAINER_", "ET_TEST_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return dict(env, HOME=str(home), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def tree(root: Path) -> dict:
    """Every path under root with its kind, size and content hash."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink() or not path.is_dir():
            data = path.read_bytes() if path.is_file() else b""
            found[rel] = ("file", len(data), hashlib.sha256(data).hexdigest())
        else:
            found[rel] = ("dir",)
    return found


# ----------------------------------------------------------------------------------------------- file makers


def write(name: str, text: str | bytes) -> Callable[[Path, Path], None]:
    def make(t: Path, ckpt: Path) -> None:
        path = t / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return make


def both(*makers) -> Callable[[Path, Path], None]:
    def make(t: Path, ckpt: Path) -> None:
        for maker in makers:
            maker(t, ckpt)

    return make


def copy_checkpoint(t: Path, ckpt: Path) -> None:
    shutil.copytree(ckpt / "ck", t / "ck")
    shutil.copytree(ckpt / "cache", t / "cache")
    (t / "corpus.txt").write_text(corpus_text())


def damaged_meta(t: Path, ckpt: Path) -> None:
    copy_checkpoint(t, ckpt)
    meta = t / "ck" / "step-00000002" / "meta.json"
    meta.write_text(meta.read_text()[:200])


def meta_without_layout(t: Path, ckpt: Path) -> None:
    copy_checkpoint(t, ckpt)
    path = t / "ck" / "step-00000002" / "meta.json"
    meta = json.loads(path.read_text())
    meta["layout"] = {"dp": "one"}
    path.write_text(json.dumps(meta))


def parquet_without_text(t: Path, ckpt: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"] * 10}), t / "data.parquet")


def megatron_version_2(t: Path, ckpt: Path) -> None:

    from elastic_trainer.data import indexed

    np.arange(40, dtype=np.uint16).tofile(t / "mega.bin")
    indexed.write_index(t / "mega.idx", np.uint16, np.array([40]), np.arange(2))
    raw = bytearray((t / "mega.idx").read_bytes())
    raw[9] = 2  # the version field
    (t / "mega.idx").write_bytes(bytes(raw))


def prepared(t: Path, tokenizer_vocab: int = 50257, damaged: bool = False) -> None:
    """A prepared dataset written by hand (the manifest's fields as prepare-data writes them)."""
    import os

    from elastic_trainer.data import tokenizer
    from elastic_trainer.data.pieces import FORMAT

    (t / "ds" / "shards").mkdir(parents=True)
    (t / "ds" / "shards" / "s.bin").write_bytes(bytes(range(200)))
    manifest = {
        "format": FORMAT,
        "digest": "d" * 32,
        "dtype": "uint16",
        "tokens": 100,
        "documents": 1,
        "tokenizer": {
            "name": tokenizer.NAME,
            "vocab_size": tokenizer_vocab,
            "eot": tokenizer.EOT_ID,
            "encoder_json_sha256": tokenizer.ENCODER_JSON_SHA256,
            "vocab_bpe_sha256": tokenizer.VOCAB_BPE_SHA256,
        },
        "shards": [{"name": "s", "tokens": 100, "digest": "0" * 32}],
    }
    (t / "ds" / "manifest.json").write_text(json.dumps(manifest))
    if damaged:  # a shard changed after its manifest was written
        later = os.stat(t / "ds" / "manifest.json").st_mtime_ns + 10**9
        os.utime(t / "ds" / "shards" / "s.bin", ns=(later, later))


CORPUS = write("corpus.txt", corpus_text())
JSONL_BAD_LINE_3 = write("data.jsonl", '{"text": "one"}\n{"text": "two"}\n{"text": "three"\n{"text": "four"}\n')
# Past what the preflight samples (the first 200 records): found while tokenizing, before the process group.
JSONL_BAD_DEEP = write(
    "data.jsonl", "".join(json.dumps({"text": f"record {i} " * 8}) + "\n" for i in range(600)) + "{not json}\n"
)
HOSTS_2 = write("hosts.txt", "localhost slots=2\n")
SCHEDULE_NONE = ["--schedule", "none"]


@dataclass
class Case:
    id: str
    argv: list[str]  # after CLI; "{t}" is the case's folder; first item "run.sh": ./run.sh
    expect: str  # a part of the one error line
    make: Callable[[Path, Path], None] | None = None
    env: dict = field(default_factory=dict)
    code: int = 2


CASES = [
    # ---- numbers and flags (train)
    Case("train-lr-nan", ["train", "--lr", "nan"], "argument --lr: 'nan' is not a finite number > 0"),
    Case("train-lr-inf", ["train", "--lr", "inf"], "argument --lr: 'inf' is not a finite number > 0"),
    Case("train-global-batch-0", ["train", "--global-batch", "0"], "argument --global-batch: '0'"),
    Case("train-steps-negative", ["train", "--steps", "-3"], "argument --steps: '-3'"),
    Case("train-weight-decay-nan", ["train", "--weight-decay", "nan"], "argument --weight-decay: 'nan'"),
    Case("train-seed-huge", ["train", "--seed", str(2**64)], "argument --seed"),
    Case("train-layout-letters", ["train", *TINY, "--layout", "2,x,1"], "--layout"),
    Case(
        "train-layout-product",
        [
            "train",
            *TINY,
            "--layout",
            "2,1,1",
            "--data",
            "{t}/corpus.txt",
            "--metrics-file",
            "{t}/m.jsonl",
            "--events-file",
            "{t}/e.jsonl",
        ],
        "--layout 2,1,1: ",
        CORPUS,
    ),
    Case(
        "train-micro-batch",
        ["train", *TINY, "--micro-batch", "3", "--data", "{t}/corpus.txt"],
        "with --micro-batch 3",
        CORPUS,
    ),
    Case("train-unknown-model", ["train", "--model", "gpt-huge"], "gpt-huge"),
    Case("train-unknown-flag", ["train", "--learning-rate", "1e-3"], "--learning-rate"),
    # ---- outputs
    Case("train-checkpoint-dir-is-file", ["train", *TINY, "--checkpoint-dir", "{t}/corpus.txt"], "corpus.txt", CORPUS),
    Case(
        "train-metrics-under-file",
        ["train", *TINY, "--metrics-file", "{t}/corpus.txt/m.jsonl"],
        "--metrics-file",
        CORPUS,
    ),
    Case("train-stop-file-is-dir", ["train", *TINY, "--stop-file", "{t}/sub"], "--stop-file", write("sub/keep", "x")),
    # ---- data
    Case("data-missing", ["train", *TINY, "--data", "{t}/nothing.txt"], "nothing.txt"),
    Case("data-empty-txt", ["train", *TINY, "--data", "{t}/empty.txt"], "empty.txt", write("empty.txt", "")),
    Case(
        "data-bad-jsonl-line",
        ["train", *TINY, "--data", "{t}/data.jsonl"],
        "data.jsonl line 3: not valid JSON",
        JSONL_BAD_LINE_3,
    ),
    Case(
        "data-not-utf8",
        ["train", *TINY, "--data", "{t}/latin.txt"],
        "latin.txt line 2: not UTF-8",
        write("latin.txt", b"first line\ncaf\xe9 au lait\n"),
    ),
    Case("data-parquet-no-text", ["train", *TINY, "--data", "{t}/data.parquet"], "data.parquet", parquet_without_text),
    Case(
        "data-folder-without-files",
        ["train", *TINY, "--data", "{t}/folder"],
        "folder",
        write("folder/notes.md", "# not a data file\n"),
    ),
    Case(
        "data-bad-record-deep",
        ["train", *TINY, "--data", "{t}/data.jsonl"],
        "data.jsonl line 601: not valid JSON",
        JSONL_BAD_DEEP,
    ),
    Case("data-too-short", ["train", *TINY, "--data", "{t}/short.txt"], "short.txt", write("short.txt", "hi\n")),
    Case(
        "data-text-field-missing",
        ["train", *TINY, "--data", "{t}/corpus.jsonl", "--text-field", "body"],
        "corpus.jsonl line 1: has no 'body' field (keys: text; choose one with --text-field)",
        write("corpus.jsonl", json.dumps({"text": corpus_text()}) + "\n"),
    ),
    Case(
        "data-nanogpt-odd-bin",
        ["train", *TINY, "--data", "{t}/train.bin"],
        "not a multiple of 2",
        write("train.bin", b"\0" * 1001),
    ),
    Case(
        "data-megatron-idx-version",
        ["train", *TINY, "--data", "{t}/mega"],
        "Megatron index version 2",
        megatron_version_2,
    ),
    Case(
        "data-prepared-other-tokenizer",
        ["train", *TINY, "--data", "{t}/ds"],
        "prepared with another tokenizer",
        lambda t, c: prepared(t, tokenizer_vocab=32000),
    ),
    Case(
        "data-prepared-shard-digest",
        ["train", *TINY, "--data", "{t}/ds"],
        "its content digest does not match",
        lambda t, c: prepared(t, damaged=True),
    ),
    Case(
        "prepare-data-bad-record-deep",
        ["prepare-data", "{t}/data.jsonl", "--out", "{t}/out"],
        "data.jsonl line 601: not valid JSON",
        JSONL_BAD_DEEP,
    ),
    Case(
        "prepare-data-out-is-other",
        ["prepare-data", "{t}/corpus.txt", "--out", "{t}/other"],
        "--out {t}/other holds other files",
        both(CORPUS, write("other/notes.md", "mine\n")),
    ),
    # ---- checkpoints being resumed
    Case(
        "resume-other-model",
        [
            "train",
            "--model",
            "{t}/two.toml",
            "--global-batch",
            "4",
            "--seq-len",
            "16",
            "--data",
            "corpus.txt",
            "--data-cache",
            "cache",
            "--checkpoint-dir",
            "{t}/ck",
            "--metrics-file",
            "{t}/m.jsonl",
        ],
        "step-00000002 holds a different model: n_layers=2 (checkpoint: 4)",
        both(copy_checkpoint, write("two.toml", '[model]\npreset = "gpt-tiny"\nn_layers = 2\nname = "gpt-tiny"\n')),
    ),
    Case(
        "resume-until-before-step",
        [
            "train",
            *TINY,
            "--data",
            "corpus.txt",
            "--data-cache",
            "cache",
            "--checkpoint-dir",
            "{t}/ck",
            "--until-step",
            "1",
        ],
        "--until-step",
        copy_checkpoint,
    ),
    Case(
        "resume-damaged-meta",
        ["train", *TINY, "--data", "corpus.txt", "--data-cache", "cache", "--checkpoint-dir", "{t}/ck"],
        "no checkpoint in --checkpoint-dir",
        damaged_meta,
    ),
    Case(
        "resume-meta-bad-layout",
        ["train", *TINY, "--data", "corpus.txt", "--data-cache", "cache", "--checkpoint-dir", "{t}/ck"],
        "layout",
        meta_without_layout,
    ),
    Case(
        "resume-other-data",
        ["train", *TINY, "--data", "{t}/other.txt", "--data-cache", "cache", "--checkpoint-dir", "{t}/ck"],
        "other settings: data",
        both(copy_checkpoint, write("other.txt", corpus_text(300))),
    ),
    Case(
        "resume-not-a-checkpoint",
        ["train", *TINY, "--data", "{t}/corpus.txt", "--checkpoint-dir", "{t}/ck", "--resume", "{t}/sub"],
        "is not a complete checkpoint folder",
        both(CORPUS, write("sub/keep", "x")),
    ),
    Case(
        "resume-needs-checkpoint-dir",
        ["train", *TINY, "--resume", "{t}/sub"],
        "--checkpoint-dir",
        write("sub/keep", "x"),
    ),
    # ---- configuration files
    Case("model-toml-syntax", ["train", "--model", "{t}/m.toml"], "m.toml", write("m.toml", "[model]\nn_layers = \n")),
    Case(
        "model-toml-type",
        ["train", "--model", "{t}/m.toml"],
        "n_layers",
        write("m.toml", '[model]\nn_layers = "two"\nd_model = 64\nn_heads = 4\n'),
    ),
    Case(
        "model-toml-missing",
        ["train", "--model", "{t}/m.toml", "--metrics-file", "{t}/m.jsonl"],
        "missing required key(s) d_model, n_heads",
        write("m.toml", "[model]\nn_layers = 2\n"),
    ),
    Case(
        "run-toml-unknown-key",
        ["train", "--config", "{t}/r.toml"],
        "r.toml",
        write("r.toml", 'model = "gpt-tiny"\n[train]\nlearning_rate = 1e-3\n'),
    ),
    Case(
        "run-toml-partial-layout",
        ["train", "--config", "{t}/r.toml"],
        "r.toml",
        write("r.toml", 'model = "gpt-tiny"\n[layout]\ndp = 2\n'),
    ),
    Case(
        "hardware-reserved-over-memory",
        ["plan", "--gpus", "4", "--hardware", "{t}/hw.toml"],
        "hw.toml",
        write(
            "hw.toml",
            (ROOT / "configs/hardware/cpu.toml").read_text().replace("reserved_gb = 4.0", "reserved_gb = 40.0"),
        ),
    ),
    Case(
        "hardware-bad-type",
        ["plan", "--gpus", "4", "--hardware", "{t}/hw.toml"],
        "hw.toml",
        write(
            "hw.toml",
            re.sub(r"(?m)^tflops = .*$", 'tflops = "fast"', (ROOT / "configs/hardware/cpu.toml").read_text(), count=1),
        ),
    ),
    # ---- environment the job reads
    Case("env-rank-without-world-size", ["train", *TINY], "WORLD_SIZE", env={"RANK": "0"}),
    Case("env-world-size-zero", ["train", *TINY], "WORLD_SIZE", env={"RANK": "0", "WORLD_SIZE": "0"}),
    Case(
        "env-master-port",
        ["train", *TINY],
        "MASTER_PORT",
        env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "http"},
    ),
    # ---- plan, calibrate, checkpoint
    Case("plan-gpus-0", ["plan", "--gpus", "0"], "argument --gpus: '0'"),
    Case("plan-compare-bad", ["plan", "--gpus", "4", "--compare", "3,3,3"], "--compare 3,3,3: "),
    Case("plan-unknown-hardware", ["plan", "--gpus", "4", "--hardware", "tpu-v9"], "tpu-v9"),
    Case("calibrate-ranks-1", ["calibrate", "--ranks", "1"], "--ranks"),
    Case("calibrate-output-is-dir", ["calibrate", "--output", "{t}/sub"], "--output", write("sub/keep", "x")),
    Case("checkpoint-inspect-missing", ["checkpoint", "inspect", "{t}/nothing"], "does not exist"),
    Case("checkpoint-inspect-damaged", ["checkpoint", "inspect", "{t}/ck"], "meta.json", damaged_meta),
    Case(
        "checkpoint-export-not-ckpt",
        ["checkpoint", "export-hf", "{t}/sub", "{t}/out"],
        "no complete checkpoint",
        write("sub/keep", "x"),
    ),
    Case(
        "checkpoint-export-into-files",
        ["checkpoint", "export-hf", "{t}/ck", "{t}/sub"],
        "sub",
        both(copy_checkpoint, write("sub/keep", "x")),
    ),
    # ---- launch / run.sh / torchrun
    Case("run-sh-missing-hosts", ["run.sh", "--hosts", "{t}/nothing.txt", "--run-dir", "{t}/run"], "nothing.txt"),
    Case(
        "run-sh-schedule-over-slots", ["run.sh", "--hosts", "{t}/hosts.txt", "--run-dir", "{t}/run"], "2 slots", HOSTS_2
    ),
    Case(
        "run-sh-train-arg",
        ["run.sh", "--hosts", "{t}/hosts.txt", "--run-dir", "{t}/run", *SCHEDULE_NONE, "--", "--lr", "nan"],
        "--lr",
        HOSTS_2,
    ),
    Case(
        "run-sh-empty-data",
        ["run.sh", "--hosts", "{t}/hosts.txt", "--run-dir", "{t}/run", *SCHEDULE_NONE, "--data", "{t}/empty.txt"],
        "empty.txt",
        both(HOSTS_2, write("empty.txt", "")),
    ),
    Case(
        "run-sh-unknown-schedule",
        ["run.sh", "--hosts", "{t}/hosts.txt", "--run-dir", "{t}/run", "--schedule", "philly-2099"],
        "philly-2099",
        HOSTS_2,
    ),
    Case(
        "launch-resume-without-checkpoint",
        ["launch", "--hosts", "{t}/hosts.txt", "--run-dir", "{t}/run", *SCHEDULE_NONE, "--resume"],
        "checkpoint",
        HOSTS_2,
    ),
    Case("torchrun-bad-train-arg", ["torchrun", "--nproc-per-node", "2", "train", *TINY, "--lr", "nan"], "--lr"),
    Case("torchrun-bad-own-flag", ["torchrun", "--nproc-per-node", "two", "train"], "nproc"),
    Case(
        "torchrun-empty-data",
        ["torchrun", "--nproc-per-node", "2", "train", *TINY, "--data", "{t}/empty.txt"],
        "empty.txt",
        write("empty.txt", ""),
    ),
]


def _as_a_process() -> set[str]:
    seen, ids = set(), set()
    for case in CASES:
        if case.argv[0] not in seen or case.argv[0] in ("run.sh", "torchrun") or case.env:
            ids.add(case.id)
        seen.add(case.argv[0])
    return ids


AS_A_PROCESS = _as_a_process()


def forked_cli(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """`elastic-trainer ARGV` as `cli.main(ARGV)` in a forked child: its own folder, environment, stdout and
    stderr, GUARD's refusals patched in; an uncaught exception prints its traceback and exits 1, SystemExit
    ends it with its code, as the interpreter would."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
                _refuse_starts()
                from elastic_trainer import cli

                sys.argv = ["elastic-trainer", *argv]
                code = cli.main(argv) or 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            argv,
            os.waitstatus_to_exitcode(status),
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )


def _refuse_starts() -> None:
    """GUARD in a child whose torch is imported already: its own patches (reading the marker from
    ET_TEST_STARTED, as in a new process), applied to the modules in place instead of on import."""
    import importlib

    guard: dict = {}
    exec(GUARD, guard)
    for name, patch in guard["PATCHES"].items():
        patch(importlib.import_module(name))


def test_the_table_covers_every_command_and_kind():
    assert len(CASES) >= 30 and len({case.id for case in CASES}) == len(CASES)
    commands = {case.argv[0] for case in CASES}
    assert {"train", "plan", "calibrate", "checkpoint", "run.sh", "launch", "torchrun"} <= commands


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_is_one_line_before_anything_starts(case, tmp_path, checkpoint):
    t = tmp_path / "case"
    t.mkdir()
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    marker = tmp_path / "started"
    if case.make:
        case.make(t, checkpoint)
    env = dict(
        base_env(t),
        **case.env,
        ET_TEST_STARTED=str(marker),
        ELASTIC_TRAINER_CACHE=str(t / "cache"),
        PYTHONPATH=os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH", "")) if p),
    )
    argv = [arg.replace("{t}", str(t)) for arg in case.argv]
    command = [str(ROOT / "run.sh"), *argv[1:]] if argv[0] == "run.sh" else CLI + argv
    before = tree(t)
    start = time.perf_counter()
    if case.id in AS_A_PROCESS:
        run = subprocess.run(command, cwd=t, env=env, capture_output=True, text=True, timeout=300)
    else:
        run = forked_cli(argv, t, env)
    seconds = time.perf_counter() - start
    report = f"exit {run.returncode} in {seconds:.1f} s\nstdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert not marker.exists(), f"started {marker.read_text().strip()} before failing\n{report}"
    assert run.returncode == case.code, report
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-trainer: error: "), report
    assert case.expect.replace("{t}", str(t)) in lines[0], report
    assert "Traceback" not in run.stdout + run.stderr, report
    assert tree(t) == before, f"files changed\n{report}"


def test_skip_bad_records_leaves_them_out_and_counts_them(tmp_path):
    """Two corrupt records of 500, both past what the preflight samples: by default the run stops at the first
    while tokenizing, with its file and line, and leaves nothing in the cache; with --skip-bad-records it trains on the
    498 others and says at the end what it left out; a later run without the flag refuses the corpus cached that way."""
    from elastic_trainer.data import tokenizer

    texts = [f"record {i} " * 8 for i in range(500)]
    lines = [json.dumps({"text": t}) for t in texts]
    lines[249], lines[449] = '{"text": "three"', "{not json}"
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    argv = CLI + ["train", *TINY, "--steps", "1", "--data", "d.jsonl", "--data-cache", "cache"]
    env = base_env(tmp_path)

    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "d.jsonl line 250: not valid JSON" in run.stderr and "--skip-bad-records" in run.stderr
    assert not (tmp_path / "cache").exists()

    run = subprocess.run(
        argv + ["--skip-bad-records"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("[data] --skip-bad-records left out 2 bad record(s); first: "), run.stdout
    assert "d.jsonl line 250: not valid JSON" in last and "d.jsonl line 450: not valid JSON" in last
    good = [t for i, t in enumerate(texts) if i not in (249, 449)]
    expected = sum(len(ids) + 1 for ids in tokenizer.encode_batch(good))
    [prepared] = (tmp_path / "cache" / "prepared").iterdir()
    assert json.loads((prepared / "manifest.json").read_text())["tokens"] == expected

    cached = tree(tmp_path / "cache")
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "the data has 2 bad record(s); first: " in run.stderr and "pass --skip-bad-records" in run.stderr
    assert tree(tmp_path / "cache") == cached
