"""Read a DeepSpeed checkpoint of a GPT without running pickled code, and turn it into one of ours.

DeepSpeed writes `torch.save` pickles. Each file is read with torch's weights-only unpickler, which builds
tensors and plain containers only; the three DeepSpeed records a checkpoint holds (the ZeRO stage enum, the
loss scaler and ZeRO's fragment addresses) are rebuilt as inert stand-ins under their own names. Any other
global -- `os.system`, `subprocess`, a callable inside torch -- refuses the file with one line and nothing runs.

Forms read (tensor-parallel DeepSpeed checkpoints are refused):
- ZeRO-1/2 (`mp_rank_00_model_states.pt` + one `zero_pp_rank_R_mp_rank_00_optim_states.pt` per dp rank):
  each rank's flat fp32 partition of each parameter group, with per-parameter fragment addresses;
- ZeRO-3 (`zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt`): every parameter split into equal padded
  pieces across the ranks, in the group's order;
- `PipelineModule` with ZeRO-1 (`layer_NN-model_states.pt`, one `mp_rank_SS_model_states.pt` and ZeRO files
  per stage): the layers of `elastic_trainer.compat.deepspeed_gpt`; a tied parameter is taken from its first
  stage;
- the universal form of `ds_to_universal` (`zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt`).
Parameter names may be our GPT's, Hugging Face GPT-2's (`transformer.h.0.attn.c_attn.weight`, converted as
`model.hf` does) or the pipeline's. Weights come from the fp32 master copies, never from a bf16/fp16 module.
"""

from __future__ import annotations

import math
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_trainer.checkpoint.storage import _refusal_reason
from elastic_trainer.config import CheckpointError, ConfigError, ModelConfig, TrainConfig

# -- safe loading ---------------------------------------------------------------------------------------------


def _zero_stage(value):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum(value): the stage number."""
    return int(value)


class _Record:
    """Stand-in for a DeepSpeed object pickled by its attributes (loss scaler, fragment address)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class _LossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    numel: int
    start: int


STAND_INS = [
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
"""The only non-torch, non-container globals a DeepSpeed checkpoint may name, each rebuilt as an inert record."""


def safe_load(path: str | os.PathLike):
    """torch.load with the weights-only unpickler and DeepSpeed's records as stand-ins; CheckpointError (one
    line, naming the file and the refused global) for anything else. Nothing in the file is executed."""
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except OSError as e:
        raise CheckpointError(f"DeepSpeed checkpoint file {str(path)!r} cannot be read ({e.strerror or e})") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError) as e:
        named = re.search(r"GLOBAL (\S+)", str(e))
        reason = f"it names {named.group(1)}, which is not allowed" if named else _refusal_reason(e)
        raise CheckpointError(f"refusing DeepSpeed checkpoint file {str(path)!r}: {reason} (only tensors, "
                              "containers and DeepSpeed's own records are read; nothing was run)") from None


# -- the state read ---------------------------------------------------------------------------------------------


@dataclass
class ParamState:
    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float
    hyper: dict
    """The parameter group's lr, betas, eps and weight_decay."""


@dataclass
class DeepSpeedState:
    form: str
    """'ZeRO-1', 'ZeRO-3', 'pipeline (2 stages, ZeRO-1)', 'universal'..."""
    params: dict[str, ParamState]
    """By the checkpoint's own parameter names (the first stage's for a pipeline's tied parameters)."""
    global_steps: int
    global_samples: int
    skipped_steps: int
    ds_config: dict
    ds_version: str
    dp_world_size: int
    pipeline: bool = False


_HYPER = ("lr", "betas", "eps", "weight_decay")


def _hyper(group: dict) -> dict:
    return {k: group[k] for k in _HYPER if k in group}


def _step_of(state: dict) -> float:
    step = state.get("step", 0)
    return float(step.item() if torch.is_tensor(step) else step)


