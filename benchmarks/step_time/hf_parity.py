"""Largest logit difference between our GPT and HF GPT2LMHeadModel on the same weights (fp32, CPU).

python benchmarks/step_time/hf_parity.py [--model gpt-tiny]
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from elastic_trainer.config import load_model_config
from elastic_trainer.model import GPT, materialize
from elastic_trainer.model.hf import config_to_hf, state_dict_to_hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    cfg = load_model_config(args.model)
    with torch.device("meta"):
        model = GPT(cfg)
    materialize(model, "cpu", seed=0).eval()
    hf = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"}))
    hf.load_state_dict(state_dict_to_hf(model.state_dict(), cfg), strict=False)
    hf.tie_weights()
    hf.eval()
    x = torch.randint(0, cfg.vocab_size, (2, args.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{cfg.name}: max |logit difference| = {diff:.2e} (logits up to {theirs.abs().max().item():.2f})")


if __name__ == "__main__":
    main()
