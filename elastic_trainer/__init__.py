"""elastic_trainer: an elastic data x tensor x pipeline parallel trainer for GPT models."""

import time

__version__ = "0.1.0"

IMPORTED_AT = time.time()
"""When this process first imported the package (for a torchrun worker: within ~0.1 s of its start, before torch
is imported), so its events can tell start-up time apart from the rest."""