def tag_folder(src: str | os.PathLike) -> Path:
    """A checkpoint's tag folder: SRC itself, or the tag SRC/latest names (DeepSpeed's save_checkpoint root)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{str(src)!r} is not a folder (valid: a DeepSpeed checkpoint folder, its tag "
                              "folder such as global_step100, or a ds_to_universal output)")
    if (src / "latest").is_file() and not _looks_like_tag(src):
        tag = (src / "latest").read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointError(f"{str(src / 'latest')!r} names no tag folder ({tag!r})")
        if not (src / tag).is_dir():
            raise CheckpointError(f"{str(src)!r}: 'latest' names {tag!r}, which is not a folder there")
        return src / tag
    if (src / "latest_universal").is_file() and not _looks_like_tag(src):
        return tag_folder_universal(src)
    return src


def tag_folder_universal(src: Path) -> Path:
    tag = (src / "latest_universal").read_text().strip()
    if not tag or "/" in tag or not (src / tag).is_dir():
        raise CheckpointError(f"{str(src)!r}: 'latest_universal' names no tag folder ({tag!r})")
    return src / tag


def _looks_like_tag(folder: Path) -> bool:
    return any(folder.glob("*model_states.pt")) or (folder / "zero").is_dir()


_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def read_deepspeed(src: str | os.PathLike) -> DeepSpeedState:
    """Everything needed to continue training, from a DeepSpeed checkpoint folder (see the module's docstring).
    CheckpointError (one line) for a folder that is not one, is incomplete, or holds anything unsafe."""
    folder = tag_folder(src)
    try:
        return _read(folder)
    except CheckpointError:  # already one line (a RuntimeError, so before the catch-all below)
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as e:
        detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        raise CheckpointError(f"{str(folder)!r} is not a DeepSpeed checkpoint of a form import reads ({detail}); "
                              "valid: ZeRO-1/2/3, PipelineModule with ZeRO-1, or ds_to_universal's output") from None


def _read(folder: Path) -> DeepSpeedState:
    names = sorted(os.listdir(folder))
    if (folder / "zero").is_dir():
        return _read_universal(folder)
    optim = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            optim.setdefault(int(m.group(2)), {})[int(m.group(1))] = folder / n
    zero3 = [n for n in names if _ZERO3_MODEL.match(n)]
    mp = {int(m.group(1)): folder / n for n in names if (m := _MP_MODEL.match(n))}
    if not optim:
        found = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "") or "nothing"
        raise CheckpointError(f"{str(folder)!r} holds no DeepSpeed optimizer state (found: {found}); import "
                              "needs the Adam moments: a checkpoint saved by engine.save_checkpoint with ZeRO "
                              "stage 1-3, or its ds_to_universal form")
    if zero3:
        return _read_zero3(folder, zero3, optim)
    if not mp:
        raise CheckpointError(f"{str(folder)!r} has ZeRO optimizer files but no mp_rank_NN_model_states.pt")
    return _read_zero12(folder, mp, optim)


def _common(model_states: dict, where: Path) -> dict:
    if not isinstance(model_states, dict) or "param_shapes" not in model_states:
        raise CheckpointError(f"{str(where)!r} is not a DeepSpeed model-states file (no param_shapes)")
    dims = model_states.get("checkpoint_parallel_dimensions") or {}
    tp = dims.get("tp_degree", 1)
    if tp != 1:
        raise CheckpointError(f"{str(where)!r} was saved with tensor parallelism {tp}: import reads DeepSpeed "
                              "checkpoints of ZeRO and PipelineModule only (tp_degree 1)")
    if model_states.get("frozen_param_shapes"):
        frozen = list(model_states["frozen_param_shapes"])[:3]
        raise CheckpointError(f"{str(where)!r} has frozen parameters ({', '.join(frozen)}...): elastic_trainer "
                              "trains every parameter of its GPT")
    return model_states


def _shapes(model_states: dict) -> list[dict[str, torch.Size]]:
    groups = model_states["param_shapes"]
    return [groups] if isinstance(groups, dict) else list(groups)


def _state(form: str, params: dict, ms: dict, dp: int, pipeline: bool = False) -> DeepSpeedState:
    return DeepSpeedState(form=form, params=params, global_steps=int(ms.get("global_steps", 0)),
                          global_samples=int(ms.get("global_samples", 0)), skipped_steps=int(ms.get("skipped_steps", 0)),
                          ds_config=dict(ms.get("ds_config") or {}), ds_version=str(ms.get("ds_version", "?")),
                          dp_world_size=dp, pipeline=pipeline)


def _ranked(files: dict[int, Path], where: Path, what: str) -> list[Path]:
    ranks = sorted(files)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointError(f"{str(where)!r} lacks {what} of data-parallel rank(s) {missing}: incomplete checkpoint")
    return [files[r] for r in ranks]


def _read_zero12_stage(folder: Path, model_states: dict, optim_files: list[Path], params: dict) -> str:
    """Add one (pipeline stage's) ZeRO-1/2 parameters to `params` (first stage wins); returns 'ZeRO-N'."""
    shapes = _shapes(model_states)
    osds = [safe_load(p) for p in optim_files]
    stage = None
    for path, sd in zip(optim_files, osds):
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise CheckpointError(f"{str(path)!r} is not a ZeRO-1/2 optimizer file (no single_partition_of_fp32_groups)")
        counts = osd.get("partition_count")
        if any(c != len(optim_files) for c in (counts if isinstance(counts, list) else [counts]) if c is not None):
            raise CheckpointError(f"{str(path)!r} was partitioned {counts} ways but {len(optim_files)} rank files "
                                  "are there: incomplete checkpoint")
        stage = osd.get("zero_stage", stage)
    for g, group_shapes in enumerate(shapes):
        pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {n: [] for n in group_shapes}
        hyper, step = None, None
        for path, sd in zip(optim_files, osds):
            osd = sd["optimizer_state_dict"]
            flat = osd["single_partition_of_fp32_groups"][g]
            base = osd["base_optimizer_state"]
            st = base["state"].get(g, base["state"].get(str(g))) if isinstance(base["state"], dict) else None
            if not st or "exp_avg" not in st:
                raise CheckpointError(f"{str(path)!r} holds no Adam state for parameter group {g}: import needs "
                                      "Adam or AdamW moments (a checkpoint after at least one step)")
            hyper, step = _hyper(base["param_groups"][g]), _step_of(st)
            for name, frag in osd["param_slice_mappings"][g].items():
                if name not in pieces:
                    raise CheckpointError(f"{str(path)!r} maps parameter {name!r}, which param_shapes lacks")
                s, n = int(frag.start), int(frag.numel)
                pieces[name].append((flat[s:s + n], st["exp_avg"][s:s + n], st["exp_avg_sq"][s:s + n]))
        for name, shape in group_shapes.items():
            got = pieces[name]
            numel = math.prod(shape)
            parts = [torch.cat([p[i] for p in got]) if got else torch.empty(0) for i in range(3)]
            if parts[0].numel() != numel:
                raise CheckpointError(f"{str(folder)!r}: parameter {name!r} has {parts[0].numel()} of its {numel} "
                                      "elements in the rank files: incomplete or inconsistent checkpoint")
            if name not in params:
                params[name] = ParamState(*(t.reshape(shape).clone() for t in parts), step=step, hyper=hyper)
    return f"ZeRO-{int(stage) if stage is not None else '1/2'}"


def _read_zero12(folder: Path, mp: dict[int, Path], optim: dict[int, dict[int, Path]]) -> DeepSpeedState:
    stages = sorted(mp)
    params: dict[str, ParamState] = {}
    first = None
    form = ""
    for s in stages:
        ms = _common(safe_load(mp[s]), mp[s])
        first = first or ms
        if s not in optim:
            raise CheckpointError(f"{str(folder)!r} lacks the ZeRO optimizer files of model-parallel rank {s}")
        form = _read_zero12_stage(folder, ms, _ranked(optim[s], folder, "the optimizer file"), params)
    pipeline = (first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) > 1 or \
        any(folder.glob("layer_*-model_states.pt"))
    if pipeline:
        form = f"pipeline ({len(stages)} stages, {form})"
    return _state(form, params, first, len(optim[stages[0]]), pipeline)


def _read_zero3(folder: Path, model_files: list[str], optim: dict[int, dict[int, Path]]) -> DeepSpeedState:
    if sorted(optim) != [0]:
        raise CheckpointError(f"{str(folder)!r}: ZeRO-3 with several model-parallel ranks is not supported")
    files = _ranked(optim[0], folder, "the optimizer file")
    world = len(files)
    ms = _common(safe_load(folder / model_files[0]), folder / model_files[0])
    shapes = _shapes(ms)
    osds = []
    for path in files:
        sd = safe_load(path)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
            raise CheckpointError(f"{str(path)!r} is not a ZeRO-3 optimizer file (no fp32_flat_groups)")
        if osd.get("partition_count", world) != world:
            raise CheckpointError(f"{str(path)!r} was partitioned {osd.get('partition_count')} ways but {world} "
                                  "rank files are there: incomplete checkpoint")
        osds.append((path, osd))
    params: dict[str, ParamState] = {}
    for g, group_shapes in enumerate(shapes):
        flats, avgs, sqs = [], [], []
        hyper, step = None, None
        for path, osd in osds:
            inner = osd["optimizer_state_dict"]
            st = inner["state"].get(g) if isinstance(inner.get("state"), dict) else None
            if not st or "exp_avg" not in st:
                raise CheckpointError(f"{str(path)!r} holds no Adam state for parameter group {g}: import needs "
                                      "Adam or AdamW moments (a checkpoint after at least one step)")
            flats.append(osd["fp32_flat_groups"][g])
            avgs.append(st["exp_avg"])
            sqs.append(st["exp_avg_sq"])
            hyper, step = _hyper(inner["param_groups"][g]), _step_of(st)
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world)
            if offset + piece > min(f.numel() for f in flats):
                raise CheckpointError(f"{str(folder)!r}: the ZeRO-3 partitions end before parameter {name!r}: "
                                      "incomplete or inconsistent checkpoint")
            parts = [torch.cat([t[offset:offset + piece] for t in ts])[:numel].reshape(shape).clone()
                     for ts in (flats, avgs, sqs)]
            params[name] = ParamState(*parts, step=step, hyper=hyper)
            offset += piece
    return _state("ZeRO-3", params, ms, world)


def _read_universal(folder: Path) -> DeepSpeedState:
    # ds_to_universal copies the model-states files: mp_rank_SS_... (ZeRO-1/2, one per pipeline stage) or
    # zero_pp_rank_R_mp_rank_00_... (ZeRO-3)
    model_files = sorted(folder.glob("mp_rank_*_model_states.pt")) or \
        sorted(folder.glob("zero_pp_rank_0_mp_rank_*_model_states.pt"))
    if not model_files:
        raise CheckpointError(f"{str(folder)!r} has a zero/ folder but no model-states file: not a ds_to_universal "
                              "output")
    states = [_common(safe_load(f), f) for f in model_files]
    groups = []
    opt_path = folder / "zero" / "optimizer_state.pt"
    if opt_path.exists():
        opt = safe_load(opt_path)
        groups = list(opt.get("param_groups", [])) if isinstance(opt, dict) else []
    params: dict[str, ParamState] = {}
    for ms in states:  # pipeline stages in order: a tied parameter is taken from its first stage
        for g, group_shapes in enumerate(_shapes(ms)):
            hyper = _hyper(groups[g]) if g < len(groups) else {}
            for name, shape in group_shapes.items():
                if name not in params:
                    params[name] = _universal_param(folder, name, shape, hyper, ms)
    first = states[0]
    pipeline = (first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) > 1
    return _state("universal" + (f" (pipeline, {len(states)} stages)" if pipeline else ""), params, first,
                  int(first.get("dp_world_size", 1)), pipeline)


def _universal_param(folder: Path, name: str, shape, hyper: dict, ms: dict) -> ParamState:
    d = folder / "zero" / name
    if not d.is_dir():
        raise CheckpointError(f"{str(folder)!r}: universal checkpoint lacks zero/{name}/")
    tensors = []
    for what in ("fp32", "exp_avg", "exp_avg_sq"):
        if not (d / f"{what}.pt").exists():
            raise CheckpointError(f"{str(d)!r} lacks {what}.pt: import needs the weights and Adam moments")
        item = safe_load(d / f"{what}.pt")
        t = item.get("param") if isinstance(item, dict) else item
        if not torch.is_tensor(t) or t.numel() != math.prod(shape):
            raise CheckpointError(f"{str(d / (what + '.pt'))!r} does not hold a tensor of {tuple(shape)}")
        tensors.append(t.reshape(shape).float().clone())
    step = safe_load(d / "step.pt") if (d / "step.pt").exists() else ms.get("global_steps", 0)
    return ParamState(*tensors, step=float(step.item() if torch.is_tensor(step) else step), hyper=hyper)


# -- into our names and settings ----------------------------------------------------------------------------


def gpt_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our GPT's parameter names and shapes (built on the meta device: no memory)."""
    from elastic_trainer.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _hf_names(cfg: ModelConfig, names: list[str]) -> dict[str, str]:
    """our name -> the Hugging Face GPT-2 name (GPT2LMHeadModel's `transformer.` prefix or GPT2Model's none),
    from model.hf's tables."""
    from elastic_trainer.model import hf

    prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    out = {ours: prefix + theirs.removeprefix("transformer.") for ours, theirs in hf._TOP.items()}
    for i in range(cfg.n_layers):
        block = {**hf._BLOCK_RENAMES, **hf._BLOCK_TRANSPOSED, "attn.qkv_proj.weight": "attn.c_attn.weight",
                 "attn.qkv_proj.bias": "attn.c_attn.bias"}
        out.update({f"layers.{i}.{ours}": f"{prefix}h.{i}.{theirs}" for ours, theirs in block.items()})
    return out


TIED_KEY = "embed"
"""The tied-module key of the token embedding in elastic_trainer.compat.deepspeed_gpt's PipelineModule."""


def pipeline_param_name(name: str, n_layers: int) -> str | None:
    """A PipelineModule parameter name ('tied_modules.embed.tok_emb.weight', '1.pos_emb.weight',
    '4.ln_1.weight') -> our GPT's ('tok_emb.weight', 'pos_emb.weight', 'layers.2.ln_1.weight'); None for a
    name that is not part of the layers above."""
    if name == f"tied_modules.{TIED_KEY}.tok_emb.weight":
        return "tok_emb.weight"
    index, _, rest = name.partition(".")
    if not index.isdigit():
        return None
    i = int(index)
    if i == 1 and rest == "pos_emb.weight":
        return rest
    if 2 <= i < n_layers + 2 and rest.split(".", 1)[0] in ("ln_1", "attn", "ln_2", "mlp"):
        return f"layers.{i - 2}.{rest}"
    if i == n_layers + 2 and rest in ("ln_f.weight", "ln_f.bias"):
        return rest
    return None


def to_gpt(state: DeepSpeedState, cfg: ModelConfig) -> dict[str, ParamState]:
    """The checkpoint's parameters under our GPT's names, shapes checked against `cfg`."""
    want = gpt_shapes(cfg)
    names = list(state.params)
    if not names:
        raise ConfigError("the DeepSpeed checkpoint lists no parameters (empty param_shapes)")
    if "tok_emb.weight" in names:
        extra = [n for n in names if n not in want]
        if extra:
            raise ConfigError(f"the checkpoint holds parameters a GPT with {cfg.n_layers} layers lacks (first: "
                              f"{extra[0]!r}); it has {_layer_count(names)} layers (check --model)")
        out = {n: state.params[n] for n in want if n in state.params}
    elif any(n.startswith("tied_modules.") or n.split(".", 1)[0].isdigit() for n in names):
        out = {}
        for n in names:
            ours = pipeline_param_name(n, cfg.n_layers)
            if ours is None:
                raise ConfigError(f"pipeline parameter {n!r} is not a layer of elastic_trainer.compat.deepspeed_gpt's "
                                  f"PipelineModule for a {cfg.n_layers}-layer GPT (check --model)")
            out.setdefault(ours, state.params[n])
    elif any(n.startswith(("transformer.", "h.", "wte.")) for n in names):
        source = _hf_names(cfg, names)
        absent = [theirs for theirs in source.values() if theirs not in state.params]
        if absent:
            raise ConfigError(f"the checkpoint's Hugging Face GPT-2 parameters lack {absent[0]!r} for a "
                              f"{cfg.n_layers}-layer GPT; it has {_layer_count(names)} layers (check --model)")
        extra = sorted(set(names) - set(source.values()))
        if extra:
            why = ("an untied output head is not supported" if extra[0].endswith("lm_head.weight") else
                   f"it has {_layer_count(names)} layers (check --model)")
            raise ConfigError(f"the checkpoint holds Hugging Face GPT-2 parameters a GPT with {cfg.n_layers} layers "
                              f"lacks (first: {extra[0]!r}); {why}")
        out = {}
        for ours, theirs in source.items():
            p = state.params[theirs]
            conv = {}
            for what in ("weight", "exp_avg", "exp_avg_sq"):
                try:
                    conv[what] = _convert_hf_tensor(ours, getattr(p, what), cfg)
                except RuntimeError:
                    raise ConfigError(f"parameter {theirs!r} is {tuple(p.weight.shape)} in the checkpoint, which "
                                      f"does not fit the model given (check --model)") from None
            out[ours] = ParamState(**conv, step=p.step, hyper=p.hyper)
    else:
        raise ConfigError(f"unrecognized parameter names (first: {names[0]!r}): import reads DeepSpeed checkpoints "
                          "of elastic_trainer's GPT, of Hugging Face GPT-2, or of the PipelineModule in "
                          "elastic_trainer.compat.deepspeed_gpt")
    missing = [n for n in want if n not in out]
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} parameter(s) of a GPT with {cfg.n_layers} layers "
                          f"(first: {missing[0]!r}); it has {_layer_count(list(out))} layers (check --model)")
    wrong = [(n, tuple(out[n].weight.shape), s) for n, s in want.items() if tuple(out[n].weight.shape) != s]
    if wrong:
        n, got, s = wrong[0]
        raise ConfigError(f"parameter {n!r} is {got} in the checkpoint but {s} in the model given (check --model: "
                          f"d_model, vocab_size, context_length)")
    return out


