"""Reading DeepSpeed checkpoints without DeepSpeed: files written here in DeepSpeed's formats (ZeRO-1/2 flat
partitions with fragment addresses, ZeRO-3's padded per-parameter pieces, the universal form, Hugging Face
names), every refusal in one line, and pickled payloads refused without running.

The formats are checked against checkpoints DeepSpeed itself wrote in tests/distributed/test_deepspeed_import.py;
here the writer is a hand computation of the same layout, with uneven splits and padding DeepSpeed's small runs
do not reach, and it runs where DeepSpeed is not installed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_trainer.config import CheckpointError, ConfigError, ModelConfig, TrainConfig
from elastic_trainer.elastic.exit_codes import EXIT_BAD_INPUT
from elastic_trainer.interop import deepspeed as ds
from elastic_trainer.interop.deepspeed import safe as ds_safe
from elastic_trainer.model.hf import state_dict_to_hf
from tests.unit.test_checkpoint_storage import NOT_LIVE, PAYLOADS, as_item, assert_nothing_ran, plant  # noqa: F401

MODEL = ModelConfig(n_layers=2, d_model=9, n_heads=3, vocab_size=11, context_length=6)  # odd sizes: uneven splits
CFG = TrainConfig(global_batch=6, seq_len=5, grad_clip=1.0, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


# -- DeepSpeed's records under their own names, without DeepSpeed -------------------------------------------


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's name
    numel: int
    start: int


class LossScaler:
    def __init__(self):
        self.cur_scale, self.dynamic = 1.0, False


FAKES = {
    "deepspeed.runtime.zero.config": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler": LossScaler,
    "deepspeed.utils.tensor_fragment": fragment_address,
}


@contextmanager
def deepspeed_names():
    """Make pickle write these classes under DeepSpeed's module paths (as DeepSpeed's own files name them)."""
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    for k in saved:
        del sys.modules[k]
    old = {cls: (cls.__module__, cls.__qualname__) for cls in FAKES.values()}
    try:
        for path, cls in FAKES.items():
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            setattr(sys.modules[path], cls.__name__, cls)
            cls.__module__ = path
        yield
    finally:
        for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        for cls, (module, qualname) in old.items():
            cls.__module__, cls.__qualname__ = module, qualname


def gpt_state(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (weight, exp_avg, exp_avg_sq), random, in our GPT's parameter order."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=g), torch.randn(s, generator=g), torch.rand(s, generator=g))
        for n, s in ds.gpt_shapes(MODEL).items()
    }


def groups_of(state: dict) -> list[list[str]]:
    """Our optimizer's groups: decayed matrices and embeddings, then the rest."""
    names = list(state)
    return [[n for n in names if state[n][0].ndim >= 2], [n for n in names if state[n][0].ndim < 2]]


def model_states(groups: list[dict[str, torch.Size]], **extra) -> dict:
    return {
        "module": None,
        "param_shapes": groups,
        "frozen_param_shapes": None,
        "global_steps": 4,
        "global_samples": 4 * CFG.global_batch,
        "skipped_steps": 0,
        "dp_world_size": extra.pop("dp", 1),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {"train_batch_size": CFG.global_batch, "gradient_clipping": CFG.grad_clip},
        "ds_version": "0.19.8",
        **extra,
    }


def param_groups(n: int) -> list[dict]:
    return [
        {
            "lr": 1e-4,
            "betas": (CFG.beta1, CFG.beta2),
            "eps": CFG.eps,
            "weight_decay": CFG.weight_decay if g == 0 else 0.0,
            "params": [g],
        }
        for g in range(n)
    ]


