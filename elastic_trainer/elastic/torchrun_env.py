"""torchrun's environment, read in this module only and checked once: the one object a rank learns its place
from (rank, world, host, restart count) and that says whether it runs under TorchElastic at all.

`TorchrunEnv.read()` raises a one-line ConfigError naming the variable on bad values (all or none of RANK and
WORLD_SIZE, ranks in range, a port, an address); `preflight` calls it before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_trainer.config import ConfigError


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, str(default))
    if not (raw.isascii() and raw.isdigit()) or int(raw) < minimum:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer >= {minimum}")
    return int(raw)


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int | None = None
    """This host's index in the rendezvous (None outside torchrun)."""
    restart_count: int | None = None
    """Worker-group restarts so far (None outside torchrun)."""
    run_id: str | None = None
    """TORCHELASTIC_RUN_ID: set when TorchElastic started this process."""
    error_file: str | None = None
    """Where TorchElastic's agent reads a failed worker's error."""
    distributed: bool = False
    """RANK and WORLD_SIZE are set: join an env:// process group."""

    @property
    def under_torchrun(self) -> bool:
        return self.run_id is not None

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> TorchrunEnv:
        """The variables of `env` (default os.environ), checked."""
        env = os.environ if env is None else env
        if ("RANK" in env) != ("WORLD_SIZE" in env):
            given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise ConfigError(
                f"environment variable {given} is set but {missing} is not (torchrun sets both; "
                f"unset {given} to train as one process)"
            )
        world = _int(env, "WORLD_SIZE", 1, 1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world if "RANK" in env else 1, 1)
        rank, local_rank = _int(env, "RANK", 0, 0), _int(env, "LOCAL_RANK", 0, 0)
        if rank >= world:
            raise ConfigError(f"environment variable RANK={rank} must be below WORLD_SIZE={world}")
        if "RANK" in env and local_rank >= local_world:
            raise ConfigError(
                f"environment variable LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world}"
            )
        if "RANK" in env:
            port = _int(env, "MASTER_PORT", 29500, 1)
            if port > 65535:
                raise ConfigError(f"environment variable MASTER_PORT={port} is not a port (valid: 1-65535)")
            if not env.get("MASTER_ADDR", "localhost").strip():
                raise ConfigError(
                    "environment variable MASTER_ADDR is empty (valid: the rank-0 host's name or address)"
                )
        group = _int(env, "GROUP_RANK", 0, 0) if "GROUP_RANK" in env else None
        restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0) if "TORCHELASTIC_RESTART_COUNT" in env else None
        return cls(
            rank,
            world,
            local_rank,
            local_world,
            group,
            restarts,
            env.get("TORCHELASTIC_RUN_ID"),
            env.get("TORCHELASTIC_ERROR_FILE") or None,
            "RANK" in env,
        )

    @classmethod
    def lenient(cls) -> TorchrunEnv:
        """The environment for code that only reports (which host prints a line): defaults where it is bad."""
        try:
            return cls.read()
        except ConfigError:
            return cls(run_id=os.environ.get("TORCHELASTIC_RUN_ID"))


def int_variable(name: str, default: int, minimum: int) -> int:
    """One of torchrun's integer variables on its own (for APIs that take WORLD_SIZE or RANK alone, as Run:AI's
    `init` does), checked as `TorchrunEnv.read` checks it."""
    return _int(os.environ, name, default, minimum)
