"""`checkpoint import-deepspeed` on checkpoints DeepSpeed itself wrote, and the run continued on its trajectory.

DeepSpeed trains a tiny GPT on 2 forked ranks -- Hugging Face's GPT2LMHeadModel under ZeRO-1, our GPT under
ZeRO-3, and our GPT as a 2-stage PipelineModule (ZeRO-1) -- with torch's AdamW (weight decay on matrices and
embeddings), clipping, the learning rate of our schedule (a LambdaLR) and the samples our trainer would read
at each step. It saves after step SAVE_AT and trains on. Each checkpoint is imported; the weights and Adam
moments equal DeepSpeed's own consolidation (zero_to_fp32, ds_to_universal, the pipeline's layer files),
and our trainer resumed from the import in two layouts reproduces DeepSpeed's next losses within 1e-5.

Skips, printing the install command, where DeepSpeed is not installed (scripts/test.sh installs it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint import CheckpointConfig
from elastic_trainer.config import ModelConfig, TrainConfig
from elastic_trainer.data.order import TokenSamples, samples_for
from elastic_trainer.interop.deepspeed import import_deepspeed, pipeline_param_name, read_deepspeed
from elastic_trainer.model.hf import config_to_hf, state_dict_from_hf, state_dict_to_hf
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.train import run_job
from elastic_trainer.train.optim import lr_at
from tests.unit.test_deepspeed_reader import our_state

INSTALL = "pip install --no-build-isolation deepspeed==0.19.8   (or ./scripts/test.sh, which installs it)"
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip(f"DeepSpeed is not installed: {INSTALL}", allow_module_level=True)
transformers = pytest.importorskip("transformers")

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=128, context_length=16)
CFG = TrainConfig(
    global_batch=8,
    seq_len=16,
    steps=6,
    seed=5,
    lr=3e-3,
    warmup_steps=2,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    grad_clip=1.0,
)
SAVE_AT = 3  # DeepSpeed saves after 3 steps and trains 3 more
TOKENS = np.random.default_rng(0).integers(0, MODEL.vocab_size, 40 * (CFG.seq_len + 1)).astype(np.int64)
TIMEOUT = 600


def initial_weights() -> dict[str, torch.Tensor]:
    """Our trainer's initialization for CFG.seed (the same in every layout)."""
    from elastic_trainer.model.gpt import GPT
    from elastic_trainer.model.init import materialize

    with torch.device("meta"):
        model = GPT(MODEL)
    return {k: v.detach().clone() for k, v in materialize(model, "cpu", CFG.seed).state_dict().items()}


