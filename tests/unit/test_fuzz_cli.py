"""Property-based fuzzing of the command line: plausible flag values with at most one replaced by junk, and
small random hosts, model, schedule and data files, given to `train --check`, `plan` and `launch --dry-run`.
Whatever the input, the CLI ends with exit code 0 or 2, never with a traceback, and a 2 comes with exactly one
`elastic-trainer: error:` line. An example that takes longer than PER_EXAMPLE_S counts as a hang.

The CLI runs in this process (`cli.main`), in a fresh temporary folder per example: 600 examples take about
half a minute (5,000, about 6 minutes: ET_FUZZ_EXAMPLES=5000). Nothing here starts a process group (`--check`
and `--dry-run` start nothing).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import tempfile
import traceback
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from elastic_trainer import cli  # noqa: E402

PER_EXAMPLE_S = 60
EXAMPLES = int(os.environ.get("ET_FUZZ_EXAMPLES", "600"))

NUMBERS = st.one_of(
    st.integers(-3, 70),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "0x10", "1_000", " 4", "٣", "", "-0", "4.0", "1e-3"]),
)
JUNK = st.one_of(
    NUMBERS.map(str),
    st.text(max_size=12),
    st.sampled_from(["gpt-small", "h100-80g", "1,2", "0,1,1", "a,b,c", "sotu", "..", "/", "-"]),
)


def ints(*values: int) -> st.SearchStrategy:
    return st.sampled_from([str(v) for v in values])


# Values a user would plausibly type, so that most examples get past the flag parser into the checks behind it
# (configs, planner, data, hosts, checkpoints); `inputs` replaces at most one value with junk.
GOOD = {
    "--global-batch": ints(1, 2, 4, 6, 8),
    "--seq-len": ints(4, 8, 16, 32, 300),
    "--steps": ints(1, 2, 5, 20),
    "--seed": ints(0, 1, 2**62),
    "--lr": st.sampled_from(["1e-3", "0.5", "1e-9"]),
    "--warmup-steps": ints(0, 1, 5, 50),
    "--decay-steps": ints(1, 10, 100),
    "--grad-clip": ints(0, 1),
    "--weight-decay": st.sampled_from(["0", "0.1"]),
    "--micro-batch": ints(1, 2, 3, 4),
    "--layout": st.sampled_from(["1,1,1", "1,1,1", "2,1,1"]),
    "--dtype": st.sampled_from(["auto", "fp32", "bf16"]),
    "--dp-mode": st.sampled_from(["fsdp", "ddp"]),
    "--log-every": ints(1, 3),
    "--until-step": ints(1, 3, 30),
    "--save-every": ints(0, 1, 5),
    "--save-interval-s": ints(0, 60),
    "--keep": ints(0, 1, 3),
    "--resume": st.sampled_from(["auto", "never", "ck/step-00000001", "data.txt"]),
    "--hardware": st.sampled_from(["cpu", "h100-80g", "v100-16g", "model.toml"]),
    "--model": st.sampled_from(["gpt-tiny", "model.toml", "gpt3-xl"]),
    "--gpus": ints(1, 2, 3, 4, 8, 16, 1024),
    "--gpus-per-host": ints(1, 2, 4, 8),
    "--top": ints(1, 3),
    "--compare": st.sampled_from(["1,1,1", "2,1,1", "2,2,1", "4,1,1"]),
    "--schedule": st.sampled_from(["none", "default", "hosts.txt", "schedule.json"]),
    "--max-restarts": ints(0, 3),
    "--min-hosts": ints(1, 2),
    "--rdzv-port": ints(29400, 0),
    "--ssh-port": ints(22, 2222),
    "--rdzv-conf": st.sampled_from(["last_call_timeout=30", "join_timeout=x", "x"]),
}


def value(flag: str) -> st.SearchStrategy:
    return GOOD.get(flag, JUNK)


TRAIN_FLAGS = [
    "--global-batch",
    "--seq-len",
    "--steps",
    "--seed",
    "--lr",
    "--warmup-steps",
    "--decay-steps",
    "--grad-clip",
    "--weight-decay",
    "--micro-batch",
    "--layout",
    "--dtype",
    "--dp-mode",
    "--log-every",
    "--until-step",
    "--save-every",
    "--save-interval-s",
    "--keep",
    "--resume",
    "--hardware",
]
PLAN_FLAGS = [
    "--gpus-per-host",
    "--global-batch",
    "--seq-len",
    "--micro-batch",
    "--dp-mode",
    "--top",
    "--compare",
    "--hardware",
    "--dtype",
]
LAUNCH_FLAGS = [
    "--gpus-per-host",
    "--schedule",
    "--max-restarts",
    "--min-hosts",
    "--rdzv-port",
    "--ssh-port",
    "--rdzv-conf",
]

GOOD_HOSTS = st.sampled_from(
    ["localhost slots=2", "localhost slots=4", "localhost", "127.0.0.1 slots=4", "localhost slots=8", "# comment", ""]
)
HOST_LINES = st.one_of(
    GOOD_HOSTS,
    GOOD_HOSTS,
    GOOD_HOSTS,
    st.sampled_from(["localhost slots=0", "node1 slots=two", "host slots=2 gpus=3", "a;b", "localhost slots=999999"]),
    st.text(max_size=20).map(lambda s: s.replace("\n", " ")),
)
MODEL_VALUES = {
    "n_layers": ints(1, 2, 4, 0),
    "d_model": ints(32, 64, 30),
    "n_heads": ints(1, 2, 4, 3),
    "vocab_size": ints(50257, 100, 0),
    "context_length": ints(16, 64, 256, 8),
    "dropout": st.sampled_from(["0.0", "0.1", "1.5"]),
    "layer_norm_eps": st.sampled_from(["1e-5", "0"]),
}
TOML_JUNK = st.one_of(
    st.integers(-5, 5000).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(['"x"', "true", "[1, 2]", "{}", "nan", "inf", "1e400"]),
)
WORDS = st.sampled_from(["the", "state", "of", "union", "is", "strong", "and", "we", "will", "build", "\u00e9t\u00e9"])
DATA = st.one_of(
    st.lists(WORDS, min_size=30, max_size=400).map(" ".join),
    st.lists(WORDS, min_size=30, max_size=400).map(lambda w: "\n".join(f'{{"text": "{x}"}}' for x in w)),
    st.binary(max_size=300),
    st.text(max_size=300),
    st.lists(
        st.sampled_from(
            [
                '{"text": "hello world"}',
                '{"text": 3}',
                "{",
                "[]",
                '{"body": "x"}',
                "",
                '{"text": "' + "word " * 40 + '"}',
            ]
        ),
        max_size=30,
    ).map("\n".join),
)


@st.composite
def flags(draw, names: list[str]) -> list[str]:
    argv = []
    for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        argv += [name, draw(value(name))]
    return argv


@st.composite
def model_toml(draw) -> str:
    keys = draw(st.lists(st.sampled_from(list(MODEL_VALUES) + ["bias"]), max_size=7, unique=True))
    lines = [f"{key} = {draw(st.one_of(MODEL_VALUES.get(key, TOML_JUNK), TOML_JUNK))}" for key in keys]
    return draw(st.one_of(st.just("[model]\n" + "\n".join(lines) + "\n"), st.text(max_size=80)))


@st.composite
def inputs(draw):
    """(command line, files to write: name -> bytes)."""
    files = {}
    data_name = draw(st.sampled_from(["data.txt", "data.jsonl", "data.json"]))
    data = draw(DATA)
    files[data_name] = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    files["model.toml"] = draw(model_toml()).encode("utf-8", "surrogatepass")
    files["hosts.txt"] = "\n".join(draw(st.lists(HOST_LINES, max_size=4))).encode("utf-8", "surrogatepass")
    files["schedule.json"] = draw(
        st.sampled_from(['{"phases": [{"gpus": 2, "steps": 3}]}', "[]", "{", '{"x": 1}'])
    ).encode()
    command = draw(st.sampled_from(["train", "plan", "launch"]))
    model = draw(st.sampled_from([[], ["--model", "gpt-tiny"], ["--model", "model.toml"]]))
    if command == "train":
        argv = ["train", "--check", "--data", data_name, "--checkpoint-dir", "ck", *model, *draw(flags(TRAIN_FLAGS))]
    elif command == "plan":
        argv = ["plan", "--gpus", draw(value("--gpus")), *model, *draw(flags(PLAN_FLAGS))]
    else:
        argv = [
            "launch",
            "--dry-run",
            "--hosts",
            "hosts.txt",
            "--run-dir",
            "run",
            "--data",
            data_name,
            *model,
            *draw(flags(LAUNCH_FLAGS)),
        ]
        if draw(st.booleans()):
            argv += ["--", *draw(flags(TRAIN_FLAGS[:10]))]
    values = [i for i, arg in enumerate(argv) if i and argv[i - 1].startswith("--") and not arg.startswith("--")]
    if values and draw(st.booleans()):
        argv[draw(st.sampled_from(values))] = draw(JUNK)
    return argv, files


class Hang(Exception):
    pass


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """cli.main in this process: (exit code, stdout, stderr); an exception escaping it becomes its traceback on
    stderr and exit code 1, as a real process would show it."""
    out, err = io.StringIO(), io.StringIO()

    def hang(signum, frame):
        raise Hang(f"no answer within {PER_EXAMPLE_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(PER_EXAMPLE_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Hang:
                raise
            except BaseException:  # noqa: BLE001  (what a user would see)
                err.write(traceback.format_exc())
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fuzz-cache"))


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(inputs())
def test_no_input_makes_the_cli_raise_or_hang(data_cache, example):
    argv, files = example
    keep = {k: os.environ.get(k) for k in ("ELASTIC_TRAINER_CACHE", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            Path(folder, name).write_bytes(data)
        os.chdir(folder)
        os.environ["ELASTIC_TRAINER_CACHE"] = data_cache
        for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(key, None)
        try:
            code, out, err = run_cli(argv)
        finally:
            os.chdir(here)
            for key, value in keep.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    shown = f"argv={argv!r}\nexit {code}\nstderr:\n{err[-3000:]}"
    assert code in (0, 2), shown
    assert "Traceback" not in out + err, shown
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("elastic-trainer: error: "), shown
