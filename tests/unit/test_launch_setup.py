"""`elastic-trainer launch` before anything starts: every kind of bad input is one line and exit code 2 with
nothing executed and nothing written; a dry run of a 4-host file shows the plan and each host's exact command."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from elastic_trainer import cli
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT
from elastic_trainer.launch.job_setup import PROJECT_ROOT


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """Any process the launcher tried to start would fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"launch started a process: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def launch(tmp_path: Path, hosts: str | None, *argv: str) -> list[str]:
    hosts_file = tmp_path / "hosts.txt"
    if hosts is not None:
        hosts_file.write_text(hosts)
    return ["launch", "--hosts", str(hosts_file), "--run-dir", str(tmp_path / "run"), *argv]


def schedule(tmp_path: Path, *gpus: int) -> str:
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps([{"gpus": g, "steps": 2} for g in gpus]))
    return str(path)


HOSTS_CASES = [  # (hosts file, what the one line must say); each malformed kind in both forms
    ("a\nb\na\n", "hosts.txt:3: host 'a' is listed twice (lines 1 and 3)"),
    ("a slots=2\nb slots=2\na slots=4\n", "hosts.txt:3: host 'a' is listed twice"),
    ("a slots=\n", "hosts.txt:1: 'slots=' has no value"),
    ("a\nb slots=0\n", "hosts.txt:2: slots='0' must be positive"),
    ("a slots=-2\n", "hosts.txt:1: slots='-2' is negative"),
    ("a slots=two\n", "hosts.txt:1: slots='two' is not an integer"),
    ("a slots=1.5\n", "hosts.txt:1: slots='1.5' is not an integer"),
    ("host_1\n", "hosts.txt:1: 'host_1' is not a valid hostname or IP address"),
    ("host_1 slots=2\n", "hosts.txt:1: 'host_1' is not a valid hostname or IP address"),
    ("a b\n", "hosts.txt:1: unknown option 'b'"),
    ("a slots=2 extra\n", "hosts.txt:1: unexpected 'extra' after 'slots=2'"),
    ("a gpus=2\n", "hosts.txt:1: unknown option 'gpus=2'"),
    ("# only a comment\n\n", "no hosts"),
]
INJECTION = [
    "a;touch {m}\n",
    "$(touch {m})\n",
    "`touch {m}` slots=2\n",
    "a slots=2;touch {m}\n",
    "a slots=$(touch {m})\n",
    "a && touch {m}\n",
]


def assert_refused(capsys, argv: list[str], message: str, tmp_path: Path) -> None:
    assert cli.main(argv) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("elastic-trainer: error: "), err
    assert not (tmp_path / "run").exists()  # no run folder, no checkpoint folder, no log


@pytest.mark.parametrize("hosts, message", HOSTS_CASES)
def test_malformed_hosts_file(capsys, tmp_path, hosts, message):
    assert_refused(capsys, launch(tmp_path, hosts), message, tmp_path)


@pytest.mark.parametrize("line", INJECTION)
def test_shell_injection_in_hosts_file_is_refused(capsys, tmp_path, line):
    marker = tmp_path / "pwned"
    assert_refused(capsys, launch(tmp_path, line.format(m=marker)), "hosts.txt:1:", tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "SCHEDULE:4,16"], "schedule phase 2 (16 GPUs): 16 GPUs asked for, but the hosts in"),
        (["--schedule", "SCHEDULE:4,5", "--", "--micro-batch", "3"], "schedule phase 1 (4 GPUs): with --micro-batch 3"),
        (["--gpus-per-host", "0"], "argument --gpus-per-host: '0' is not an integer in [1, "),
        (["--force-ssh", "elsewhere"], "--force-ssh 'elsewhere' is not a host of"),
        (["--detect-self-ip", "nosuchif0"], "--detect-self-ip 'nosuchif0': no such interface"),
        (["--resume", "--schedule", "none"], "--resume: no complete checkpoint in"),
        (["--schedule", "no-such-schedule"], "schedule 'no-such-schedule' does not exist"),
        (["--", "--checkpoint-dir", "/tmp/x"], "--checkpoint-dir is set by launch for every phase"),
        (["--", "--until-step=3"], "--until-step is set by launch for every phase"),
        (["--", "--micro-batch", "3"], "micro_batch=3 does not divide the per-replica batch"),
        (
            ["--schedule", "SCHEDULE:4,2", "--", "--layout", "2,1,2"],
            "schedule phase 2 (2 GPUs): --layout 2,1,2: layout dp*tp*pp",
        ),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--data", "/nonexistent/corpus.txt"], "is neither 'sotu' nor an existing file, folder or Megatron prefix"),
        (["stray"], "unexpected 'stray': put `train` arguments after --"),
    ],
)
def test_bad_launch_input(capsys, tmp_path, argv, message):
    argv = [schedule(tmp_path, *map(int, a.split(":")[1].split(","))) if a.startswith("SCHEDULE:") else a for a in argv]
    assert_refused(capsys, launch(tmp_path, "localhost slots=8\n", *argv), message, tmp_path)


