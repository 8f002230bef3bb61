"""`calibrate --model` (parallel/calibrate_modes.py) and the terms its figures feed (plan/step_time.py): each
dp mode's optimizer step and its excess over the cheapest mode, fitted by hand from phases we choose, charged
by hand in a step; and one real measurement on gpt-tiny's probe, checked only for what noise cannot change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic_trainer import cli
from elastic_trainer.config import load_model_config
from elastic_trainer.parallel import calibrate_modes
from elastic_trainer.plan import Request, load_hardware
from elastic_trainer.plan.explain import by_phase, terms
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import stage_numel
from elastic_trainer.plan.step_time import step_time


def bare_cpu():
    """The shipped cpu profile without its per-mode figures: every mode's optimizer the common figure, no
    mode's excess."""
    return dataclasses.replace(
        load_hardware("cpu"),
        **{f"{m}_{k}_ns_per_param": 0.0 for m in ("fsdp", "ddp", "zero1") for k in ("optimizer", "hooks")},
    )


def test_fitted_figures_by_hand():
    """Phases made of the model's own prediction plus known extras: the optimizer figure is clip + AdamW per
    local parameter; the hooks figure is a mode's extra less the cheapest mode's, per stage parameter and per
    collective of the probe (fsdp: gather, gather again in backward, reduce-scatter; ddp: one all-reduce)."""
    model = load_model_config("gpt3-small")  # the phases are the model's prediction without any mode's excess
    hw = dataclasses.replace(bare_cpu(), optimizer_shapes="")
    probe = calibrate_modes.probe_model(model)
    assert (probe.n_layers, probe.d_model, probe.vocab_size) == (2, 768, 50257)
    req = Request(probe, 2, 2, 128, hw, 2, dtype="fp32")
    whole = stage_numel(probe, Layout(2, 1, 1, 1, 1), 0)
    extra = {"fsdp": 0.9, "ddp": 0.4, "zero1": 0.1}
    measured = {}
    for mode, more in extra.items():
        p = by_phase(req, calibrate_modes.probe_layout(2, mode))
        local = whole if mode == "ddp" else whole // 2
        measured[mode] = (
            {
                "batch": 0.001,
                "forward_backward": p["forward_backward"] + more,
                "sync": p["sync"],
                "clip": 0.05,
                "optimizer": 0.25,
            },
            local,
        )
    got = calibrate_modes.fitted(hw, model, 128, measured)
    assert got.optimizer_shapes == "gpt3-small, seq_len 128"
    # the model runs the probe's 2 ranks on the host's compute units:
    # optimizer = local x 2 ranks / units, hooks x 2 / units
    share = 2 / hw.compute_units
    assert got.ddp_optimizer_ns_per_param == pytest.approx(0.3 / (whole * share) * 1e9, rel=1e-9)
    assert got.fsdp_optimizer_ns_per_param == pytest.approx(0.3 / (whole / 2 * share) * 1e9, rel=1e-9)
    assert got.fsdp_hooks_ns_per_param == pytest.approx(0.8 / (whole * 3 * share) * 1e9, rel=1e-6)
    assert got.ddp_hooks_ns_per_param == pytest.approx(0.3 / (whole * 1 * share) * 1e9, rel=1e-6)
    assert got.zero1_hooks_ns_per_param == 0.0
    fitted_req = Request(probe, 2, 2, 128, got, 2, dtype="fp32")  # the fitted profile predicts the probe back
    for mode, (phases, _) in measured.items():
        p = by_phase(fitted_req, calibrate_modes.probe_layout(2, mode))
        assert p["clip"] + p["optimizer"] == pytest.approx(phases["clip"] + phases["optimizer"], rel=1e-9)
        assert p["forward_backward"] + p["sync"] == pytest.approx(
            phases["forward_backward"] + phases["sync"] - extra["zero1"], rel=1e-9
        )  # less the cheapest's excess
    assert got.tflops == hw.tflops and got.optimizer_ns_per_param == hw.optimizer_ns_per_param  # the rest kept


