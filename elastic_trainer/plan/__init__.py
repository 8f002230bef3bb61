"""Planning: the `Layout` of a run, and choosing one from a memory and step-time model (`plan`).

Pure functions only: nothing here touches tensors or process groups.
"""

from elastic_trainer.plan.candidates import Candidate, PlanError, Request
from elastic_trainer.plan.hardware import Hardware, hardware_for_device, load_hardware
from elastic_trainer.plan.layout import Layout, LayoutError, factorizations, split_batch, stage_layers
from elastic_trainer.plan.planner import Plan, plan

__all__ = [
    "Layout",
    "LayoutError",
    "factorizations",
    "split_batch",
    "stage_layers",
    "Candidate",
    "PlanError",
    "Request",
    "Hardware",
    "hardware_for_device",
    "load_hardware",
    "Plan",
    "plan",
]