def _layer_count(names: list[str]) -> int:
    """Transformer blocks in a set of our (or Hugging Face) parameter names."""
    found = {m.group(1) for n in names if (m := re.match(r"^(?:transformer\.)?(?:layers|h)\.(\d+)\.", n))}
    return len(found)


def _convert_hf_tensor(ours: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """One HF GPT-2 tensor (weight or moment) as our parameter `ours`, by model.hf's element moves."""
    from elastic_trainer.model import hf

    if ours.endswith("attn.qkv_proj.weight"):
        return hf._qkv_from_hf(t.t(), cfg).contiguous()
    if ours.endswith("attn.qkv_proj.bias"):
        return hf._qkv_from_hf(t, cfg).contiguous()
    if any(ours.endswith(k) for k in hf._BLOCK_TRANSPOSED):
        return t.t().contiguous()
    return t.contiguous()


@dataclass
class ImportPlan:
    """What an import writes: the step, and the settings the DeepSpeed run fixed."""

    step: int
    global_batch: int
    grad_clip: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    last_lr: float | None


def settings_of(state: DeepSpeedState) -> ImportPlan:
    """The training settings a DeepSpeed checkpoint records (ds_config and the optimizer's groups)."""
    cfg = state.ds_config
    hypers = [p.hyper for p in state.params.values() if p.hyper]
    betas = hypers[0].get("betas", (0.9, 0.999)) if hypers else (0.9, 0.999)
    decays = sorted({float(h.get("weight_decay", 0.0)) for h in hypers})
    batch = cfg.get("train_batch_size")
    if batch is None and state.global_steps:
        batch = state.global_samples // state.global_steps
    return ImportPlan(step=state.global_steps, global_batch=int(batch or 0),
                      grad_clip=float(cfg.get("gradient_clipping", 0.0) or 0.0),
                      weight_decay=decays[-1] if decays else 0.0, beta1=float(betas[0]), beta2=float(betas[1]),
                      eps=float(hypers[0].get("eps", 1e-8)) if hypers else 1e-8,
                      last_lr=float(hypers[0]["lr"]) if hypers and "lr" in hypers[0] else None)


def check_settings(state: DeepSpeedState, params: dict[str, ParamState], cfg: TrainConfig) -> None:
    """Refuse (one line) when continuing with `cfg` would not be the DeepSpeed run's trajectory."""
    plan = settings_of(state)
    if plan.step <= 0:
        raise ConfigError("the DeepSpeed checkpoint is from before the first step (global_steps 0): there is "
                          "nothing to import; start the run with elastic_trainer's own initialization")
    problems = []
    if plan.global_batch and plan.global_batch != cfg.global_batch:
        problems.append(f"global batch {cfg.global_batch} (DeepSpeed's train_batch_size: {plan.global_batch}; "
                        "pass --global-batch)")
    if plan.grad_clip != cfg.grad_clip:
        problems.append(f"grad_clip {cfg.grad_clip} (DeepSpeed's gradient_clipping: {plan.grad_clip}; pass "
                        "--grad-clip)")
    for key, value in (("beta1", plan.beta1), ("beta2", plan.beta2), ("eps", plan.eps)):
        if not math.isclose(getattr(cfg, key), value, rel_tol=1e-12, abs_tol=0.0):
            problems.append(f"{key} {getattr(cfg, key)} (DeepSpeed's optimizer: {value}; set [train] {key} in a "
                            "--config file)")
    for name, p in params.items():
        want = cfg.weight_decay if p.weight.ndim >= 2 else 0.0
        got = float(p.hyper.get("weight_decay", want))
        if not math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0):
            problems.append(f"weight decay {want} on {name} (DeepSpeed's: {got}; elastic_trainer decays "
                            "matrices and embeddings by --weight-decay and nothing else)")
            break
    if problems:
        raise ConfigError("continuing this DeepSpeed checkpoint with these settings would change its loss "
                          "trajectory: " + "; ".join(problems))