def test_the_modes_figures_in_a_step_by_hand():
    """fsdp without a pipeline, 2 micro-batches on 4 ranks of one shared host: its excess is charged for
    2 x (2 gathers and a reduce-scatter) per stage parameter, slowed by 4 ranks on the host's units; the optimizer
    per local parameter (1/dp of the stage); with a pipeline, 2 collectives; nothing at dp 1."""
    model = load_model_config("gpt3-small")
    hw = dataclasses.replace(bare_cpu(), fsdp_hooks_ns_per_param=3.0, fsdp_optimizer_ns_per_param=11.0)
    layout = Layout(4, 1, 1, 1, 2, "fsdp")
    t = step_time(model, layout, 128, "fp32", hw, 4)
    whole = stage_numel(model, layout, 0)
    slow = 4 / hw.compute_units
    assert t.hooks == pytest.approx(3e-9 * whole * 6 * slow, rel=1e-12)
    base_hw = bare_cpu()
    base = step_time(model, layout, 128, "fp32", base_hw, 4)
    assert t.total - t.hooks - t.optimizer == pytest.approx(base.total - base.optimizer, rel=1e-12)
    assert t.optimizer == pytest.approx(base.optimizer * 11.0 / base_hw.optimizer_ns_per_param, rel=1e-12)
    piped = Layout(2, 1, 2, 1, 4, "fsdp")
    larger = max(stage_numel(model, piped, s) for s in range(2))
    bandwidth = hw.memory_bandwidth_gbs * 1e9
    # with a pipeline fsdp unshards and reduces once per step: the counted copies (wrapper_bytes, CPU ranks:
    # 8 / dp + 8 around the all-gather, 8 into the reduce-scatter) and the excess per collective
    assert step_time(model, piped, 128, "fp32", hw, 4).hooks == pytest.approx(
        (3e-9 * larger * 2 + larger * (8 / 2 + 8 + 8) / bandwidth) * slow, rel=1e-12
    )
    assert step_time(model, Layout(1, 1, 4, 1, 8, "fsdp"), 128, "fp32", hw, 4).hooks == 0.0
    ddp = Layout(4, 1, 1, 1, 2, "ddp")  # no excess measured: its reduction's copies only (in 8, out 16)
    assert step_time(model, ddp, 128, "fp32", hw, 4).hooks == pytest.approx(
        stage_numel(model, ddp, 0) * 24 / bandwidth * slow, rel=1e-12
    )
    req = Request(model, 4, 8, 128, hw, 4, dtype="fp32")
    assert sum(s for _, s in terms(req, layout)) == pytest.approx(t.total, rel=1e-12)
    assert sum(by_phase(req, layout).values()) == pytest.approx(t.total, rel=1e-12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="calibrate measures the machine's GPU there")
def test_calibrate_model_refuses_bad_requests_before_measuring(tmp_path, capsys):
    out = str(tmp_path / "x.toml")
    assert cli.main(["calibrate", "--model", "gpt-tiny", "--only-optimizer", "--output", out]) == 2
    assert "--only-optimizer needs --model" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "calibrate",
                "--base",
                "cpu",
                "--model",
                "gpt-tiny",
                "--seq-len",
                "100000",
                "--only-optimizer",
                "--output",
                out,
            ]
        )
        == 2
    )
    assert "exceeds gpt-tiny's context_length" in capsys.readouterr().err
    assert (
        cli.main(["calibrate", "--base", "cpu", "--model", "no-such-model", "--only-optimizer", "--output", out]) == 2
    )
    assert (
        cli.main(["calibrate", "--base", "h100-80g", "--model", "gpt-tiny", "--only-optimizer", "--output", out]) == 2
    )
    assert "is a cuda profile" in capsys.readouterr().err


# --- the host probe (calibrate --model on a GPU) ----------------------------------------------------------------


def test_the_host_probe_keeps_the_model_where_it_fits_and_cuts_it_where_it_does_not():
    xl = load_model_config("gpt3-xl")
    assert calibrate_modes.host_probe_model(xl, None) is xl
    assert calibrate_modes.host_probe_model(xl, 139e9) is xl  # 24 blocks x 0.91 GB + 1.85 GB < 69.5 GB
    # by hand: a block holds 12 d^2 = 50.3 M parameters at 18 bytes (0.906 GB), the embedding 1.853 GB; half of
    # 10 GB leaves room for 3 blocks, half of 1 GB for none (one is kept)
    assert calibrate_modes.host_probe_model(xl, 10e9).n_layers == 3
    assert calibrate_modes.host_probe_model(xl, 1e9).n_layers == 1
    assert calibrate_modes.host_probe_model(xl, 10e9).d_model == xl.d_model


def test_the_host_probe_divides_the_host_s_forward_and_backward_by_micro_batches_and_blocks(monkeypatch):
    asked = []

    def steps(model, layout, seq_len, device, dtype, steps, warmup):
        asked.append((model.n_layers, layout, seq_len, dtype))
        return {"phases_s": {"forward_backward": {"fsdp": 0.96, "ddp": 0.48, "zero1": 0.24}[layout.dp_mode]}}

    monkeypatch.setattr(calibrate_modes, "timed_steps", steps)
    tiny = load_model_config("gpt-tiny")
    got = calibrate_modes.measure_host(tiny, torch.device("cpu"))
    per = 1e3 / 8 / tiny.n_layers  # ms per second of the phase, 8 micro-batches
    assert got == pytest.approx({"fsdp": 0.96 * per, "ddp": 0.48 * per, "zero1": 0.24 * per})
    assert asked == [(tiny.n_layers, Layout(1, 1, 1, 1, 8, dp_mode=m), 64, "fp32") for m in ("fsdp", "ddp", "zero1")]
