"""The output head padded to a multiple of 64 rows on CUDA (model.gpt.project_to_vocab): the same numbers, faster.

    python benchmarks/gpu/head_pad.py --out head_pad.json      # on a CUDA machine (~20 s)
    python benchmarks/gpu/head_pad.py --smoke --out /tmp/h.json  # anywhere: the CPU, padding forced, small shapes

1. **Same numbers**: GPT-3 small's whole model (fp32 and bf16) on a batch of random tokens, loss and every
   gradient with the head unpadded (multiple 1) and padded (64): the largest differences, beside those of the
   unpadded model run twice (what the kernels' own non-determinism gives).
2. **Faster**: the head's GEMM with softmax cross-entropy, forward and backward, in bf16 at GPT-2's vocabulary
   (50257) and the four GPT-3 widths calibrate uses, padded and not: milliseconds and TFLOP/s (6 * tokens *
   width * 50257 FLOPs, the useful ones) for each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.model import gpt  # noqa: E402
from elastic_trainer.model.gpt import GPT, lm_loss_sum  # noqa: E402
from elastic_trainer.model.init import init_weights  # noqa: E402
from elastic_trainer.parallel.calibrate import GPU_HEAD_SHAPES, _sync, timed  # noqa: E402

WIDTHS = [d for d, _ in GPU_HEAD_SHAPES]


def loss_and_grads(model: GPT, tokens: torch.Tensor, multiple: int) -> tuple[float, dict]:
    saved = dict(gpt.VOCAB_PAD_MULTIPLE)
    gpt.VOCAB_PAD_MULTIPLE[tokens.device.type] = multiple
    try:
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        gpt.VOCAB_PAD_MULTIPLE.clear()
        gpt.VOCAB_PAD_MULTIPLE.update(saved)


def parity(model_name: str, device: torch.device, dtype: torch.dtype, batch: int, seq: int, force: int) -> dict:
    torch.manual_seed(0)
    model = GPT(load_model_config(model_name))
    init_weights(model, seed=0)
    model.to(device=device, dtype=dtype)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device)
    a_loss, a = loss_and_grads(model, tokens, 1)  # unpadded, twice: the kernels' own spread
    b_loss, b = loss_and_grads(model, tokens, 1)
    c_loss, c = loss_and_grads(model, tokens, force)

    def worst(x, y):
        return max(((x[n] - y[n]).abs().max() / y[n].abs().max().clamp_min(1e-30)).item() for n in x)

    return dict(
        model=model_name,
        dtype=str(dtype).removeprefix("torch."),
        multiple=force,
        loss_unpadded=a_loss,
        loss_padded=c_loss,
        loss_rerun=b_loss,
        grad_rel_diff_padded=worst(c, a),
        grad_rel_diff_rerun=worst(b, a),
        tok_emb_grad_rel_diff=worst({"w": c["tok_emb.weight"]}, {"w": a["tok_emb.weight"]}),
    )


def head_times(device: torch.device, tokens: int, vocab: int, widths: list[int], repeat: int) -> list[dict]:
    rows = []
    for d in widths:
        x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, d, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
        target = torch.randint(0, vocab, (tokens,), device=device)
        row = dict(width=d, tokens=tokens, vocab=vocab)
        for multiple in (1, 64):

            def step():
                F.cross_entropy(gpt.project_to_vocab(x, w, multiple).float(), target).backward()

            step()
            s = timed(step, repeat, _sync(device))
            row[f"ms_{multiple}"] = round(s * 1e3, 4)
            row[f"tflops_{multiple}"] = round(6.0 * tokens * d * vocab / s / 1e12, 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the CPU, gpt-tiny, small shapes: checks the script")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    out = dict(
        device=torch.cuda.get_device_name(0) if gpu else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        parity=[],
        head=[],
    )
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        for dtype in (torch.float32, torch.bfloat16):
            out["parity"].append(parity("gpt3-small", device, dtype, 4, 512, 64))
            print("[head_pad] parity", out["parity"][-1], flush=True)
        for tokens in (4096, 16384):
            out["head"] += head_times(device, tokens, 50257, WIDTHS, 5)
    else:
        out["parity"].append(parity("gpt-tiny", device, torch.float64, 2, 16, 64))
        out["head"] += head_times(device, 64, 1000, [64], 1)
    for row in out["head"]:
        print(
            f"[head_pad] width {row['width']:5d} tokens {row['tokens']:6d}: {row['ms_1']:8.3f} ms "
            f"({row['tflops_1']:7.1f} TFLOP/s) unpadded, {row['ms_64']:8.3f} ms ({row['tflops_64']:7.1f}) padded",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
