"""calibrate's per-mode measurements on forked ranks: every dp mode measured on the probe, the host probe training
the job's model in each mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic_trainer import cli
from elastic_trainer.config import load_model_config
from elastic_trainer.parallel import calibrate_modes
from elastic_trainer.plan import load_hardware


@pytest.mark.skipif(torch.cuda.is_available(), reason="calibrate measures the machine's GPU there")
def test_calibrate_model_measures_every_mode_on_the_probe(tmp_path, capsys):
    """The real measurement at gpt-tiny's shapes (2 forked ranks): every mode gets positive optimizer
    figures, the cheapest mode no excess, the rest of the profile is --base's, and the file loads."""
    out = tmp_path / "tiny.toml"
    assert (
        cli.main(
            [
                "calibrate",
                "--base",
                "cpu",
                "--model",
                "gpt-tiny",
                "--seq-len",
                "32",
                "--only-optimizer",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    hw, base = load_hardware(str(out)), load_hardware("cpu")
    assert hw.name == "tiny" and hw.optimizer_shapes == "gpt-tiny, seq_len 32"
    assert all(
        hw.optimizer_ns(m) > 0 and getattr(hw, f"{m}_optimizer_ns_per_param") > 0 for m in ("fsdp", "ddp", "zero1")
    )
    hooks = [hw.hooks_ns(m) for m in ("fsdp", "ddp", "zero1")]
    assert min(hooks) == 0.0 and all(h >= 0 for h in hooks)
    assert (
        dataclasses.replace(
            hw,
            **{
                f: getattr(base, f)
                for f in (
                    "name",
                    "optimizer_shapes",
                    *(f"{m}_{k}_ns_per_param" for m in ("fsdp", "ddp", "zero1") for k in ("optimizer", "hooks")),
                )
            },
        )
        == base
    )
    assert capsys.readouterr().out.count("[calibrate] gpt-tiny (seq 32), ") == 3


def test_the_host_probe_trains_the_job_s_model_in_each_mode_for_real():
    """measure_host end to end on one CPU rank (a forked process: it forms its process group of one)."""
    from elastic_trainer.parallel.local_ranks import run_ranks

    tiny = dataclasses.replace(load_model_config("gpt-tiny"), n_layers=2)
    got = run_ranks(
        lambda rank, world: calibrate_modes.measure_host(
            tiny, torch.device("cpu"), ("zero1", "ddp"), steps=1, warmup=1
        ),
        1,
    )[0]
    assert set(got) == {"zero1", "ddp"} and all(0 < ms < 1000 for ms in got.values())
