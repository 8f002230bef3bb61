"""Waiting for a key of a c10d store by asking `check`, not `wait`.

`store.wait(keys, timeout)` makes c10d's client log two warnings ("waitForInput: poll ... likely a timeout")
each time its timeout passes, and the waits here are sliced so that a stop request is seen: a warm world
waiting a minute for its state wrote 120 such lines per rank into its host's log (seen on an H100 lease,
2026-11-26; torch 2.11 and 2.13 alike). `check` is one round trip that answers at once; a waiter asks every
`interval_s`, which `poll_interval` sets so that a whole world's waiting ranks stay within a fixed request rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HANDOVER_POLL_S = 0.05
"""How often a rank asks for a hand-over's keys: at most 50 ms on the critical path (the state's write takes
longer on any real model)."""
STORE_REQUESTS_PER_S = 640.0
"""What a world's waiting ranks together ask of the launcher's store at most: 32 ranks every 50 ms; a larger
world asks less often each (1024 ranks: every 1.6 s, while their state takes far longer to write)."""


def poll_interval(waiters: int) -> float:
    """Seconds between one rank's requests when `waiters` ranks wait for the same key."""
    return max(HANDOVER_POLL_S, waiters / STORE_REQUESTS_PER_S)


def wait_key(store, key: str, give_up: Callable[[], bool], interval_s: float = HANDOVER_POLL_S) -> bool:
    """True once `key` is set in `store`; False when `give_up()` turns true first. A store that does not answer
    raises (its RuntimeError or OSError): what that means is the caller's to say."""
    while not give_up():
        if store.check([key]):
            return True
        time.sleep(interval_s)
    return False