def test_dry_run_of_four_hosts_with_eight_gpus(capsys, tmp_path):
    """Tenplex's bare host names with --gpus-per-host 8: the plan for 32 GPUs, and per host an ssh command
    whose remote part, unquoted by a shell, is the agent's exact argument list."""
    argv = launch(
        tmp_path,
        "g0011\ng0012\ng0013\ng0017\n",
        "--gpus-per-host",
        "8",
        "--model",
        "gpt3-xl",
        "--schedule",
        "none",
        "--rdzv-port",
        "29400",
        "--dry-run",
        "--",
        "--hardware",
        "h100-80g",
        "--global-batch",
        "128",
        "--seq-len",
        "1024",
    )
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "phase 1/1: 32 GPUs on g0011:8, g0012:8, g0013:8, g0017:8" in out
    assert "[plan] 32 x h100-80g (8 per host): dp=" in out
    ssh_lines = [line.split(" (ssh): ", 1) for line in out.splitlines() if " (ssh): " in line]
    assert [host.strip().removeprefix("[launch]").strip() for host, _ in ssh_lines] == [
        "g0011",
        "g0012",
        "g0013",
        "g0017",
    ]
    for host, command in ssh_lines:
        argv = shlex.split(command)
        assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"] and argv[-3:-1] == [host.split()[-1], "--"]
        remote = shlex.split(argv[-1])
        assert remote[0] == f"{PROJECT_ROOT}/launch/remote.sh" and remote[1] == "env"
        agent = remote[remote.index(f"{PROJECT_ROOT}/.venv/bin/python") :]
        assert agent[1:3] == ["-m", "elastic_trainer.launch.agent"]
        assert agent[agent.index("--nnodes") + 1] == "1:4" and agent[agent.index("--nproc-per-node") + 1] == "8"
        assert agent[agent.index("--local-addr") + 1] == host.split()[-1]
        assert agent[agent.index("-m", 3) :] == [
            "-m",
            "elastic_trainer.rank",
            "--job",
            str(tmp_path / "run" / "jobs" / "et-job.json"),
            "--phase",
            "0",
        ]
    assert not (tmp_path / "run").exists()


