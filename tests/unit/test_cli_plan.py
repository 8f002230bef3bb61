"""`elastic-trainer plan` and `calibrate` as users run them: table, JSON, --compare, bad input."""

from __future__ import annotations

import json

import pytest

from elastic_trainer import cli
from elastic_trainer.plan import load_hardware

XL = ["plan", "--model", "gpt3-xl", "--gpus-per-host", "8", "--hardware", "h100-80g", "--global-batch", "128",
      "--seq-len", "1024"]


def test_json_names_the_chosen_layout_and_the_comparison(capsys):
    assert cli.main([*XL, "--gpus", "16", "--json", "--compare", "2,2,4"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["chosen"]
    assert chosen["dp"] * chosen["tp"] * chosen["pp"] == 16
    assert chosen["dp"] * chosen["micro_batch"] * chosen["num_microbatches"] == 128
    assert chosen["memory_gb"] < 80 and chosen["step_time_s"] > 0
    assert out["candidates"][0] == chosen and len(out["candidates"]) > 10
    assert (out["compare"]["dp"], out["compare"]["tp"], out["compare"]["pp"]) == (2, 2, 4)
    assert out["compare"]["step_time_s"] >= chosen["step_time_s"]


def test_table_shows_top_rows_and_comparison(capsys):
    assert cli.main([*XL, "--gpus", "8", "--top", "3", "--compare", "1,2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpt3-xl on 8 x h100-80g (8 per host, bf16), global batch 128 x 1024 tokens")
    assert lines[1].split() == ["#", "dp", "tp", "pp", "micro", "accum", "mode", "recompute", "GiB/GPU", "step", "s",
                                "tokens/s", "bubble"]
    assert [line.split()[0] for line in lines[2:6]] == ["1", "2", "3", "cmp"]
    assert lines[6].startswith("compare 1,2,4: predicted ")


@pytest.mark.parametrize("argv, message", [
    ([*XL, "--gpus", "29"], "no DP,TP,PP of 29 GPUs is valid"),
    ([*XL, "--gpus", "100000"], "100000 GPUs are more than gpt3-xl with global batch 128 can use"),
    ([*XL, "--gpus", "16", "--compare", "2,2,2"], "layout 2,2,2 has 8 GPUs, not 16"),
    ([*XL, "--gpus", "16", "--global-batch", "8", "--compare", "16,1,1"],
     "layout 16,1,1 is invalid: dp=16 does not divide the global batch 8"),
    ([*XL, "--gpus", "0"], "argument --gpus: '0' is not an integer in [1, "),
    ([*XL, "--gpus", "8", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    ([*XL, "--gpus", "8", "--seq-len", "4096"], "seq_len=4096 exceeds gpt3-xl's context_length=2048"),
    ([*XL, "--gpus", "8", "--micro-batch", "0"], "argument --micro-batch: '0' is not an integer in [1, "),
    ([*XL, "--gpus", "8", "--gpus-per-host", "0"], "argument --gpus-per-host: '0' is not an integer in [1, "),
    ([*XL, "--gpus", "8", "--compare", "2,x"], "--compare '2,x' must be three positive integers DP,TP,PP"),
    (["calibrate", "--ranks", "2,x"], "--ranks '2,x' must be rank counts from 2 to 64 separated by commas"),
])
def test_bad_plan_requests_are_one_line(capsys, argv, message):
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("elastic-trainer: error: "), err


def test_calibrate_writes_a_loadable_profile(tmp_path, monkeypatch, capsys):
    from elastic_trainer.parallel import calibrate

    monkeypatch.setattr(calibrate, "CPU_SHAPES", [(64, 128), (128, 128), (64, 256)])
    monkeypatch.setattr(calibrate, "HEAD_SHAPES", [(128, 1024), (256, 1024), (128, 2048), (256, 2048)])
    monkeypatch.setattr(calibrate, "LINK_SIZES", [2**16, 2**22])
    out = tmp_path / "here.toml"
    assert cli.main(["calibrate", "--output", str(out), "--ranks", "2"]) == 0
    hw = load_hardware(out)
    assert hw.name == "here" and hw.device == "cpu" and hw.shared_host and hw.tflops > 0
    assert f"wrote {out}" in capsys.readouterr().out
