"""`GradientAccumulation`: any torch optimizer, updating once every `steps` calls of `step()`.

The user's loop stays as it is (`loss.backward(); opt.step(); opt.zero_grad()` on every micro-batch). Gradients
add up in `.grad` between updates; at the `steps`-th call they are divided by `steps` and the inner optimizer
steps, so with a mean-reduced loss per micro-batch, `steps` micro-batches of b samples make the same update
as one batch of steps * b samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastic_trainer.config import ConfigError, positive_int

STATE_KEY = "grad_accumulation"
"""Key of the accumulation entry that `state_dict()` adds beside the inner optimizer's own keys."""


def _delegate(name: str) -> Callable:
    def method(self: GradientAccumulation, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"`{name}` of the inner optimizer, which owns the parameters and the hooks."
    return method


class GradientAccumulation(torch.optim.Optimizer):
    """Wrap `optimizer` so that it updates the parameters once every `steps` calls of `step()`.

    - `step()`: counts the call; on every `steps`-th call divides the accumulated `.grad` by `steps` and runs
      the inner optimizer. Parameters whose `.grad` is None are left to the inner optimizer (which skips them).
    - `zero_grad()`: clears only at an accumulation boundary (`at_boundary`), so gradients keep adding up
      in between, whatever the loop calls.
    - `param_groups`, `state`, `defaults` are the inner optimizer's: changing a group's `lr` takes effect and
      `torch.optim.lr_scheduler` schedulers accept the wrapper. Step them once per update (when
      `at_boundary` after `step()`) to keep the schedule a function of updates, not of micro-batches.
    - `state_dict()` adds the cycle position and, mid-cycle, the gradients accumulated so far, so a loaded
      run resumes exactly.
    - `step(closure)` evaluates the closure once (the micro-batch's forward and backward) and returns its
      loss; the inner optimizer is then stepped without it. LBFGS, which re-evaluates its closure inside a
      step, cannot be accumulated and is refused.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        # Optimizer.__init__ is deliberately not called: it would register the parameters a second time and
        # give this object param_groups and state of its own. Both belong to the inner optimizer (below).
        _check_inner(optimizer)
        self.optimizer = optimizer
        self._steps = positive_int("steps", steps)
        self._pending = 0  # step() calls since the last update

    @property
    def steps(self) -> int:
        """Calls of `step()` per update of the parameters."""
        return self._steps

    @property
    def at_boundary(self) -> bool:
        """True between accumulation cycles: no gradients are pending (the last `step()` updated, or none ran)."""
        return self._pending == 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending + 1 < self._steps:
            self._pending += 1
            return loss
        self._average_pending_grads()
        self.optimizer.step()
        self._pending = 0
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.at_boundary:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        grads = {}
        if self._pending:  # mid-cycle the partial sums live only in .grad: save them too
            grads = {i: p.grad.detach().clone() for i, p in enumerate(self._params()) if p.grad is not None}
        state[STATE_KEY] = {"steps": self._steps, "pending": self._pending, "grads": grads}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from `state_dict()` (or from the plain inner optimizer: then at a boundary)."""
        state = dict(state_dict)
        saved = state.pop(STATE_KEY, {"steps": self._steps, "pending": 0, "grads": {}})
        if saved["pending"] and saved["steps"] != self._steps:
            raise ConfigError(
                f"optimizer state was saved {saved['pending']} calls into a {saved['steps']}-step accumulation "
                f"cycle and cannot resume with steps={self._steps} (valid: steps={saved['steps']}, or save at "
                f"a boundary)"
            )
        self.optimizer.load_state_dict(state)
        self._pending = saved["pending"]
        if self._pending:  # restore exactly the gradients accumulated so far
            for i, p in enumerate(self._params()):
                grad = saved["grads"].get(i)
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype, copy=True)

    def __getstate__(self) -> dict[str, Any]:
        # Not Optimizer's: it would pickle properties as plain attributes. An lr scheduler's patched `step`
        # (a closure over a weak reference) is left out, as Optimizer leaves it out.
        return {"optimizer": self.optimizer, "_steps": self._steps, "_pending": self._pending}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self._steps}, pending={self._pending}, {self.optimizer!r})"

    add_param_group = _delegate("add_param_group")
    register_step_pre_hook = _delegate("register_step_pre_hook")
    register_step_post_hook = _delegate("register_step_post_hook")
    register_state_dict_pre_hook = _delegate("register_state_dict_pre_hook")
    register_state_dict_post_hook = _delegate("register_state_dict_post_hook")
    register_load_state_dict_pre_hook = _delegate("register_load_state_dict_pre_hook")
    register_load_state_dict_post_hook = _delegate("register_load_state_dict_post_hook")

    def _params(self) -> list[torch.Tensor]:
        """Parameters in the order of the state dict's integer ids."""
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def _average_pending_grads(self) -> None:
        if self._steps > 1:
            for p in self._params():
                if p.grad is not None:
                    p.grad.div_(self._steps)


def _check_inner(optimizer: object) -> None:
    if isinstance(optimizer, GradientAccumulation):
        raise ConfigError(
            f"optimizer already accumulates over {optimizer.steps} steps "
            f"(valid: wrap its inner {type(optimizer.optimizer).__name__} once)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(
            "LBFGS re-evaluates its closure within a step, which cannot be accumulated "
            "(valid: single-evaluation optimizers such as SGD, Adam, AdamW)"
        )