def _groups(params):
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": CFG.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def deepspeed_run(rank: int, world: int, kind: str, out: str) -> list[float]:
    """Train with DeepSpeed for CFG.steps, saving after SAVE_AT; the global mean loss of every step."""
    import deepspeed
    import torch.distributed as dist

    from elastic_trainer.interop.deepspeed import pipeline_gpt
    from elastic_trainer.model.gpt import GPT

    warnings.simplefilter("ignore")
    deepspeed.init_distributed(dist_backend="gloo")
    initial = initial_weights()
    pipeline = kind == "pipeline"
    if kind == "hf-zero1":
        hf_cfg = transformers.GPT2Config(**{k: v for k, v in config_to_hf(MODEL).items() if k != "architectures"})
        model = transformers.GPT2LMHeadModel(hf_cfg)
        model.load_state_dict(state_dict_to_hf(initial, MODEL), strict=False)
        model.tie_weights()
    elif kind == "zero3":
        model = GPT(MODEL)
        model.load_state_dict(initial)
    else:
        gpt = GPT(MODEL)
        gpt.load_state_dict(initial)
        model = pipeline_gpt.pipeline_module(MODEL, world, partition_method="uniform")
        pipeline_gpt.copy_weights_into_pipeline(gpt, model)
    optimizer = torch.optim.AdamW(_groups(model.parameters()), lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, CFG) / CFG.lr)
    dp = 1 if pipeline else world
    micro = 2
    config = {
        "train_batch_size": CFG.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": CFG.global_batch // (dp * micro),
        "zero_optimization": {"stage": 3 if kind == "zero3" else 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": CFG.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    samples = TokenSamples(TOKENS, CFG.seq_len, CFG.seed)
    losses = []
    for step in range(CFG.steps):
        if step == SAVE_AT:
            engine.save_checkpoint(out, tag=f"global_step{step}")
        batch = samples.batch(samples_for(step, CFG.global_batch, 0 if pipeline else rank, dp))[1]
        micro_batches = [(b[:, :-1], b[:, 1:]) for b in batch.split(micro)]
        if pipeline:
            losses.append(float(engine.train_batch(iter(micro_batches))))
            continue
        total = torch.zeros(())
        for x, y in micro_batches:
            logits = engine(x).logits if kind == "hf-zero1" else engine(x)
            loss = pipeline_gpt.lm_loss(logits, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(micro_batches)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def resumed_losses(rank: int, world: int, layout: Layout, imported: str, run_dir: str) -> list[float]:
    result = run_job(
        MODEL,
        CFG,
        layout,
        torch.device("cpu"),
        tokens=TOKENS,
        ckpt=CheckpointConfig(dir=run_dir, resume=imported, verify=True),
    )
    assert result.load is not None and result.load.step == SAVE_AT and result.records[0]["step"] == SAVE_AT + 1
    return [r["loss"] for r in result.records]


def universal_agrees(root: str, tmp_path, ours: tuple[dict, dict, dict], to_ours) -> None:
    """DeepSpeed's own consolidation of the moments (ds_to_universal) equals the import exactly, and the
    universal form imports to the same state."""
    universal = str(tmp_path / "universal")
    ds_universal(os.path.join(root, f"global_step{SAVE_AT}"), universal)
    names = {to_ours(n): n for n in os.listdir(os.path.join(universal, "zero")) if n != "optimizer_state.pt"}
    names.pop(None, None)
    for what, mine in zip(("exp_avg", "exp_avg_sq"), ours[1:]):
        theirs = {n: universal_tensor(universal, d, what).reshape(mine[n].shape) for n, d in names.items()}
        assert set(theirs) == set(mine)
        _assert_close(mine, theirs, what)
    again = import_deepspeed(universal, tmp_path / "from-universal", MODEL, CFG, tokens=TOKENS, log=lambda *a: None)
    for a, b in zip(our_state(again, MODEL)[:3], ours):
        _assert_close(a, b, "universal import")


def continues_on_trajectory(folder, layouts: list[Layout], losses: list[float], tmp_path) -> None:
    """Our trainer resumed from the import in each layout: DeepSpeed's losses after the save, within 1e-5."""
    for i, layout in enumerate(layouts):
        got = run_ranks(
            resumed_losses, layout.world_size, layout, str(folder), str(tmp_path / f"run{i}"), timeout=TIMEOUT
        )[0]
        assert got == pytest.approx(losses[SAVE_AT:], rel=1e-5), (layout.describe(), got, losses)


def ds_universal(src: str, dst: str) -> None:
    """DeepSpeed's own converter, in a subprocess: its per-parameter fp32 weights and moments."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        src,
        "--output_folder",
        dst,
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def universal_tensor(folder: str, name: str, what: str) -> torch.Tensor:
    item = torch.load(os.path.join(folder, "zero", name, f"{what}.pt"), weights_only=True)
    return item["param"] if isinstance(item, dict) else item


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """kind -> (DeepSpeed's losses, its checkpoint root)."""
    import deepspeed  # noqa: F401  (imported once here: the forked ranks inherit it, ~8 s each otherwise)

    out = {}
    for kind in ("hf-zero1", "zero3", "pipeline"):
        root = str(tmp_path_factory.mktemp(kind))
        losses = run_ranks(deepspeed_run, 2, kind, root, timeout=TIMEOUT)
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # every rank reports the global mean
        out[kind] = (losses[0], root)
    return out


def _assert_close(ours: dict, theirs: dict, what: str, rel: float = 0.0) -> None:
    for name, t in theirs.items():
        err = (ours[name] - t).abs().max().item()
        assert err <= rel * t.abs().max().item(), f"{what} {name}: max abs error {err}"


def test_zero1_of_hugging_face_gpt2_imports_and_continues_on_deepspeed_s_trajectory(runs, tmp_path):
    losses, root = runs["hf-zero1"]
    state = read_deepspeed(root)
    assert state.form == "ZeRO-1" and state.global_steps == SAVE_AT and state.dp_world_size == 2
    folder = import_deepspeed(root, tmp_path / "imported", MODEL, CFG, tokens=TOKENS, log=lambda *a: None)
    weights, avg, sq = our_state(folder, MODEL)[:3]
    # weights: DeepSpeed's own zero_to_fp32 (HF names)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds_weights = get_fp32_state_dict_from_zero_checkpoint(root)
    _assert_close(weights, state_dict_from_hf(ds_weights, MODEL), "weight")
    # moments: DeepSpeed's universal form (ds_to_universal), converted to our names by model.hf's rules
    universal = str(tmp_path / "universal")
    ds_universal(os.path.join(root, f"global_step{SAVE_AT}"), universal)
    names = list(state_dict_to_hf(weights, MODEL))
    for what, ours in (("exp_avg", avg), ("exp_avg_sq", sq)):
        theirs = state_dict_from_hf({n: universal_tensor(universal, n, what) for n in names}, MODEL)
        _assert_close(ours, theirs, what)
        assert any(t.abs().max() > 0 for t in theirs.values())
    # the universal form imports to the same state
    again = import_deepspeed(universal, tmp_path / "from-universal", MODEL, CFG, tokens=TOKENS, log=lambda *a: None)
    for a, b in zip(our_state(again, MODEL)[:3], (weights, avg, sq)):
        _assert_close(a, b, "universal import")
    # the next steps in two layouts (the second our own ZeRO-1): DeepSpeed's losses
    continues_on_trajectory(folder, [Layout(1, 1, 1, 8, 1), Layout(2, 1, 1, 2, 2, dp_mode="zero1")], losses, tmp_path)


def test_zero3_of_our_gpt_imports_and_continues_on_deepspeed_s_trajectory(runs, tmp_path):
    losses, root = runs["zero3"]
    state = read_deepspeed(root)
    assert state.form == "ZeRO-3" and state.global_steps == SAVE_AT
    folder = import_deepspeed(root, tmp_path / "imported", MODEL, CFG, tokens=TOKENS, log=lambda *a: None)
    weights, avg, sq = our_state(folder, MODEL)[:3]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds_weights = get_fp32_state_dict_from_zero_checkpoint(root)
    _assert_close(weights, ds_weights, "weight")
    universal_agrees(root, tmp_path, (weights, avg, sq), lambda name: name)
    continues_on_trajectory(folder, [Layout(1, 1, 1, 8, 1), Layout(1, 2, 1, 8, 1)], losses, tmp_path)


def test_pipeline_checkpoint_imports_and_continues_on_deepspeed_s_trajectory(runs, tmp_path):
    losses, root = runs["pipeline"]
    state = read_deepspeed(root)
    assert state.form.startswith("pipeline (2 stages") and state.global_steps == SAVE_AT and state.pipeline
    folder = import_deepspeed(root, tmp_path / "imported", MODEL, CFG, tokens=TOKENS, log=lambda *a: None)
    weights, avg, sq = our_state(folder, MODEL)[:3]
    # weights: the layer files DeepSpeed wrote from its fp32 module
    tag = os.path.join(root, f"global_step{SAVE_AT}")
    layers = {
        i: torch.load(os.path.join(tag, f"layer_{i:02d}-model_states.pt"), weights_only=True)
        for i in range(MODEL.n_layers + 3)
    }
    expected = {**layers[0], **layers[1], **layers[MODEL.n_layers + 2]}
    for i in range(MODEL.n_layers):
        expected.update({f"layers.{i}.{k}": v for k, v in layers[i + 2].items()})
    _assert_close(weights, expected, "weight")
    universal_agrees(root, tmp_path, (weights, avg, sq), lambda name: pipeline_param_name(name, MODEL.n_layers))
    continues_on_trajectory(folder, [Layout(1, 1, 2, 2, 4), Layout(2, 1, 1, 4, 1)], losses, tmp_path)


def test_losses_before_the_save_match_between_the_three_deepspeed_runs(runs):
    """The three DeepSpeed set-ups train the same model on the same data: a check of the test's own set-up."""
    ref = runs["hf-zero1"][0]
    for kind in ("zero3", "pipeline"):
        assert runs[kind][0] == pytest.approx(ref, rel=1e-5), kind
    assert abs(ref[0] - np.log(MODEL.vocab_size)) < 0.1
