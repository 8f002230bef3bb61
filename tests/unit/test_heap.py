"""train/heap.py: what `settle` takes out of the garbage collector's walks, and what `release` gives back."""

from __future__ import annotations

import gc
import weakref

from elastic_trainer.train import heap


class Node:
    pass


def cycle() -> weakref.ref:
    """An object in a reference cycle that nothing else holds: only the cyclic collector frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settle_collects_first_then_keeps_the_collector_off_what_lives_and_release_gives_it_back():
    try:
        garbage = cycle()
        heap.settle(collect=True)
        assert garbage() is None  # collected before the freeze: nothing dead is kept for good
        assert gc.get_freeze_count() > 0
        kept = cycle()
        heap.settle()  # no collection: this cycle is frozen with the rest
        gc.collect()
        assert kept() is not None  # the collector no longer walks it ...
        heap.release()
        gc.collect()
        assert kept() is None and gc.get_freeze_count() == 0  # ... until it is given back
    finally:
        heap.release()
