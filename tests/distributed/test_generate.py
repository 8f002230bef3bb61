"""`elastic-trainer generate` (model/generate.py): a checkpoint saved by 4 forked ranks at dp2 x tp2, read into
one process; greedy generation with the key/value cache equals Hugging Face's `GPT2LMHeadModel.generate`
(greedy) on the same weights exported with `checkpoint export-hf`, token for token for 50 new tokens, and our
own model's full forward without a cache; sampling is reproducible with a seed; bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig
from elastic_trainer.config import ConfigError, TrainConfig, load_model_config
from elastic_trainer.data import tokenizer
from elastic_trainer.data.corpus import load
from elastic_trainer.model.generate import from_checkpoint, generate
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import Job

MODEL = load_model_config("gpt-tiny")
PROMPT = "The State of the Union is"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_cache):
    folder = tmp_path_factory.mktemp("generate") / "ckpt"
    tokens = load(TrainConfig(data_cache=data_cache), quiet=True).train

    def train(rank, world):
        cfg = TrainConfig(global_batch=8, seq_len=64, steps=2, seed=0, lr=1e-4, warmup_steps=1)
        with Job(
            MODEL,
            cfg,
            Layout(2, 2, 1, 4, 1),
            torch.device("cpu"),
            tokens=tokens,
            ckpt=CheckpointConfig(dir=str(folder)),
        ) as job:
            # A GPT this young, its embeddings tied, predicts its input token again and again; blocks made
            # loud turn the residual stream away from it, so that greedy tokens vary with the context.
            with torch.no_grad():
                for name, p in job.trainer.engine.model.named_parameters():
                    if name.endswith(("o_proj.weight", "mlp.proj.weight")):
                        p.mul_(40)
            job.fit()

    run_ranks(train, 4)
    return folder


def test_greedy_equals_hugging_face_and_the_uncached_model(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    from elastic_trainer.checkpoint.offline import export_hf

    model, folder = from_checkpoint(str(checkpoint))
    prompt = tokenizer.encode(PROMPT)
    ours = generate(model, prompt, 50, temperature=0)
    hf = transformers.GPT2LMHeadModel.from_pretrained(export_hf(checkpoint, tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=50,
            do_sample=False,
            pad_token_id=50256,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :]
    assert ours == theirs.tolist()
    ids = list(prompt)
    with torch.no_grad():  # no cache: the whole sequence again for every token
        for _ in range(50):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert ours == ids[len(prompt) :]
    assert len(set(ours)) > 3  # not one token repeated: the comparison means something


def test_sampling_is_reproducible_with_a_seed(checkpoint):
    model, _ = from_checkpoint(str(checkpoint))
    prompt = tokenizer.encode(PROMPT)
    a = generate(model, prompt, 30, temperature=1.0, top_k=40, seed=1)
    assert a == generate(model, prompt, 30, temperature=1.0, top_k=40, seed=1)
    assert a != generate(model, prompt, 30, temperature=1.0, top_k=40, seed=2)
    # top-k 1 is greedy whatever the temperature
    assert generate(model, prompt, 20, temperature=2.0, top_k=1, seed=3) == generate(model, prompt, 20, 0)
    with pytest.raises(ConfigError, match="exceed the model's context of 256"):
        generate(model, prompt, 256, temperature=0)


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "generate", *argv], capture_output=True, text=True, timeout=300
    )


def test_the_command_prints_the_text_and_refuses_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    from elastic_trainer import cli as command

    model, _ = from_checkpoint(str(checkpoint))
    greedy = tokenizer.decode(generate(model, tokenizer.encode(PROMPT), 12, temperature=0))
    run = cli(str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0")
    assert run.returncode == 0 and run.stdout == PROMPT + greedy + "\n", run.stderr[-2000:]
    for argv, message in [  # in this process: the same main() the command runs
        ((str(tmp_path / "none"), "--prompt", "x"), "does not exist"),
        ((str(checkpoint), "--prompt", "word " * 300), "exceed the model's context of 256 tokens"),
        ((str(checkpoint), "--prompt", "x", "--top-k", "0"), "--top-k 0 must be >= 1"),
        ((str(checkpoint), "--prompt", ""), "--prompt is empty"),
    ]:
        capsys.readouterr()
        assert command.main(["generate", *argv]) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err and "Traceback" not in err, (argv, err)