def write_zero12(folder: Path, state: dict, world: int) -> None:
    """ZeRO-1/2: per group, the parameters flattened in order, padded to a multiple of `world`, split into
    equal partitions; each rank maps the parameters (or pieces) it holds to (numel, start in its partition)."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = groups_of(state)
    shapes = [{n: state[n][0].shape for n in g} for g in groups]
    ranks = [
        {
            "single_partition_of_fp32_groups": [],
            "param_slice_mappings": [],
            "base_optimizer_state": {"state": {}, "param_groups": param_groups(len(groups))},
            "zero_stage": ZeroStageEnum.optimizer_states,
            "loss_scaler": LossScaler(),
            "partition_count": [world] * len(groups),
            "group_paddings": [],
        }
        for _ in range(world)
    ]
    for gi, names in enumerate(groups):
        flats = [torch.cat([state[n][i].reshape(-1) for n in names]) for i in range(3)]
        size = math.ceil(flats[0].numel() / world)
        flats = [torch.cat([f, torch.zeros(size * world - f.numel())]) for f in flats]
        offsets = np.cumsum([0] + [state[n][0].numel() for n in names])
        for r, osd in enumerate(ranks):
            lo, hi = r * size, (r + 1) * size
            mapping = {}
            for n, a, b in zip(names, offsets[:-1], offsets[1:]):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    mapping[n] = fragment_address(numel=int(e - s), start=int(s - lo))
            osd["single_partition_of_fp32_groups"].append(flats[0][lo:hi].clone())
            osd["param_slice_mappings"].append(mapping)
            osd["base_optimizer_state"]["state"][gi] = {
                "step": torch.tensor(4.0),
                "exp_avg": flats[1][lo:hi].clone(),
                "exp_avg_sq": flats[2][lo:hi].clone(),
            }
            osd["group_paddings"].append(size * world - int(offsets[-1]) if r == world - 1 else 0)
    with deepspeed_names():
        torch.save(model_states(shapes, dp=world), folder / "mp_rank_00_model_states.pt")
        for r, osd in enumerate(ranks):
            torch.save(
                {"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            )


def write_zero3(folder: Path, state: dict, world: int) -> None:
    """ZeRO-3: each parameter split into `world` pieces of ceil(numel / world), the last padded; a rank's flat
    group is its pieces in order."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = groups_of(state)
    shapes = [{n: state[n][0].shape for n in g} for g in groups]
    per_rank = [
        {
            "fp32_flat_groups": [],
            "optimizer_state_dict": {"state": {}, "param_groups": param_groups(2)},
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(),
            "partition_count": world,
        }
        for _ in range(world)
    ]
    for gi, names in enumerate(groups):
        for r in range(world):
            pieces = [[], [], []]
            for n in names:
                numel = state[n][0].numel()
                size = math.ceil(numel / world)
                for i in range(3):
                    t = torch.cat([state[n][i].reshape(-1), torch.zeros(size * world - numel)])
                    pieces[i].append(t[r * size : (r + 1) * size])
            weights, avg, sq = (torch.cat(p) for p in pieces)
            per_rank[r]["fp32_flat_groups"].append(weights)
            per_rank[r]["optimizer_state_dict"]["state"][gi] = {
                "step": torch.tensor(4.0),
                "exp_avg": avg,
                "exp_avg_sq": sq,
            }
    with deepspeed_names():
        for r in range(world):
            torch.save(model_states(shapes, dp=world), folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
            torch.save({"optimizer_state_dict": per_rank[r]}, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def write_universal(folder: Path, state: dict) -> None:
    groups = groups_of(state)
    (folder / "zero").mkdir(parents=True, exist_ok=True)
    shapes = [{n: state[n][0].shape for n in g} for g in groups]
    torch.save(model_states(shapes), folder / "mp_rank_00_model_states.pt")
    with deepspeed_names():
        torch.save(
            {"param_groups": param_groups(2), "zero_stage": ZeroStageEnum.optimizer_states},
            folder / "zero" / "optimizer_state.pt",
        )
    for n, tensors in state.items():
        d = folder / "zero" / n
        d.mkdir()
        for what, t in zip(("fp32", "exp_avg", "exp_avg_sq"), tensors):
            torch.save({"param": t, "cat_dim": 0}, d / f"{what}.pt")
        torch.save(torch.tensor(4.0), d / "step.pt")


def our_state(folder, model: ModelConfig) -> tuple[dict, dict, dict, dict]:
    """(weights, exp_avg, exp_avg_sq, Adam step) of one of our checkpoints by our names, read in this process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint import storage

    shapes = ds.gpt_shapes(model)
    moments = {f"state.{n}.{m}": torch.empty(s) for n, s in shapes.items() for m in ("exp_avg", "exp_avg_sq")}
    steps = {f"state.{n}.step": torch.empty(()) for n in shapes}
    state = {"model": {n: torch.empty(s) for n, s in shapes.items()}, "optim": {**moments, **steps}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=storage.SafeReader(str(folder)), no_dist=True)
    optim = state["optim"]
    return (
        state["model"],
        {n: optim[f"state.{n}.exp_avg"] for n in shapes},
        {n: optim[f"state.{n}.exp_avg_sq"] for n in shapes},
        {n: float(optim[f"state.{n}.step"]) for n in shapes},
    )


def assert_state(got: dict[str, ds.ParamState], state: dict) -> None:
    assert set(got) == set(state)
    for n, (w, a, s) in state.items():
        assert torch.equal(got[n].weight, w) and torch.equal(got[n].exp_avg, a) and torch.equal(got[n].exp_avg_sq, s), n
        assert got[n].step == 4.0
        assert got[n].hyper["weight_decay"] == (CFG.weight_decay if w.ndim >= 2 else 0.0)


# -- the formats ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_zero12_partitions_are_reassembled_from_their_fragments(tmp_path, world):
    state = gpt_state(world)
    write_zero12(tmp_path / "global_step4", state, world)
    (tmp_path / "latest").write_text("global_step4")
    got = ds.read_deepspeed(tmp_path)  # the root: its 'latest' names the tag
    assert (got.form, got.global_steps, got.global_samples, got.dp_world_size) == ("ZeRO-1", 4, 24, world)
    assert_state(ds.to_gpt(got, MODEL), state)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_zero3_pieces_are_reassembled_without_their_padding(tmp_path, world):
    state = gpt_state(10 + world)
    write_zero3(tmp_path, state, world)
    got = ds.read_deepspeed(tmp_path)
    assert (got.form, got.dp_world_size) == ("ZeRO-3", world)
    assert_state(ds.to_gpt(got, MODEL), state)


def test_universal_form_with_hugging_face_names_is_converted_to_ours(tmp_path):
    """GPT2LMHeadModel's names and layouts (Conv1D weights transposed, q/k/v columns as HF orders them): the
    weights and both moments come back as ours, the inverse of model.hf's export."""
    state = gpt_state(3)
    hf_names = {}
    for i in range(3):  # weight, exp_avg, exp_avg_sq
        hf = state_dict_to_hf({n: t[i] for n, t in state.items()}, MODEL)
        for theirs, t in hf.items():
            hf_names.setdefault(theirs, [None] * 3)[i] = t
    (tmp_path / "zero").mkdir()
    shapes = [
        {n: t[0].shape for n, t in hf_names.items() if t[0].ndim >= 2},
        {n: t[0].shape for n, t in hf_names.items() if t[0].ndim < 2},
    ]
    torch.save(model_states(shapes), tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"param_groups": param_groups(2)}, tmp_path / "zero" / "optimizer_state.pt")
    for n, tensors in hf_names.items():
        (tmp_path / "zero" / n).mkdir()
        for what, t in zip(("fp32", "exp_avg", "exp_avg_sq"), tensors):
            torch.save({"param": t.clone(), "cat_dim": 0}, tmp_path / "zero" / n / f"{what}.pt")
        torch.save(torch.tensor(4.0), tmp_path / "zero" / n / "step.pt")
    got = ds.read_deepspeed(tmp_path)
    assert got.form == "universal"
    converted = ds.to_gpt(got, MODEL)
    assert set(converted) == set(state)
    for n, (w, a, s) in state.items():
        assert torch.equal(converted[n].weight, w) and torch.equal(converted[n].exp_avg, a), n
        assert torch.equal(converted[n].exp_avg_sq, s), n


def test_pipeline_names_map_to_ours_and_tied_parameters_come_from_the_first_stage():
    from elastic_trainer.interop.deepspeed import pipeline_param_name

    n = MODEL.n_layers
    assert pipeline_param_name("tied_modules.embed.tok_emb.weight", n) == "tok_emb.weight"
    assert pipeline_param_name("1.pos_emb.weight", n) == "pos_emb.weight"
    assert pipeline_param_name("2.ln_1.weight", n) == "layers.0.ln_1.weight"
    assert pipeline_param_name(f"{n + 1}.mlp.fc.bias", n) == f"layers.{n - 1}.mlp.fc.bias"
    assert pipeline_param_name(f"{n + 2}.ln_f.weight", n) == "ln_f.weight"
    for other in (
        "0.tok_emb.weight",
        f"{n + 3}.x",
        "tied_modules.embed.pos_emb.weight",
        "2.ln_f.weight",
        f"{n + 2}.ln_1.weight",
        "1.tok_emb.weight",
    ):
        assert pipeline_param_name(other, n) is None, other
    first, second = gpt_state(1), gpt_state(2)
    state = ds.DeepSpeedState("pipeline", {}, 4, 24, 0, {}, "x", 1, pipeline=True)
    for src in (first, second):  # stage by stage, as the reader adds them: the second stage's tie must not win
        state.params.setdefault("tied_modules.embed.tok_emb.weight", ds.ParamState(*src["tok_emb.weight"], 4.0, {}))
    state.params["1.pos_emb.weight"] = ds.ParamState(*first["pos_emb.weight"], 4.0, {})
    for k in first:
        if k.startswith("layers."):
            i, rest = k.split(".", 2)[1:]
            state.params[f"{int(i) + 2}.{rest}"] = ds.ParamState(*first[k], 4.0, {})
    for k in ("ln_f.weight", "ln_f.bias"):
        state.params[f"{n + 2}.{k}"] = ds.ParamState(*first[k], 4.0, {})
    got = ds.to_gpt(state, MODEL)
    assert set(got) == set(first) and all(torch.equal(got[k].weight, first[k][0]) for k in first)
    state.params["7.ln_f.weight"] = state.params[f"{n + 2}.ln_f.weight"]
    with pytest.raises(ConfigError, match=r"pipeline parameter '7.ln_f.weight' is not a layer"):
        ds.to_gpt(state, MODEL)


# -- refusals -----------------------------------------------------------------------------------------------


def test_wrong_model_is_refused_with_the_layer_count_found(tmp_path):
    write_zero12(tmp_path, gpt_state(), 2)
    state = ds.read_deepspeed(tmp_path)
    deeper = dataclasses.replace(MODEL, n_layers=3)
    with pytest.raises(ConfigError, match=r"lacks 12 parameter\(s\) of a GPT with 3 layers .* it has 2 layers"):
        ds.to_gpt(state, deeper)
    with pytest.raises(
        ConfigError,
        match=r"holds parameters a GPT with 1 layers lacks \(first: 'layers.1.attn.qkv_proj.weight'\); it has 2 layers",
    ):
        ds.to_gpt(state, dataclasses.replace(MODEL, n_layers=1))
    with pytest.raises(ConfigError, match=r"'tok_emb.weight' is \(11, 9\) in the checkpoint but \(12, 9\)"):
        ds.to_gpt(state, dataclasses.replace(MODEL, vocab_size=12))


def test_hugging_face_names_of_another_depth_or_an_untied_head_are_refused():
    def hf_state(model: ModelConfig, extra: dict | None = None) -> ds.DeepSpeedState:
        g = torch.Generator().manual_seed(0)
        ours = {n: torch.randn(s, generator=g) for n, s in ds.gpt_shapes(model).items()}
        hf = {**state_dict_to_hf(ours, model), **(extra or {})}
        params = {n: ds.ParamState(t, t.clone(), t.abs(), 4.0, {}) for n, t in hf.items()}
        return ds.DeepSpeedState("ZeRO-1", params, 4, 24, 0, {}, "x", 1)

    assert set(ds.to_gpt(hf_state(MODEL), MODEL)) == set(ds.gpt_shapes(MODEL))
    deeper = dataclasses.replace(MODEL, n_layers=3)
    with pytest.raises(
        ConfigError,
        match=r"GPT-2 parameters a GPT with 2 layers lacks \(first: 'transformer.h.2.attn"
        r"\.c_attn\.bias'\); it has 3 layers",
    ):
        ds.to_gpt(hf_state(deeper), MODEL)
    with pytest.raises(
        ConfigError,
        match=r"GPT-2 parameters lack 'transformer.h.2.ln_1.weight' for a 3-layer GPT; "
        "it has 2 layers",
    ):
        ds.to_gpt(hf_state(MODEL), deeper)
    head = {"lm_head.weight": torch.zeros(MODEL.vocab_size, MODEL.d_model)}
    with pytest.raises(ConfigError, match="first: 'lm_head.weight'\\); an untied output head is not supported"):
        ds.to_gpt(hf_state(MODEL, head), MODEL)
    with pytest.raises(ConfigError, match="lists no parameters"):
        ds.to_gpt(ds.DeepSpeedState("ZeRO-1", {}, 4, 24, 0, {}, "x", 1), MODEL)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(global_batch=12), r"global batch 12 \(DeepSpeed's train_batch_size: 6; pass --global-batch\)"),
        (dict(grad_clip=0.5), r"grad_clip 0.5 \(DeepSpeed's gradient_clipping: 1.0"),
        (dict(beta2=0.999), r"beta2 0.999 \(DeepSpeed's optimizer: 0.95; set \[train\] beta2"),
        (dict(beta1=0.8), r"beta1 0.8 \(DeepSpeed's optimizer: 0.9"),
        (dict(eps=1e-6), r"eps 1e-06 \(DeepSpeed's optimizer: 1e-08"),
        (dict(weight_decay=0.01), r"weight decay 0.01 on tok_emb.weight \(DeepSpeed's: 0.1"),
    ],
)
def test_settings_that_would_change_the_trajectory_are_refused(tmp_path, change, message):
    write_zero12(tmp_path, gpt_state(), 2)
    state = ds.read_deepspeed(tmp_path)
    params = ds.to_gpt(state, MODEL)
    ds.check_settings(state, params, CFG)  # the checkpoint's own settings pass
    with pytest.raises(ConfigError, match="would change its loss trajectory: " + message):
        ds.check_settings(state, params, dataclasses.replace(CFG, **change))


