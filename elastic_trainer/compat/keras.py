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

The whole-model entry point of Run:AI's library, `runai.elastic.keras.models.Model(model)`, is `Model(model,
init(global_batch_size, max_gpu_batch_size))` here (the arithmetic comes back from `init` rather than from
module globals): `compile` wraps whatever optimizer it is given with the accumulation steps, `fit` runs
batches of the per-device size.
Install with the `keras` extra: `pip install elastic-trainer[keras]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    def from_config(cls, config: dict[str, Any]) -> PerUpdateSchedule:
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
        raise ConfigError(
            "optimizer is a LossScaleOptimizer (valid: accumulate on its inner optimizer, then "
            "wrap that in the LossScaleOptimizer)"
        )
    if optimizer.built:
        raise ConfigError(
            f"optimizer {optimizer.name!r} is already built (valid: wrap it before its first step or compile)"
        )
    if optimizer.gradient_accumulation_steps:
        raise ConfigError(
            f"optimizer {optimizer.name!r} already accumulates over "
            f"{optimizer.gradient_accumulation_steps} steps (valid: wrap a plain optimizer once)"
        )


def _accumulating(inner: type[keras.optimizers.Optimizer]) -> Callable[..., keras.optimizers.Optimizer]:
    def build(*args: Any, steps: int, **kwargs: Any) -> keras.optimizers.Optimizer:
        return GradientAccumulation(inner(*args, **kwargs), steps)

    build.__name__ = build.__qualname__ = inner.__name__
    build.__doc__ = (
        f"`keras.optimizers.{inner.__name__}(*args, **kwargs)` accumulating over `steps` calls; "
        f"`steps` is keyword-only (Keras's first position is learning_rate)."
    )
    return build


SGD = _accumulating(keras.optimizers.SGD)
Adam = _accumulating(keras.optimizers.Adam)
AdamW = _accumulating(keras.optimizers.AdamW)
RMSprop = _accumulating(keras.optimizers.RMSprop)
Adagrad = _accumulating(keras.optimizers.Adagrad)
Adadelta = _accumulating(keras.optimizers.Adadelta)
Adamax = _accumulating(keras.optimizers.Adamax)
Nadam = _accumulating(keras.optimizers.Nadam)


class Model:
    """A Keras model trained with the global batch of an `ElasticConfig` (compat.runai.init) on this device:
    `compile(optimizer=...)` accumulates over `config.steps` batches (any optimizer, or its name), `fit` takes
    `config.batch_size` samples per batch, so every optimizer update sees `config.global_batch_size` samples.
    Everything else (predict, evaluate, save, weights) is the wrapped model's."""

    def __init__(self, model: keras.Model, config) -> None:
        if not isinstance(model, keras.Model):
            raise ConfigError(f"model={type(model).__name__} is not a keras.Model")
        if config.world_size > 1:
            raise ConfigError(
                f"the Keras wrapper trains on one device; init() found {config.world_size} "
                "(Keras's data-parallel distribution needs its JAX backend, which this project does "
                "not test): pass world_size=1, or train with elastic-trainer"
            )
        self.model, self.config = model, config

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        self.model.compile(GradientAccumulation(keras.optimizers.get(optimizer), self.config.steps), *args, **kwargs)

    def fit(self, *args: Any, batch_size: int | None = None, **kwargs: Any) -> Any:
        """Keras's fit with the per-device batch; `batch_size`, when given, must be the global batch (what it
        means without accumulation) or the per-device one."""
        allowed = (self.config.global_batch_size, self.config.batch_size)
        if batch_size is not None and batch_size not in allowed:
            raise ConfigError(
                f"fit(batch_size={batch_size}) is neither the global batch {allowed[0]} nor the "
                f"per-device batch {allowed[1]} of init(); leave it out"
            )
        return self.model.fit(*args, batch_size=self.config.batch_size, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


__all__ = [
    "Model",
    "GradientAccumulation",
    "PerUpdateSchedule",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "Nadam",
]
