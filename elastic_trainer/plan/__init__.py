"""Planning: the `Layout` of a run (and, later, choosing one from a memory and step-time model).

Pure functions only: nothing here touches tensors or process groups.
"""

from elastic_trainer.plan.layout import Layout, LayoutError, factorizations, split_batch, stage_layers

__all__ = ["Layout", "LayoutError", "factorizations", "split_batch", "stage_layers"]
