"""Applying a Layout to a model: device mesh, tensor parallel (DTensor), pipeline stages and schedule,
data parallel (FSDP2 or replicated). Nothing here chooses a layout."""

from elastic_trainer.parallel.engine import Engine, resolve_dtype
from elastic_trainer.parallel.mesh import Coords, build_mesh, default_device, init_process_group

__all__ = ["Engine", "resolve_dtype", "Coords", "build_mesh", "default_device", "init_process_group"]
