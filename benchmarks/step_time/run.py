"""Step time of our (1,1,1) training step against Hugging Face GPT2LMHeadModel, measured in the same run.

Both sides train the same architecture from the same weights on the same batches with the same AdamW
settings and gradient clipping. Ours is the real `Trainer.train_step` (data sampling, engine,
global-norm clipping, optimizer); the peer is the plain loop a user would write around HF's model.
Steps alternate between the two sides so drifts of the machine hit both alike; the medians are compared.

    python benchmarks/step_time/run.py                          # gpt3-small, batch 4 x 128, CPU
    python benchmarks/step_time/run.py --model gpt-tiny --steps 20

Prints a table and `ratio ours/hf` (target <= 1.0: ours is no slower); --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small", help="model preset (default gpt3-small)")
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    p.add_argument("--json", help="write the results to this file")
    return p.parse_args(argv)


def build_ours(model_cfg, train_cfg, tokens):
    import torch.distributed as dist

    from elastic_trainer.parallel import build_mesh, default_device, init_process_group
    from elastic_trainer.plan.layout import Layout
    from elastic_trainer.train import Trainer

    device = default_device()
    init_process_group(device, distributed=False)  # one process: a group of one
    layout = Layout(1, 1, 1, train_cfg.global_batch, 1)
    trainer = Trainer(model_cfg, train_cfg, layout, build_mesh(layout, device.type), device, tokens=tokens)
    assert dist.get_world_size() == 1
    return trainer


def build_hf(model_cfg, train_cfg, our_state):
    from transformers import GPT2Config, GPT2LMHeadModel

    from elastic_trainer.model.hf import config_to_hf, state_dict_to_hf

    hf_cfg = GPT2Config(**{k: v for k, v in config_to_hf(model_cfg).items() if k != "architectures"})
    hf_cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf_cfg)
    model.load_state_dict(state_dict_to_hf(our_state, model_cfg), strict=False)
    model.tie_weights()
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg.lr,
        betas=(train_cfg.beta1, train_cfg.beta2),
        eps=train_cfg.eps,
    )
    return model, opt


def hf_step(model, opt, batch, grad_clip):
    opt.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return float(loss.detach())


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from elastic_trainer.config import TrainConfig, load_model_config
    from elastic_trainer.data import load_tokens

    model_cfg = load_model_config(args.model)
    total = args.warmup + args.steps
    train_cfg = TrainConfig(
        global_batch=args.batch,
        seq_len=args.seq_len,
        steps=total,
        seed=0,
        warmup_steps=0,
        lr=3e-4,
        min_lr_ratio=1.0,
        dtype="fp32",
    )
    tokens = load_tokens(train_cfg.data)
    ours = build_ours(model_cfg, train_cfg, tokens)
    state = {k: v.detach().cpu() for k, v in ours.engine.model.state_dict().items()}
    hf, hf_opt = build_hf(model_cfg, train_cfg, state)
    print(
        f"[bench] {model_cfg.name} ({model_cfg.num_params() / 1e6:.1f} M params), batch {args.batch} x "
        f"{args.seq_len}, fp32, {torch.get_num_threads()} threads, {args.warmup} warm-up + {args.steps} steps",
        flush=True,
    )

    times = {"ours": [], "hf": []}
    losses = {"ours": [], "hf": []}
    for step in range(total):
        # the same global samples for both sides
        _, batch = ours.samples.batch(range(step * args.batch, (step + 1) * args.batch))
        run = {"ours": lambda: ours.train_step()["loss"], "hf": lambda: hf_step(hf, hf_opt, batch, train_cfg.grad_clip)}
        took = {}
        for side in ("ours", "hf") if step % 2 == 0 else ("hf", "ours"):  # alternate who goes first
            t0 = time.perf_counter()
            losses[side].append(run[side]())
            took[side] = time.perf_counter() - t0
            if step >= args.warmup:
                times[side].append(took[side])
        print(
            f"  step {step + 1}/{total}: ours {took['ours']:.3f} s (loss {losses['ours'][-1]:.4f}), "
            f"hf {took['hf']:.3f} s (loss {losses['hf'][-1]:.4f})",
            flush=True,
        )

    tokens_per_step = args.batch * args.seq_len
    result = {
        "model": model_cfg.name,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "torch": torch.__version__,
    }
    for side in ("ours", "hf"):
        med = statistics.median(times[side])
        result[side] = {
            "median_step_s": med,
            "tokens_per_s": tokens_per_step / med,
            "step_s": times[side],
            "losses": losses[side],
        }
    result["ratio"] = result["ours"]["median_step_s"] / result["hf"]["median_step_s"]
    result["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["hf"]))

    print(f"\n{'side':<6} {'median s/step':>14} {'tokens/s':>10}")
    for side in ("ours", "hf"):
        print(f"{side:<6} {result[side]['median_step_s']:>14.4f} {result[side]['tokens_per_s']:>10.1f}")
    print(
        f"ratio ours/hf = {result['ratio']:.3f} (target <= 1.0); "
        f"max loss relative difference {result['max_loss_rel_diff']:.2e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