# -- writing ours ---------------------------------------------------------------------------------------------


def _write(rank: int, world: int, model_cfg: ModelConfig, cfg: TrainConfig, params: dict[str, ParamState],
           step: int, out: str, tokens) -> str:
    from elastic_trainer.checkpoint.manager import Checkpointer
    from elastic_trainer.checkpoint.state import init_optimizer_state
    from elastic_trainer.config import CheckpointConfig
    from elastic_trainer.parallel.mesh import build_mesh
    from elastic_trainer.plan.layout import Layout
    from elastic_trainer.train.loop import Trainer

    layout = Layout(1, 1, 1, cfg.global_batch, 1)
    trainer = Trainer(model_cfg, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens,
                      initialize=False)
    init_optimizer_state(trainer.optimizer)
    with torch.no_grad():
        for name, param in trainer.engine.model.named_parameters():
            src = params[name]
            param.copy_(src.weight)
            state = trainer.optimizer.state[param]
            state["exp_avg"].copy_(src.exp_avg)
            state["exp_avg_sq"].copy_(src.exp_avg_sq)
            state["step"].fill_(src.step)
    trainer.restore(step, cfg)
    checkpointer = Checkpointer(CheckpointConfig(dir=out, resume="never", keep=0), log=lambda *a, **k: None)
    try:
        checkpointer.prepare_fresh_run("never")
        stats = checkpointer.save(trainer, blocking=True)
    finally:
        checkpointer.close()
    return str(stats.path)