def test_decay_on_biases_is_refused(tmp_path):
    """A DeepSpeed run that decayed every parameter (one group) is not our optimizer's trajectory."""
    write_zero12(tmp_path, gpt_state(), 2)
    state = ds.read_deepspeed(tmp_path)
    for p in state.params.values():
        p.hyper = {**p.hyper, "weight_decay": CFG.weight_decay}
    with pytest.raises(
        ConfigError,
        match=r"weight decay 0.0 on layers.0.ln_1.weight \(DeepSpeed's: 0.1; "
        "elastic_trainer decays matrices and embeddings",
    ):
        ds.check_settings(state, ds.to_gpt(state, MODEL), CFG)


def _edit(path: Path, fn) -> None:
    with deepspeed_names():
        obj = torch.load(path, weights_only=False)
        fn(obj)
        torch.save(obj, path)


def test_incomplete_or_unsupported_checkpoints_are_refused_in_one_line(tmp_path):
    def check(folder, pattern):
        with pytest.raises(CheckpointError, match=pattern) as e:
            ds.read_deepspeed(folder)
        assert "\n" not in str(e.value)

    a = tmp_path / "a"
    write_zero12(a, gpt_state(), 3)
    (a / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    check(a, r"lacks the optimizer file of data-parallel rank\(s\) \[1\]: incomplete checkpoint")
    b = tmp_path / "b"
    write_zero12(b, gpt_state(), 2)
    for f in b.glob("zero_pp_*"):
        f.unlink()
    check(b, r"holds no DeepSpeed optimizer state \(found: mp_rank_00_model_states.pt\); import needs the Adam moments")
    c = tmp_path / "c"
    write_zero12(c, gpt_state(), 2)
    _edit(c / "mp_rank_00_model_states.pt", lambda m: m["checkpoint_parallel_dimensions"].update(tp_degree=2))
    check(c, r"saved with tensor parallelism 2: import reads DeepSpeed checkpoints of ZeRO and PipelineModule only")
    d = tmp_path / "d"
    write_zero12(d, gpt_state(), 2)
    _edit(
        d / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        lambda o: o["optimizer_state_dict"]["base_optimizer_state"]["state"].clear(),
    )
    check(d, r"holds no Adam state for parameter group 0: import needs Adam or AdamW moments")
    e = tmp_path / "e"
    write_zero3(e, gpt_state(), 2)
    _edit(
        e / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        lambda o: o["optimizer_state_dict"]["fp32_flat_groups"].__setitem__(0, torch.zeros(5)),
    )
    check(e, r"the ZeRO-3 partitions end before parameter 'tok_emb.weight'")
    f = tmp_path / "f"
    write_zero12(f, gpt_state(), 2)
    _edit(
        f / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        lambda o: o["optimizer_state_dict"]["param_slice_mappings"][0].popitem(),
    )
    check(f, r"has \d+ of its \d+ elements in the rank files: incomplete or inconsistent checkpoint")
    h = tmp_path / "h"
    write_zero12(h, gpt_state(), 2)
    _edit(
        h / "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda o: o["optimizer_state_dict"].pop("param_slice_mappings")
    )
    check(h, r"is not a DeepSpeed checkpoint of a form import reads \(KeyError: 'param_slice_mappings'\)")
    g = tmp_path / "g"
    g.mkdir()
    (g / "latest").write_text("global_step9")
    check(g, r"'latest' names 'global_step9', which is not a folder there")
    check(tmp_path / "nothing", r"is not a folder")


# -- pickled payloads ----------------------------------------------------------------------------------------

TARGETS = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "universal/fp32.pt",
    "universal/optimizer_state.pt",
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("key", list(PAYLOADS))
def test_a_pickled_payload_in_any_deepspeed_file_is_refused_and_nothing_runs(tmp_path, plant, key, target):
    """The payloads of test_checkpoint_storage (each shown there to run when unpickled without restriction)
    in place of a model-states, optimizer, universal weight or universal optimizer file."""
    state = gpt_state()
    if target.startswith("universal/"):
        write_universal(tmp_path, state)
        path = (
            tmp_path / "zero" / "tok_emb.weight" / "fp32.pt"
            if target.endswith("fp32.pt")
            else tmp_path / "zero" / "optimizer_state.pt"
        )
    else:
        write_zero12(tmp_path, state, 2)
        path = tmp_path / target
    path.write_bytes(as_item(PAYLOADS[key](plant)))
    with pytest.raises(CheckpointError) as e:
        ds.read_deepspeed(tmp_path)
    message = str(e.value)
    assert message.startswith(f"refusing DeepSpeed checkpoint file {str(path)!r}: ") and "nothing was run" in message
    assert "\n" not in message
    named = key.format(module=plant.module)  # torch names builtins without their module
    assert f"it names {named.removeprefix('builtins.').removeprefix('__builtin__.')}, which is not allowed" in message
    assert_nothing_ran(plant)


def test_the_stand_ins_are_inert_records():
    """DeepSpeed's three records load as data: no DeepSpeed code runs, and nothing else is allowed by them."""
    assert ds_safe._zero_stage(ZeroStageEnum.weights) == 3
    assert {name for _, name in ds.STAND_INS} == {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
    assert all(
        not hasattr(cls, "__reduce__") or cls.__reduce__ is object.__reduce__
        for cls, _ in ds.STAND_INS
        if isinstance(cls, type)
    )


# -- writing ours ---------------------------------------------------------------------------------------------


def test_import_writes_a_checkpoint_of_ours_with_the_weights_moments_step_and_data_position(tmp_path):
    from elastic_trainer.checkpoint import storage

    state = gpt_state(7)
    write_zero3(tmp_path / "ds", state, 3)
    tokens = np.arange(200) % MODEL.vocab_size
    folder = ds.import_deepspeed(tmp_path / "ds", tmp_path / "ours", MODEL, CFG, tokens=tokens, log=lambda *a: None)
    meta = storage.read_meta(folder)
    assert (meta["step"], meta["consumed_samples"], meta["train"]["global_batch"]) == (4, 24, 6)
    storage.verify(folder)
    weights, avg, sq, steps = our_state(folder, MODEL)
    for n, (w, a, s) in state.items():
        assert torch.equal(weights[n], w) and torch.equal(avg[n], a) and torch.equal(sq[n], s), n
    assert set(steps.values()) == {4.0}
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file: give a new or empty folder"):
        ds.import_deepspeed(tmp_path / "ds", tmp_path / "a-file", MODEL, CFG, tokens=tokens, log=lambda *a: None)
    with pytest.raises(
        ConfigError, match=r"already holds checkpoints \(step-00000004, ...\): import into a new"
    ):  # a second import into the same root
        ds.import_deepspeed(tmp_path / "ds", tmp_path / "ours", MODEL, CFG, tokens=tokens, log=lambda *a: None)


def test_the_command_imports_with_deepspeed_s_settings_as_defaults_and_refuses_in_one_line(tmp_path, capsys):
    from elastic_trainer import cli
    from elastic_trainer.checkpoint import storage

    write_zero12(tmp_path / "ds" / "global_step4", gpt_state(4), 2)
    (tmp_path / "ds" / "latest").write_text("global_step4")
    model = tmp_path / "m.toml"
    model.write_text("[model]\nn_layers = 2\nd_model = 9\nn_heads = 3\nvocab_size = 11\ncontext_length = 6\n")
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["--seq-len", "5", "--data", str(text), "--data-cache", str(tmp_path / "cache")]
    argv = ["checkpoint", "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "ours"), "--model", str(model)]
    assert cli.main([*argv, *common]) == 0
    out = capsys.readouterr().out
    assert "[import] ZeRO-1 checkpoint of DeepSpeed 0.19.8 (dp 2), step 4" in out
    assert f"--checkpoint-dir {tmp_path / 'ours'} --global-batch 6 --grad-clip 1.0 --weight-decay 0.1" in out
    meta = storage.read_meta(storage.complete_checkpoints(tmp_path / "ours")[0])
    assert (meta["step"], meta["train"]["global_batch"], meta["train"]["grad_clip"]) == (4, 6, 1.0)
    # an explicit setting that contradicts the checkpoint; the model's head count cannot be guessed
    assert (
        cli.main(
            [
                "checkpoint",
                "import-deepspeed",
                str(tmp_path / "ds"),
                str(tmp_path / "other"),
                "--model",
                str(model),
                "--global-batch",
                "12",
                *common,
            ]
        )
        == EXIT_BAD_INPUT
    )
    assert cli.main(argv[:4]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "global batch 12 (DeepSpeed's train_batch_size: 6; pass --global-batch)" in err
    assert "one of the arguments --model --config is required" in err
    assert not (tmp_path / "other").exists() or not storage.complete_checkpoints(tmp_path / "other")
