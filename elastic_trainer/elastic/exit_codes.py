"""The restart contract in one place: how a rank, an agent and the launcher tell each other how a job ended.

| code | who | meaning |
|---|---|---|
| 0 | rank, agent, launcher | finished, or stopped after saving (under torchrun: see `exit_code`) |
| EXIT_BAD_INPUT (2) | any | one line naming the bad input (or a diverged run); never restarted |
| EXIT_STOPPED (3) | a plain process | stopped on request after saving |
| EXIT_REJOIN (75) | a torchrun worker | stopped only because its peers were, and asks its agent to re-form the group |
| EXIT_FENCED (76) | a launcher's agent | woke after its host was cut off (launch/heartbeat.py); workers unsaved |
| 128 + N | an agent | stopped by signal N (its ranks saved) |

A bad-input line starts with ERROR_MARK wherever it is printed (the CLI, the agent, a rank's error file), which
is how the launcher picks the rank's error out of the hosts' output.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_REJOIN = 75
EXIT_FENCED = 76
ERROR_MARK = "elastic-trainer: error: "
PEER_STOP_ENV = "ELASTIC_TRAINER_PEER_STOP"
PEER_REASON = "requested on another rank"
FINAL_CODES = (EXIT_BAD_INPUT, EXIT_REJOIN)
"""Worker codes TorchElastic must not report as a crash with a traceback (the first is final, the second a
planned rejoin)."""


def error_line(message: str) -> str:
    """The one line of a bad-input error."""
    return ERROR_MARK + (" ".join(str(message).split()) or "error")


def exit_code(status: str, reason: str | None, *, under_torchrun: bool, peer_stop: str | None = None) -> int:
    """A rank's exit code after its job returned `status` ("finished" or "stopped", with `reason`).

    A plain process that stopped (after saving) exits EXIT_STOPPED. Under torchrun it exits 0: any other code
    makes the agent restart the workers, which would resume and train on in the old size. Whoever asked for the
    stop (the launcher at a phase end, a scheduler's SIGTERM) learns that it happened from the `stopping` and
    `saved` events and the checkpoint, not from the code.

    One exception, where the environment asks for it (`ELASTIC_TRAINER_PEER_STOP=rejoin`, set by the Kubernetes
    manifest; `peer_stop` is its value): a worker that stopped only because other ranks were (`reason`
    PEER_REASON: a pod removed by a scale-down got SIGTERM, the others did not) exits EXIT_REJOIN, so that its
    agent re-forms the group with the pods that remain instead of ending the job. The launcher does not set it:
    it stops every host itself at a phase end, and a rank that saw the stop file a moment later must not start
    a new round."""
    if status == "stopped" and not under_torchrun:
        return EXIT_STOPPED
    if status == "stopped" and reason == PEER_REASON and peer_stop == "rejoin":
        return EXIT_REJOIN
    return 0