def import_deepspeed(src: str | os.PathLike, out: str | os.PathLike, model_cfg: ModelConfig, cfg: TrainConfig, *,
                     state: DeepSpeedState | None = None, tokens=None, log=print) -> Path:
    """Write the DeepSpeed checkpoint `src` as a checkpoint of ours under the root `out` (which must hold no
    checkpoint); training then resumes from it in any layout. Returns the checkpoint folder."""
    from elastic_trainer.checkpoint.storage import complete_checkpoints
    from elastic_trainer.parallel.local_ranks import run_ranks

    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{str(out)!r} is a file: give a new or empty folder for the imported checkpoint")
    existing = complete_checkpoints(out) if Path(out).is_dir() else []
    if existing:
        raise ConfigError(f"{str(out)!r} already holds checkpoints ({existing[0].name}, ...): import into a new or "
                          "empty folder")
    state = state or read_deepspeed(src)
    params = to_gpt(state, model_cfg)
    check_settings(state, params, cfg)
    if state.global_samples and state.global_samples != state.global_steps * cfg.global_batch:
        log(f"[import] note: DeepSpeed counted {state.global_samples} samples in {state.global_steps} steps; "
            f"elastic_trainer continues at sample {state.global_steps * cfg.global_batch} of its own order")
    folder = run_ranks(_write, 1, model_cfg, cfg, params, state.global_steps, str(out), tokens)[0]
    n = sum(p.weight.numel() for p in params.values())
    log(f"[import] {state.form} checkpoint of DeepSpeed {state.ds_version} (dp {state.dp_world_size}), step "
        f"{state.global_steps}: {len(params)} tensors, {n / 1e6:.2f} M parameters with their Adam moments -> {folder}")
    return Path(folder)
