"""Stop requests: SIGTERM or a stop file asks the job to finish its current step, save and exit.

Every rank polls its local flag after each step and the flags are combined with one all-reduce, so all
ranks stop after the same step even when only one of them got the signal.
"""

from __future__ import annotations

import os
import signal

# Exit code of a plain process that stopped on request after saving (0 means it reached its last step).
EXIT_STOPPED = 3
# Exit code of a TorchElastic worker that stopped (after saving) only because other ranks were asked to, when
# PEER_STOP_ENV says to rejoin: its agent restarts it in a new rendezvous with the hosts that remain.
EXIT_REJOIN = 75
PEER_STOP_ENV = "ELASTIC_TRAINER_PEER_STOP"
PEER_REASON = "requested on another rank"


def exit_code(status: str, reason: str | None = None) -> int:
    """The restart contract. A plain process that stopped (after saving) exits EXIT_STOPPED. Under torchrun it
    exits 0: any other code makes the agent restart the workers, which would resume and train on in the old
    size. Whoever asked for the stop (the launcher at a phase end, a scheduler's SIGTERM) learns that it
    happened from the `stopping` and `saved` events and the checkpoint, not from the code.

    One exception, where the environment asks for it (`ELASTIC_TRAINER_PEER_STOP=rejoin`, set by the
    Kubernetes manifest): a worker that stopped only because other ranks were (`reason` PEER_REASON: a pod
    removed by a scale-down got SIGTERM, the others did not) exits EXIT_REJOIN, so that its agent re-forms the
    group with the pods that remain instead of ending the job. The launcher does not set it: it stops every
    host itself at a phase end, and a rank that saw the stop file a moment later must not start a new round."""
    if status == "stopped" and "TORCHELASTIC_RUN_ID" not in os.environ:
        return EXIT_STOPPED
    if status == "stopped" and reason == PEER_REASON and os.environ.get(PEER_STOP_ENV) == "rejoin":
        return EXIT_REJOIN
    return 0


class StopRequest:
    def __init__(self, stop_file: str | None = None, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.stop_file = stop_file
        self.reason: str | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame) -> None:
        self.reason = signal.Signals(signum).name

    def local(self) -> bool:
        """Whether this rank has been asked to stop."""
        if self.reason is None and self.stop_file and os.path.exists(self.stop_file):
            self.reason = f"stop file {self.stop_file}"
        return self.reason is not None

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
