"""Common torch optimizers already wrapped in `GradientAccumulation`: `AdamW(params, lr=3e-4, steps=4)`.

`steps` is keyword-only and required. Run:AI allowed it positionally, but here the second position is the
torch optimizer's own (`lr`), so `AdamW(params, 4)` raises TypeError instead of silently meaning lr=4.
Every other argument goes to the torch optimizer unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_trainer.compat.accumulation import GradientAccumulation


def _accumulating(inner: type[torch.optim.Optimizer]) -> type[GradientAccumulation]:
    def __init__(self: GradientAccumulation, params: Any, *args: Any, steps: int, **kwargs: Any) -> None:
        GradientAccumulation.__init__(self, inner(params, *args, **kwargs), steps)

    name = inner.__name__
    doc = (
        f"`torch.optim.{name}(params, *args, **kwargs)` updating once every `steps` calls of `step()` "
        f"with the averaged gradients (see GradientAccumulation)."
    )
    return type(
        name,
        (GradientAccumulation,),
        {"__init__": __init__, "__doc__": doc, "__module__": __name__, "__qualname__": name},
    )


SGD = _accumulating(torch.optim.SGD)
Adam = _accumulating(torch.optim.Adam)
AdamW = _accumulating(torch.optim.AdamW)
RMSprop = _accumulating(torch.optim.RMSprop)
Adagrad = _accumulating(torch.optim.Adagrad)
Adadelta = _accumulating(torch.optim.Adadelta)
Adamax = _accumulating(torch.optim.Adamax)
NAdam = _accumulating(torch.optim.NAdam)
RAdam = _accumulating(torch.optim.RAdam)

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam"]
