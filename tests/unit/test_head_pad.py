"""The output head padded to a multiple of rows (model.gpt.project_to_vocab, on CUDA by default): the logits
and every gradient are those of the plain `F.linear`, the parameter keeps its shape, and the CPU default is
unpadded. benchmarks/gpu/head_pad.py measures the same on a GPU, with the speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_trainer.config import load_model_config
from elastic_trainer.model import gpt
from elastic_trainer.model.gpt import GPT, lm_loss_sum, project_to_vocab
from elastic_trainer.model.init import init_weights


def test_padded_projection_gives_the_plain_logits_and_gradients():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1000, 16, dtype=torch.float64, requires_grad=True)  # 1000 = 15 * 64 + 40: 24 rows padded
    target = torch.randint(0, 1000, (2, 5))
    grads = []
    for multiple in (1, 64, 7):
        logits = project_to_vocab(h, w, multiple)
        assert logits.shape == (2, 5, 1000)
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        grads.append((logits.detach(), h.grad.clone(), w.grad.clone()))
        h.grad, w.grad = None, None
    plain = F.linear(h, w).detach()
    for logits, gh, gw in grads:
        torch.testing.assert_close(logits, plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, grads[0][1], rtol=1e-12, atol=1e-12)
        assert gw.shape == w.shape
        torch.testing.assert_close(gw, grads[0][2], rtol=1e-12, atol=1e-12)


def test_the_cpu_default_is_unpadded_and_a_padded_model_trains_the_same(monkeypatch):
    assert "cpu" not in gpt.VOCAB_PAD_MULTIPLE and gpt.VOCAB_PAD_MULTIPLE["cuda"] == 64
    model = GPT(load_model_config("gpt-tiny")).double()
    init_weights(model, seed=3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    out = {}
    for multiple in (None, 64):
        if multiple:
            monkeypatch.setitem(gpt.VOCAB_PAD_MULTIPLE, "cpu", multiple)
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        lm_loss_sum(logits, tokens[:, 1:]).backward()
        out[multiple] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[64][0], out[None][0], rtol=1e-12, atol=1e-12)
    for name, g in out[None][1].items():
        torch.testing.assert_close(out[64][1][name], g, rtol=1e-12, atol=1e-12, msg=name)
