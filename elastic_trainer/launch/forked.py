"""What a worker forked by the agent (launch/agent.py) does first, so that it starts as a spawned one would:
exec's signal handlers, and CUDA that its agent has not poisoned."""

from __future__ import annotations

import signal

START_ENV = "ELASTIC_TRAINER_WORKER_START"
"""`spawn` makes the agent start fresh interpreters, as plain torchrun does (default `fork`)."""
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""torch's switch that makes torch.cuda.is_available() ask NVML, which does not poison fork (launch/agent.py
sets it before TorchElastic's LaunchConfig asks)."""


def refuse_poisoned_cuda() -> None:
    """A worker forked from an agent that had used CUDA cannot use it: say so in one line, with the way out."""
    import torch

    if torch.cuda._is_in_bad_fork() and torch.cuda.is_available():
        raise RuntimeError(
            f"this host's agent used CUDA before forking its workers, so they cannot; run the agent "
            f"with {START_ENV}=spawn (workers start fresh interpreters) and report it as a bug"
        )


def signals_as_after_exec() -> None:
    """Give a forked worker the signal handlers a spawned one has: exec resets every handled signal to its
    default (SIGINT: KeyboardInterrupt) and keeps the ignored ones. A fork keeps the agent's Python handlers
    instead: a launcher's agent takes SIGTERM as a scheduler's notice (launch/notices.py), so a worker SIGTERMed
    while its own stop handler is not installed (by its agent stopping the group after another worker died,
    during setup or the teardown) posted that its host was going away, and the launcher re-formed the job
    without a healthy host."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except ValueError:
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
