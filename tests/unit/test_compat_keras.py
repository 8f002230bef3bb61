"""Keras 3 adapter on the torch backend: k accumulated steps of batch b against one step of batch k*b."""

from __future__ import annotations

import os
import sys

import pytest

if "keras" not in sys.modules:  # the backend is fixed when keras is first imported
    os.environ["KERAS_BACKEND"] = "torch"
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip(f"keras was imported with the {keras.backend.backend()} backend", allow_module_level=True)

import numpy as np  # noqa: E402

from elastic_trainer.compat import keras as ga  # noqa: E402
from elastic_trainer.config import ConfigError  # noqa: E402

K, B, UPDATES = 4, 3, 5  # accumulation steps, micro-batch, optimizer updates
# Keras's torch backend converts with np.array(x, copy=False), which NumPy 2 deprecates: noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")


def halving_schedule():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)


OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "AdamW": lambda: keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(learning_rate=1e-2, momentum=0.5),
    "Adam+schedule": lambda: keras.optimizers.Adam(learning_rate=halving_schedule()),
}


def fit(optimizer, batch_size: int):
    """A seeded model trained one epoch on fixed data with a mean-reduced loss per batch, in order."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((K * B * UPDATES, 6)).astype("float32")
    y = rng.standard_normal((K * B * UPDATES, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def max_diff(a, b) -> float:
    return max(float(np.abs(p - q).max()) for p, q in zip(a, b))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_k_accumulated_steps_equal_one_step_on_k_times_the_batch(name):
    # fp32 like the torch test; measured differences are below 1e-7, so the same 1e-6 bound holds here.
    reference = fit(OPTIMIZERS[name](), K * B)
    optimizer = ga.GradientAccumulation(OPTIMIZERS[name](), K)
    assert max_diff(fit(optimizer, B), reference) < 1e-6
    assert int(optimizer.iterations) == UPDATES
    assert max_diff(fit(OPTIMIZERS[name](), B), reference) > 1e-3  # one update per micro-batch: far away


def test_ready_made_optimizer_and_schedule_per_update():
    reference = fit(keras.optimizers.Adam(learning_rate=halving_schedule()), K * B)
    optimizer = ga.Adam(learning_rate=halving_schedule(), steps=K)
    assert isinstance(optimizer, keras.optimizers.Adam) and optimizer.gradient_accumulation_steps == K
    assert max_diff(fit(optimizer, B), reference) < 1e-6
    assert float(optimizer.learning_rate) == pytest.approx(1e-2 * 0.5**UPDATES)
    # Keras alone evaluates the schedule at micro-steps, which is what the adapter corrects.
    builtin = keras.optimizers.Adam(learning_rate=halving_schedule(), gradient_accumulation_steps=K)
    assert max_diff(fit(builtin, B), reference) > 1e-3


def test_config_round_trip_keeps_accumulation_and_schedule():
    optimizer = ga.SGD(learning_rate=halving_schedule(), momentum=0.9, steps=K)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert clone.gradient_accumulation_steps == K and isinstance(clone._learning_rate, ga.PerUpdateSchedule)
    assert float(clone._learning_rate(2 * K)) == pytest.approx(1e-2 * 0.25)


def test_one_step_leaves_the_optimizer_as_it_is():
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    assert ga.GradientAccumulation(optimizer, 1) is optimizer and optimizer.gradient_accumulation_steps is None


def test_steps_are_keyword_only_in_ready_made_optimizers():
    with pytest.raises(TypeError, match="steps"):
        ga.Adam(4)  # Run:AI's positional steps would be taken as Keras's learning_rate


def built_sgd():
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    return optimizer


@pytest.mark.parametrize(
    "build, steps, message",
    [
        (lambda: keras.optimizers.SGD(learning_rate=0.1), 0, "steps=0 must be a positive integer"),
        (lambda: object(), 2, "optimizer=object is not a keras.optimizers.Optimizer"),
        (built_sgd, 2, "is already built (valid: wrap it before its first step or compile)"),
        (
            lambda: keras.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=3),
            2,
            "already accumulates over 3 steps (valid: wrap a plain optimizer once)",
        ),
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), 2, "optimizer is a LossScaleOptimizer"),
    ],
)
def test_bad_input_is_one_clear_line(build, steps, message):
    with pytest.raises(ConfigError) as info:
        ga.GradientAccumulation(build(), steps)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_model_wrapper_trains_the_global_batch_on_one_device():
    """Run:AI's `runai.elastic.keras.models.Model(model)`: init(12, 3) on one device gives 4 accumulated
    batches of 3; fit through the wrapper equals plain Keras with batches of 12, after UPDATES updates
    (measured difference below 1e-7; bound 1e-6 as above)."""
    from elastic_trainer.compat.runai import init

    config = init(K * B, B, world_size=1)
    assert (config.steps, config.batch_size) == (K, B)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((K * B * UPDATES, 6)).astype("float32")
    y = rng.standard_normal((K * B * UPDATES, 3)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])

    plain = model()
    plain.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2), loss="mse")
    plain.fit(x, y, batch_size=K * B, epochs=1, shuffle=False, verbose=0)
    wrapped = ga.Model(model(), config)
    wrapped.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2), loss="mse")
    wrapped.fit(x, y, batch_size=K * B, epochs=1, shuffle=False, verbose=0)
    assert max_diff(wrapped.get_weights(), plain.get_weights()) < 1e-6
    assert int(wrapped.optimizer.iterations) == UPDATES and wrapped.optimizer.gradient_accumulation_steps == K
    named = ga.Model(model(), config)  # an optimizer given by name is accumulated too
    named.compile(optimizer="sgd", loss="mse")
    assert named.optimizer.gradient_accumulation_steps == K
    with pytest.raises(ConfigError, match="neither the global batch 12 nor the per-device batch 3"):
        wrapped.fit(x, y, batch_size=5, verbose=0)
    with pytest.raises(ConfigError, match="trains on one device; init\\(\\) found 2"):
        ga.Model(model(), init(K * B, B, world_size=2))
