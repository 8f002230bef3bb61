"""Run a function on N gloo ranks forked from the test process: see `elastic_trainer.parallel.local_ranks`
(the benchmark and `elastic-trainer calibrate` use the same helper)."""

from elastic_trainer.parallel.local_ranks import run_ranks

__all__ = ["run_ranks"]
