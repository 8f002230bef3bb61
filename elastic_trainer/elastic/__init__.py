"""Scale events and the restart contract: stop requests (SIGTERM, stop file) and exit codes, schedules,
the event record, and the phase/downtime report built from it."""

from elastic_trainer.elastic.exit_codes import EXIT_REJOIN, EXIT_STOPPED, PEER_REASON, exit_code
from elastic_trainer.elastic.stop import StopRequest

__all__ = ["EXIT_REJOIN", "EXIT_STOPPED", "PEER_REASON", "StopRequest", "exit_code"]
