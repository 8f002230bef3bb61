"""DeepSpeed's checkpoint files -> `DeepSpeedState`: every parameter's fp32 weight, Adam moments and step,
by the checkpoint's own parameter names, with DeepSpeed's step and sample counts and its config.

Forms read (tensor-parallel DeepSpeed checkpoints are refused):
- ZeRO-1/2 (`mp_rank_00_model_states.pt` + one `zero_pp_rank_R_mp_rank_00_optim_states.pt` per dp rank):
  each rank's flat fp32 partition of each parameter group, with per-parameter fragment addresses;
- ZeRO-3 (`zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt`): every parameter split into equal padded
  pieces across the ranks, in the group's order;
- `PipelineModule` with ZeRO-1 (`layer_NN-model_states.pt`, one `mp_rank_SS_model_states.pt` and ZeRO files
  per stage): the layers of `elastic_trainer.interop.deepspeed.pipeline_gpt`; a tied parameter is taken from
  its first stage;
- the universal form of `ds_to_universal` (`zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt`).
Weights come from the fp32 master copies, never from a bf16/fp16 module. Every file goes through `safe_load`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_trainer.config import CheckpointError
from elastic_trainer.interop.deepspeed.safe import safe_load


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
        raise CheckpointError(
            f"{str(src)!r} is not a folder (valid: a DeepSpeed checkpoint folder, its tag "
            "folder such as global_step100, or a ds_to_universal output)"
        )
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
        raise CheckpointError(
            f"{str(folder)!r} is not a DeepSpeed checkpoint of a form import reads ({detail}); "
            "valid: ZeRO-1/2/3, PipelineModule with ZeRO-1, or ds_to_universal's output"
        ) from None


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
        raise CheckpointError(
            f"{str(folder)!r} holds no DeepSpeed optimizer state (found: {found}); import "
            "needs the Adam moments: a checkpoint saved by engine.save_checkpoint with ZeRO "
            "stage 1-3, or its ds_to_universal form"
        )
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
        raise CheckpointError(
            f"{str(where)!r} was saved with tensor parallelism {tp}: import reads DeepSpeed "
            "checkpoints of ZeRO and PipelineModule only (tp_degree 1)"
        )
    if model_states.get("frozen_param_shapes"):
        frozen = list(model_states["frozen_param_shapes"])[:3]
        raise CheckpointError(
            f"{str(where)!r} has frozen parameters ({', '.join(frozen)}...): elastic_trainer "
            "trains every parameter of its GPT"
        )
    return model_states


def _shapes(model_states: dict) -> list[dict[str, torch.Size]]:
    groups = model_states["param_shapes"]
    return [groups] if isinstance(groups, dict) else list(groups)


def _state(form: str, params: dict, ms: dict, dp: int, pipeline: bool = False) -> DeepSpeedState:
    return DeepSpeedState(
        form=form,
        params=params,
        global_steps=int(ms.get("global_steps", 0)),
        global_samples=int(ms.get("global_samples", 0)),
        skipped_steps=int(ms.get("skipped_steps", 0)),
        ds_config=dict(ms.get("ds_config") or {}),
        ds_version=str(ms.get("ds_version", "?")),
        dp_world_size=dp,
        pipeline=pipeline,
    )


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
            raise CheckpointError(
                f"{str(path)!r} is not a ZeRO-1/2 optimizer file (no single_partition_of_fp32_groups)"
            )
        counts = osd.get("partition_count")
        if any(c != len(optim_files) for c in (counts if isinstance(counts, list) else [counts]) if c is not None):
            raise CheckpointError(
                f"{str(path)!r} was partitioned {counts} ways but {len(optim_files)} rank files "
                "are there: incomplete checkpoint"
            )
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
                raise CheckpointError(
                    f"{str(path)!r} holds no Adam state for parameter group {g}: import needs "
                    "Adam or AdamW moments (a checkpoint after at least one step)"
                )
            hyper, step = _hyper(base["param_groups"][g]), _step_of(st)
            for name, frag in osd["param_slice_mappings"][g].items():
                if name not in pieces:
                    raise CheckpointError(f"{str(path)!r} maps parameter {name!r}, which param_shapes lacks")
                s, n = int(frag.start), int(frag.numel)
                pieces[name].append((flat[s : s + n], st["exp_avg"][s : s + n], st["exp_avg_sq"][s : s + n]))
        for name, shape in group_shapes.items():
            got = pieces[name]
            numel = math.prod(shape)
            parts = [torch.cat([p[i] for p in got]) if got else torch.empty(0) for i in range(3)]
            if parts[0].numel() != numel:
                raise CheckpointError(
                    f"{str(folder)!r}: parameter {name!r} has {parts[0].numel()} of its {numel} "
                    "elements in the rank files: incomplete or inconsistent checkpoint"
                )
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
    pipeline = (first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) > 1 or any(
        folder.glob("layer_*-model_states.pt")
    )
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
            raise CheckpointError(
                f"{str(path)!r} was partitioned {osd.get('partition_count')} ways but {world} "
                "rank files are there: incomplete checkpoint"
            )
        osds.append((path, osd))
    params: dict[str, ParamState] = {}
    for g, group_shapes in enumerate(shapes):
        flats, avgs, sqs = [], [], []
        hyper, step = None, None
        for path, osd in osds:
            inner = osd["optimizer_state_dict"]
            st = inner["state"].get(g) if isinstance(inner.get("state"), dict) else None
            if not st or "exp_avg" not in st:
                raise CheckpointError(
                    f"{str(path)!r} holds no Adam state for parameter group {g}: import needs "
                    "Adam or AdamW moments (a checkpoint after at least one step)"
                )
            flats.append(osd["fp32_flat_groups"][g])
            avgs.append(st["exp_avg"])
            sqs.append(st["exp_avg_sq"])
            hyper, step = _hyper(inner["param_groups"][g]), _step_of(st)
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world)
            if offset + piece > min(f.numel() for f in flats):
                raise CheckpointError(
                    f"{str(folder)!r}: the ZeRO-3 partitions end before parameter {name!r}: "
                    "incomplete or inconsistent checkpoint"
                )
            parts = [
                torch.cat([t[offset : offset + piece] for t in ts])[:numel].reshape(shape).clone()
                for ts in (flats, avgs, sqs)
            ]
            params[name] = ParamState(*parts, step=step, hyper=hyper)
            offset += piece
    return _state("ZeRO-3", params, ms, world)


def _read_universal(folder: Path) -> DeepSpeedState:
    # ds_to_universal copies the model-states files: mp_rank_SS_... (ZeRO-1/2, one per pipeline stage) or
    # zero_pp_rank_R_mp_rank_00_... (ZeRO-3)
    model_files = sorted(folder.glob("mp_rank_*_model_states.pt")) or sorted(
        folder.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not model_files:
        raise CheckpointError(
            f"{str(folder)!r} has a zero/ folder but no model-states file: not a ds_to_universal output"
        )
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
    return _state(
        "universal" + (f" (pipeline, {len(states)} stages)" if pipeline else ""),
        params,
        first,
        int(first.get("dp_world_size", 1)),
        pipeline,
    )


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