def fake_checkpoint(folder: Path, meta: dict | None) -> Path:
    """A committed-looking checkpoint folder: the launcher reads only its meta.json."""
    step = folder / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{not json" if meta is None else json.dumps(meta))
    return step


def test_checkpoint_of_another_model_or_trajectory_is_refused_before_starting(capsys, tmp_path):
    """The newest checkpoint's meta.json is compared with the job before anything starts (the ranks would
    each refuse it later); nothing in the run folder changes."""
    from dataclasses import asdict

    from elastic_trainer.checkpoint.state import FORMAT, train_dict
    from elastic_trainer.config import configs_dir, load_model_config, load_run_config

    run = load_run_config(configs_dir() / "runs" / "default.toml")
    meta = {
        "format": FORMAT,
        "step": 2,
        "model": asdict(load_model_config("gpt-tiny")),
        "train": train_dict(run.train),
        "layout": {"dp": 1, "tp": 1, "pp": 1},
    }
    step = fake_checkpoint(tmp_path / "run", meta)
    argv = launch(tmp_path, "localhost slots=8\n")
    cases = [
        (["--model", "gpt3-small", "--schedule", "none"], f"{step} holds a different model: n_layers=12"),
        (["--", "--lr", "0.5"], f"{step} was trained with other settings: lr=0.5 (checkpoint: 0.001)"),
    ]
    files = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*"))
    for extra, message in cases:
        assert cli.main([*argv, *extra]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")) == files  # untouched


def test_unreadable_checkpoint_metadata_is_one_line(capsys, tmp_path):
    fake_checkpoint(tmp_path / "run", None)
    assert cli.main(launch(tmp_path, "localhost slots=8\n")) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "step-00000002/meta.json' is unreadable (Expecting property name" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "example, hosts",
    [
        ("hosts.tenplex.example", "g0011:8 g0012:8 g0013:8 g0017:8 = 32"),
        ("hosts.deepspeed.example", "worker-1:8 worker-2:8 worker-3:4 = 20"),
    ],
)
def test_example_hosts_files_dry_run(capsys, tmp_path, example, hosts):
    argv = [
        "launch",
        "--hosts",
        str(PROJECT_ROOT / "launch" / example),
        "--run-dir",
        str(tmp_path / "run"),
        "--gpus-per-host",
        "8",
        "--model",
        "gpt3-xl",
        "--schedule",
        "none",
        "--dry-run",
        "--",
        "--hardware",
        "h100-80g",
        "--global-batch",
        "128",
        "--seq-len",
        "1024",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f": {hosts} slots" in out and out.count(" (ssh): ssh -T ") == len(hosts.split()) - 2


def test_pinned_layouts_waits_and_runs_through_in_a_dry_run(tmp_path, capsys):
    path = tmp_path / "pinned.json"
    path.write_text(
        json.dumps(
            [
                {"gpus": 4, "duration_s": 30, "layout": "1,2,2", "micro_batch": 2},
                {"gpus": 4, "duration_s": 30, "layout": "1,2,2", "micro_batch": 2},  # the same: no restart
                {"gpus": 0, "duration_s": 20},
                {"gpus": 2, "duration_s": 30},
            ]
        )
    )
    argv = launch(tmp_path, "localhost slots=4\n", "--model", "gpt-tiny", "--schedule", str(path), "--dry-run")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "phase 1-2/4: 4 GPUs on localhost:4 for 60 s" in out
    assert "[plan] given: dp=1 tp=2 pp=2 micro_batch=2 num_microbatches=4 (fsdp)" in out
    assert "phase 3/4: no GPUs for 20 s: the job waits" in out
    assert "phase 4/4: 2 GPUs on localhost:2 for 30 s" in out and "phase 2/4" not in out
    assert out.count("elastic_trainer.launch.agent") == 2  # one start for phases 1-2, one for phase 4


@pytest.mark.parametrize(
    "phases,extra,message",
    [
        ([{"gpus": 3, "steps": 2, "layout": "1,3,1"}], (), "schedule phase 1 (3 GPUs): tp=3 does not divide n_heads=4"),
        (
            [{"gpus": 4, "steps": 2, "layout": "2,2,1"}],
            ("--", "--layout", "2,2,1"),
            "pins layouts per phase; drop --layout",
        ),
        ([{"gpus": 4, "steps": 2, "layout": "4,1,1", "micro_batch": 3}], (), "micro"),
    ],
)
def test_bad_pinned_layouts_are_refused_before_anything_runs(tmp_path, capsys, phases, extra, message):
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(phases))
    argv = launch(tmp_path, "localhost slots=4\n", "--model", "gpt-tiny", "--schedule", str(path), *extra)
    assert cli.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_pinned_layout_takes_the_run_configs_mode_as_the_ranks_do(tmp_path, capsys):
    """The launcher completes a phase's degrees as --layout is completed: the run config's [layout] dp_mode and
    recompute apply."""
    config = tmp_path / "run.toml"
    config.write_text('model = "gpt-tiny"\n[train]\nglobal_batch = 8\n[layout]\ndp_mode = "ddp"\nrecompute = true\n')
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps([{"gpus": 4, "steps": 2, "layout": "2,2,1"}]))
    argv = launch(tmp_path, "localhost slots=4\n", "--config", str(config), "--schedule", str(path), "--dry-run")
    assert cli.main(argv) == 0
    assert "[plan] given: dp=2 tp=2 pp=1 micro_batch=4 num_microbatches=1 (ddp+recompute)" in capsys.readouterr().out


def test_check_is_train_s_and_launch_says_what_to_use(capsys, tmp_path):
    assert_refused(
        capsys,
        launch(tmp_path, "localhost slots=8\n", "--", "--check"),
        "--check is train's; `launch --dry-run` checks the whole job",
        tmp_path,
    )
