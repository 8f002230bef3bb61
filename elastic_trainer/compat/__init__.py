"""Run:AI-style API: `init(global_batch_size, max_gpu_batch_size)` and gradient-accumulation optimizers.

    cfg = compat.init(global_batch_size=256, max_gpu_batch_size=64)   # on 2 GPUs: cfg.steps == 2, batch 64
    opt = compat.GradientAccumulation(torch.optim.AdamW(model.parameters()), cfg.steps)
    opt = compat.optim.AdamW(model.parameters(), lr=3e-4, steps=cfg.steps)   # the same, ready-made

One deliberate difference from Run:AI: `init` returns a frozen `ElasticConfig` instead of setting module
globals (`runai.elastic.steps`), because this project keeps no module-level mutable state.
The Keras 3 adapter is `elastic_trainer.compat.keras`; importing this package does not import keras.
Nothing in the core trainer imports this package.
"""

from elastic_trainer.compat import accumulating_optim as optim  # compat.optim.AdamW(...): the public name
from elastic_trainer.compat.accumulation import GradientAccumulation
from elastic_trainer.compat.runai import ElasticConfig, init

__all__ = ["ElasticConfig", "GradientAccumulation", "init", "optim"]
