"""`--compile` (parallel/compile.py): torch.compile per block, on forked gloo ranks in fp32.

gpt-tiny, global batch 8 in micro-batches of 4 (one block shape for every layout, so the layouts share
compiled graphs through the compile cache), 5 steps, against the eager single-process run of the same job
(tests/distributed/test_layout_invariance.py's reference, an independent path: no compile):
- the compiled single-process run equals the eager one within COMPILED_VS_EAGER (relative, per-step loss and
  gradient norm; measured on this machine: see the constant);
- compiled runs of every dp mode, tp and pp with recompute equal the compiled single-process run within
  1e-5, as eager layouts equal the eager run;
- every block is compiled and one graph serves them all, keyed dropout included (dynamo's counters): a
  deeper model does not compile more; the compiled model's output and gradients with dropout equal eager's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from elastic_trainer.config import load_model_config
from elastic_trainer.model.dropout import sample_keys
from elastic_trainer.model.gpt import GPT
from elastic_trainer.parallel.compile import compile_blocks, report, use_cache
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from tests.distributed.test_layout_invariance import CFG, run

COMPILED_VS_EAGER = 1e-6
"""Relative difference allowed between compiled and eager per-step losses and gradient norms (fp32, CPU):
inductor fuses and reorders float operations. Measured 2026-11-26 on the 2-core reference machine, torch
2.13.0: at most 9.0e-8 (loss) and 1.4e-7 (gradient norm) over the 5 steps (printed with -s)."""

LAYOUTS = [
    Layout(2, 1, 1, 4, 1, "ddp"),
    Layout(2, 1, 1, 4, 1, "fsdp"),
    Layout(2, 1, 1, 4, 1, "zero1"),
    Layout(1, 2, 1, 4, 2, "fsdp"),
    Layout(1, 1, 2, 4, 2, "fsdp", recompute=True),
]


@pytest.fixture(scope="module")
def compiled_cfg(tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile-cache")
    return dataclasses.replace(CFG, compile=True, compile_cache=str(cache), eval_every=0)


@pytest.fixture(scope="module")
def compiled_reference(compiled_cfg, sotu_tokens):
    return run(Layout(1, 1, 1, 4, 2), sotu_tokens, compiled_cfg)


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def test_compiled_equals_eager_within_rounding(compiled_reference, sotu_tokens):
    eager = run(Layout(1, 1, 1, 4, 2), sotu_tokens, dataclasses.replace(CFG, eval_every=0))
    for key in ("loss", "grad_norm"):
        diff = rel(compiled_reference[key], eager[key])
        print(f"compiled vs eager {key}: {diff:.2e}")
        assert diff <= COMPILED_VS_EAGER, f"{key}: {compiled_reference[key]} vs eager {eager[key]} ({diff:.1e})"
    assert compiled_reference["ids"] == eager["ids"]


@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=lambda lay: f"dp{lay.dp}-tp{lay.tp}-pp{lay.pp}-{lay.dp_mode}" + ("-recompute" if lay.recompute else ""),
)
def test_compiled_layouts_equal_the_compiled_single_process_run(layout, compiled_cfg, compiled_reference, sotu_tokens):
    got = run(layout, sotu_tokens, compiled_cfg)
    for key in ("loss", "grad_norm"):
        assert rel(got[key], compiled_reference[key]) <= 1e-5, (key, got[key], compiled_reference[key])
    assert got["ids"] == compiled_reference["ids"]


def _dropout_model_compiled_and_eager(rank: int, world: int, cache: str) -> dict:
    use_cache(cache)
    cfg = dataclasses.replace(load_model_config("gpt-tiny"), dropout=0.1)
    torch.manual_seed(0)
    eager = GPT(cfg)
    compiled = GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    blocks = compile_blocks(compiled)
    tokens, keys = torch.randint(0, cfg.vocab_size, (1, 32)), sample_keys(7, torch.arange(1))
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        logits = model(tokens, dropout_keys=keys)
        logits.square().mean().backward()
        out[name] = (logits.detach(), model.layers["0"].mlp.fc.weight.grad.clone())
    return {
        "blocks": blocks,
        "report": report(),
        "out": out,
        "compiled": [b._compiled_call_impl is not None for b in compiled.layers.values()],
    }


def test_one_graph_serves_every_block_with_keyed_dropout(tmp_path):
    """Each layer's dropout keys are computed outside its block (model/gpt.py); with the layer index inside,
    dynamo compiled every block again (4 graphs here, 24 at GPT-3 XL, past its recompile limit of 8). One sample
    (dropout's per-sample loop is unrolled in the graph: two samples took inductor 88 s to build here, one 52 s)."""
    got = run_ranks(_dropout_model_compiled_and_eager, 1, str(tmp_path))[0]
    assert got["blocks"] == 4 and all(got["compiled"])
    assert got["report"]["graphs"] == 1, got["report"]
    (logits, grad), (c_logits, c_grad) = got["out"]["eager"], got["out"]["compiled"]
    # the same masks (a different one would move a logit by ~1); rounding measured: logits 1.5e-5 absolute
    # (of up to ~12), gradients 2.6e-8 (of up to 7e-3)
    assert torch.allclose(c_logits, logits, rtol=0, atol=1e-4)
    assert torch.allclose(c_grad, grad, rtol=0, atol=2e-7)
