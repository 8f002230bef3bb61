"""Scale events and the restart contract: stop requests (SIGTERM, stop file) and their exit code.
The schedule- and membership-driven runtime builds on these."""

from elastic_trainer.elastic.stop import EXIT_STOPPED, StopRequest

__all__ = ["EXIT_STOPPED", "StopRequest"]
