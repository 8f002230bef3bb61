"""Keras 3 adapter (any backend): gradient accumulation on Keras optimizers, the Run:AI way.

    import os; os.environ.setdefault("KERAS_BACKEND", "torch")   # before keras is first imported
    from elastic_trainer.compat import keras as ga
    opt = ga.GradientAccumulation(keras.optimizers.AdamW(1e-3), cfg.steps)
    opt = ga.AdamW(learning_rate=1e-3, steps=cfg.steps)       # the same, ready-made
    model.compile(optimizer=opt, loss=...); model.fit(x, y, batch_size=cfg.batch_size)

Keras 3 optimizers accumulate by themselves: with `gradient_accumulation_steps=n` (n >= 2) each `apply`
adds the gradients into accumulators and every n-th one updates with their average (sum / n), clipping and
weight decay included; `optimizer.iterations` then counts updates. Two things this adapter adds:
- it works on any optimizer not yet built, a custom one too, without re-creating it from its config (which
  loses constructor arguments a subclass does not serialize, and fails on a lambda learning rate);
- a `LearningRateSchedule` is evaluated at the update count. Keras evaluates schedules at the micro-step
  count, so with n steps a schedule would run n times faster, and the trajectory would depend on the GPU
  count that chose n.
Install with the `keras` extra: `pip install elastic-trainer[keras]`.
"""

from __future__ import annotations

from typing import Any, Callable

import keras

from elastic_trainer.config import ConfigError, positive_int


@keras.saving.register_keras_serializable(package="elastic_trainer")
class PerUpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule` evaluated at the optimizer update count: micro-step // steps."""

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, steps: int) -> None:
        self.schedule = schedule
        self.steps = steps

    def __call__(self, step: Any) -> Any:
        return self.schedule(keras.ops.floor_divide(step, self.steps))

    def get_config(self) -> dict[str, Any]:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "steps": self.steps}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PerUpdateSchedule":
        return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["steps"])


def GradientAccumulation(optimizer: keras.optimizers.Optimizer, steps: int) -> keras.optimizers.Optimizer:
    """Turn on accumulation over `steps` calls on a Keras optimizer that has not been built yet; return it.

    The optimizer is configured in place (Keras's own `gradient_accumulation_steps`) rather than wrapped, so
    it stays the same class, serializes as one, and any custom optimizer works. steps=1 leaves it as it is.
    """
    _check_unused(optimizer)
    steps = positive_int("steps", steps)
    if steps == 1:  # Keras accepts only None or >= 2
        return optimizer
    optimizer.gradient_accumulation_steps = steps
    schedule = optimizer._learning_rate  # the schedule object itself; `learning_rate` would evaluate it
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = PerUpdateSchedule(schedule, steps)
    return optimizer


def _check_unused(optimizer: object) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"optimizer={type(optimizer).__name__} is not a keras.optimizers.Optimizer")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError("optimizer is a LossScaleOptimizer (valid: accumulate on its inner optimizer, then "
                          "wrap that in the LossScaleOptimizer)")
    if optimizer.built:
        raise ConfigError(f"optimizer {optimizer.name!r} is already built (valid: wrap it before its first "
                          f"step or compile)")
    if optimizer.gradient_accumulation_steps:
        raise ConfigError(f"optimizer {optimizer.name!r} already accumulates over "
                          f"{optimizer.gradient_accumulation_steps} steps (valid: wrap a plain optimizer once)")


def _accumulating(inner: type[keras.optimizers.Optimizer]) -> Callable[..., keras.optimizers.Optimizer]:
    def build(*args: Any, steps: int, **kwargs: Any) -> keras.optimizers.Optimizer:
        return GradientAccumulation(inner(*args, **kwargs), steps)

    build.__name__ = build.__qualname__ = inner.__name__
    build.__doc__ = (f"`keras.optimizers.{inner.__name__}(*args, **kwargs)` accumulating over `steps` calls; "
                     f"`steps` is keyword-only (Keras's first position is learning_rate).")
    return build


SGD = _accumulating(keras.optimizers.SGD)
Adam = _accumulating(keras.optimizers.Adam)
AdamW = _accumulating(keras.optimizers.AdamW)
RMSprop = _accumulating(keras.optimizers.RMSprop)
Adagrad = _accumulating(keras.optimizers.Adagrad)
Adadelta = _accumulating(keras.optimizers.Adadelta)
Adamax = _accumulating(keras.optimizers.Adamax)
Nadam = _accumulating(keras.optimizers.Nadam)

__all__ = ["GradientAccumulation", "PerUpdateSchedule", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad",
           "Adadelta", "Adamax", "Nadam"]
