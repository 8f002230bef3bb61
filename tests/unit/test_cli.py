"""Bad input fails with one line naming the value and the valid choices, before any process group."""

import pytest
import torch.distributed as dist

from elastic_trainer import cli, resolve
from elastic_trainer.config import ConfigError, load_model_config
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.topology import Topology


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    monkeypatch.setattr(cli, "run_train", lambda *a: pytest.fail("bad input reached training"))


@pytest.mark.parametrize("world, argv, message", [
    (4, ["--layout", "2,1,1"], "layout dp*tp*pp = 2*1*1 = 2 does not match world size 4 (valid DP,TP,PP: 4,1,1"),
    (3, ["--layout", "1,3,1"], "tp=3 does not divide n_heads=4 (valid: 1, 2, 4)"),
    (5, ["--layout", "1,1,5"], "pp=5 exceeds n_layers=4 (valid: 1..4)"),
    (4, ["--layout", "4,1,1", "--global-batch", "10"], "global batch 10 is not divisible by dp=4 (valid dp: 1, 2, 5, 10)"),
    (2, ["--micro-batch", "3"], "micro_batch=3 does not divide the per-replica batch 8/2 = 4 (valid: 1, 2, 4)"),
    (1, ["--model", "gpt-5"], "unknown model 'gpt-5' (valid: gpt-tiny, gpt3-medium, gpt3-small, gpt3-xl)"),
    (1, ["--seq-len", "300"], "seq_len=300 exceeds gpt-tiny's context_length=256"),
    (1, ["--layout", "2,x,1"], "--layout '2,x,1' must be three positive integers DP,TP,PP"),
    (1, ["--config", "/nonexistent/run.toml"], "config file '/nonexistent/run.toml' does not exist"),
    (1, ["--data", "/nonexistent/corpus.txt"], "is neither 'sotu' nor an existing file or folder"),
    (1, ["--dp-mode", "ddp", "--steps", "-1"], "argument --steps: '-1' is not an integer in [0, 1000000000]"),
    (2, ["--micro-batch", "0"], "argument --micro-batch: '0' is not an integer in [1, 16777216]"),
    (2, ["--global-batch", "6", "--micro-batch", "4"], "micro_batch=4 does not divide"),  # planned layout
])
def test_bad_input_is_one_line_before_any_process_group(monkeypatch, capsys, world, argv, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", *argv]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("elastic-trainer: error: ")
    assert not dist.is_initialized()


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "four"), ("LOCAL_WORLD_SIZE", "0")])
def test_bad_torchrun_environment_is_one_line(monkeypatch, capsys, name, value):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(name, value)
    assert cli.main(["train"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"elastic-trainer: error: environment variable {name}={value!r} must be an integer >= 1\n"
    assert not dist.is_initialized()


def test_good_input_resolves_layout(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = cli.build_parser().parse_args(["train", "--layout", "2,2,2", "--micro-batch", "2", "--dp-mode", "ddp"])
    model, train, layout, _ = resolve.resolve_train_args(args, 8)
    assert (layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.num_microbatches) == (2, 2, 2, 2, 2)
    assert layout.dp_mode == "ddp" and model.name == "gpt-tiny" and train.global_batch == 8


def test_default_layout_is_planned_for_the_real_hosts(monkeypatch):
    """Without --layout nothing is fixed before the process group; rank 0 plans for the hosts it finds."""
    from elastic_trainer.plan import Request, load_hardware, plan
    from elastic_trainer.plan.topology import Topology

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = cli.build_parser().parse_args(["train"])
    model, train, layout, table = resolve.resolve_train_args(args, 4)
    assert layout is None
    chosen, line = resolve.plan_for_hosts(args, model, train, table, Topology((4,)))
    expected = plan(Request(model, 4, train.global_batch, train.seq_len, load_hardware("cpu"), 4)).chosen
    assert chosen == expected.layout and chosen.global_batch == train.global_batch == 8
    assert line.startswith("[plan] 4 x cpu (4 per host)") and expected.layout.describe() in line
    tp2 = cli.build_parser().parse_args(["train", "--hardware", "h100-80g"])
    split, line = resolve.plan_for_hosts(tp2, model, train, table, Topology((3, 1)))
    assert split.tp == 1 and "(3+1 per host)" in line


def test_given_layout_must_keep_tp_on_one_host():
    model = load_model_config("gpt-tiny")
    resolve.check_hosts(Layout(1, 2, 2, 8, 1), model, Topology((2, 2)))
    with pytest.raises(ConfigError, match=r"tp=2 groups would span hosts \(3\+1 per host\) \(valid tp: 1\)"):
        resolve.check_hosts(Layout(2, 2, 1, 4, 1), model, Topology((3, 1)))


def test_checkpoint_flags_bad_input(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    cases = [
        (["--resume", str(tmp_path / "missing")], "needs --checkpoint-dir"),
        (["--checkpoint-dir", str(tmp_path), "--resume", "latest"], "--resume 'latest' is neither auto, never nor"),
        (["--checkpoint-dir", str(tmp_path), "--keep", "-1"], "argument --keep: '-1' is not an integer in [0, "),
    ]
    (tmp_path / "step-00000004").mkdir()
    cases.append((["--checkpoint-dir", str(tmp_path), "--resume", "never"],
                  "already holds checkpoints (step-00000004, ...)"))
    for argv, message in cases:
        assert cli.main(["train", *argv]) == cli.EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not dist.is_initialized()
