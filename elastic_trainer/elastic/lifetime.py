"""A process that dies with its parent.

torchrun starts each worker in a session of its own, so when an agent is killed (SIGKILL, a lost host) its
workers would live on, orphaned, still holding their ranks in the job: the surviving agents would never see
the loss. A worker (and the agent under the launcher) asks the kernel for SIGKILL when its parent exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Deliver `sig` to this process when its parent exits (Linux); False where that is not available."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
    return True
