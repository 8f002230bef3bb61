"""Bad input fails with one line naming the value and the valid choices, before any process group."""

import pytest
import torch.distributed as dist

from elastic_trainer import cli, rank, resolve
from elastic_trainer.config import ConfigError, load_model_config
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.topology import Topology


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    monkeypatch.setattr(rank, "run", lambda *a, **k: pytest.fail("bad input reached training"))


@pytest.mark.parametrize(
    "world, argv, message",
    [
        (4, ["--layout", "2,1,1"], "layout dp*tp*pp = 2*1*1 = 2 does not match world size 4 (valid DP,TP,PP: 4,1,1"),
        (3, ["--layout", "1,3,1"], "tp=3 does not divide n_heads=4 (valid: 1, 2, 4)"),
        (5, ["--layout", "1,1,5"], "pp=5 exceeds n_layers=4 (valid: 1..4)"),
        (
            4,
            ["--layout", "4,1,1", "--global-batch", "10"],
            "global batch 10 is not divisible by dp=4 (valid dp: 1, 2, 5, 10)",
        ),
        (2, ["--micro-batch", "3"], "micro_batch=3 does not divide the per-replica batch 8/2 = 4 (valid: 1, 2, 4)"),
        (1, ["--model", "gpt-5"], "unknown model 'gpt-5' (valid: gpt-tiny, gpt3-medium, gpt3-small, gpt3-xl)"),
        (1, ["--seq-len", "300"], "seq_len=300 exceeds gpt-tiny's context_length=256"),
        (1, ["--layout", "2,x,1"], "--layout '2,x,1' must be three positive integers DP,TP,PP"),
        (1, ["--config", "/nonexistent/run.toml"], "config file '/nonexistent/run.toml' does not exist"),
        (1, ["--data", "/nonexistent/corpus.txt"], "is neither 'sotu' nor an existing file, folder or Megatron prefix"),
        (1, ["--dp-mode", "ddp", "--steps", "-1"], "argument --steps: '-1' is not an integer in [0, 1000000000]"),
        (2, ["--micro-batch", "0"], "argument --micro-batch: '0' is not an integer in [1, 16777216]"),
        (2, ["--global-batch", "6", "--micro-batch", "4"], "micro_batch=4 does not divide"),  # planned layout
    ],
)
def test_bad_input_is_one_line_before_any_process_group(monkeypatch, capsys, world, argv, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", *argv]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("elastic-trainer: error: ")
    assert not dist.is_initialized()


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "four"), ("LOCAL_WORLD_SIZE", "0")])
def test_bad_torchrun_environment_is_one_line(monkeypatch, capsys, name, value):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(name, value)
    assert cli.main(["train"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"elastic-trainer: error: environment variable {name}={value!r} must be an integer >= 1\n"
    assert not dist.is_initialized()


def spec_of(argv: list[str], world: int, local: int | None = None):
    args = cli.build_parser().parse_args(["train", *argv])
    return resolve.train_spec(
        args, built_by="test", world_size=world, local_world_size=local or world, hosts_known=local in (None, world)
    )


def test_good_input_resolves_layout():
    spec = spec_of(["--layout", "2,2,2", "--micro-batch", "2", "--dp-mode", "ddp"], 8)
    layout = spec.phases[0].layout
    assert (layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.num_microbatches) == (2, 2, 2, 2, 2)
    assert layout.dp_mode == "ddp" and spec.model.name == "gpt-tiny" and spec.train.global_batch == 8
    assert spec.phases[0].pinned


def test_default_layout_is_planned_for_the_real_hosts():
    """On one known host the spec carries the plan; across hosts nothing is fixed before the process group and
    rank 0 plans for the hosts it finds."""
    from elastic_trainer.plan import Request, load_hardware, plan
    from elastic_trainer.plan.topology import Topology

    one_host = spec_of([], 4)
    expected = plan(Request(one_host.model, 4, 8, one_host.train.seq_len, load_hardware("cpu"), 4)).chosen
    assert one_host.phases[0].layout == expected.layout and one_host.phases[0].hosts == (4,)
    spec = spec_of([], 4, local=2)
    assert spec.phases[0].layout is None and spec.phases[0].hosts is None
    chosen, _, line = resolve.plan_for_hosts(spec, spec.hardware, Topology((4,)))
    assert chosen == expected.layout and chosen.global_batch == spec.train.global_batch == 8
    assert line.startswith("[plan] 4 x cpu (4 per host)") and expected.layout.describe() in line
    h100 = spec_of(["--hardware", "h100-80g"], 4, local=2)
    split, _, line = resolve.plan_for_hosts(h100, h100.hardware, Topology((3, 1)))
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
    cases.append(
        (["--checkpoint-dir", str(tmp_path), "--resume", "never"], "already holds checkpoints (step-00000004, ...)")
    )
    for argv, message in cases:
        assert cli.main(["train", *argv]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not dist.is_initialized()
