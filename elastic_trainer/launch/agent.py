"""The agent of one host: TorchElastic's agent, as the torchrun command line configures it, in a process that
dies with its parent (the launcher, or remote.sh on another host), so no agent outlives its job.

    python -m elastic_trainer.launch.agent TORCHRUN-ARGS... -m elastic_trainer.cli train ...

When the workers run `elastic_trainer.cli`, the agent imports the training stack once and forks its workers
(TorchElastic's `start_method="fork"` with a function entrypoint) instead of starting fresh interpreters: each
new interpreter spends ~2.4 s of CPU importing torch, DTensor, FSDP, DCP and the pipeline schedules, which
on a host with few cores per rank was most of a reconfiguration's downtime. Everything else (rendezvous,
restarts, membership changes, error files) is TorchElastic's, unchanged. Any other entrypoint runs exactly as
under torchrun. The agent never touches CUDA, so forked workers can still use it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from elastic_trainer.elastic.lifetime import die_with_parent

WORKER_MODULE = "elastic_trainer.cli"
START_ENV = "ELASTIC_TRAINER_WORKER_START"
"""`spawn` makes the agent start fresh interpreters, as plain torchrun does (default `fork`)."""


def preload() -> None:
    """Import what every worker imports, so forked workers start with it loaded (no CUDA calls here)."""
    import torch.distributed.pipelining  # noqa: F401  (torch._dynamo)

    import elastic_trainer.cli  # noqa: F401
    import elastic_trainer.data  # noqa: F401
    import elastic_trainer.parallel.agree  # noqa: F401
    import elastic_trainer.train  # noqa: F401


def worker(*argv: str) -> int:
    """A forked worker: `elastic-trainer ARGV`; a non-zero code fails the worker as a process exit would."""
    from elastic_trainer import cli

    code = cli.main(list(argv), started=time.time(), forked=True)
    if code:
        raise SystemExit(code)
    return code


def main(argv: list[str] | None = None) -> None:
    # SIGTERM, not SIGKILL: TorchElastic turns it into stopping the workers (which save if they can).
    die_with_parent(signal.SIGTERM)
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config, entrypoint, entry_args = config_from_args(args)
    forking = os.environ.get(START_ENV, "fork") == "fork"
    if forking and args.module and args.training_script == WORKER_MODULE and not args.no_python:
        preload()
        config.start_method = "fork"
        entrypoint, entry_args = worker, list(args.training_script_args)
    elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)  # raises when the workers failed
    # Success: its workers are gone and its output flushed; skip the interpreter's teardown of torch (about a
    # second on a busy host), which would only delay the next phase's start.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
