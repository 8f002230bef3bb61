"""DeepSpeed's checkpoint files read without running pickled code.

DeepSpeed writes `torch.save` pickles. Each file is read with torch's weights-only unpickler, which builds
tensors and plain containers only; the three DeepSpeed records a checkpoint holds (the ZeRO stage enum, the
loss scaler and ZeRO's fragment addresses) are rebuilt as inert stand-ins under their own names. Any other
global -- `os.system`, `subprocess`, a callable inside torch -- refuses the file with one line and nothing runs.
"""

from __future__ import annotations

import os
import pickle
import re

import torch

from elastic_trainer.checkpoint.storage import _refusal_reason
from elastic_trainer.config import CheckpointError


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
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
    ) as e:
        named = re.search(r"GLOBAL (\S+)", str(e))
        reason = f"it names {named.group(1)}, which is not allowed" if named else _refusal_reason(e)
        raise CheckpointError(
            f"refusing DeepSpeed checkpoint file {str(path)!r}: {reason} (only tensors, "
            "containers and DeepSpeed's own records are read; nothing was run)"
        ) from None
