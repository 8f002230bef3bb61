"""The memory model's parameter, gradient and AdamW bytes equal what each rank really holds.

Each layout trains one step of gpt-tiny (vocab 50257, so dp=3 splits the embedding unevenly and FSDP2 pads)
on forked gloo ranks. Every rank then adds up the storages (each counted once) behind its parameters'
local tensors, their gradients and the optimizer's exp_avg, exp_avg_sq and step, and the test compares
those sums byte for byte with `state_bytes` for that rank's stage and dp rank. In zero1 the parameters
also take the fp32 master shard, the gradients the buffer and the reduced shard (parallel/zero.py), and
the optimizer's state is that of the master shard's views. It also checks that the stage holds exactly
the parameters `stage_shapes` lists.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from elastic_trainer.config import TrainConfig, load_model_config
from elastic_trainer.parallel import build_mesh
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout
from elastic_trainer.plan.memory import stage_shapes, state_bytes
from elastic_trainer.train import Trainer

MODEL = load_model_config("gpt-tiny")


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def held_bytes(rank: int, world: int, layout: Layout, dtype: str) -> dict:
    tokens = np.random.default_rng(rank).integers(0, MODEL.vocab_size, 4096).astype(np.int64)
    cfg = TrainConfig(global_batch=layout.global_batch, seq_len=8, steps=1, dtype=dtype)
    trainer = Trainer(MODEL, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    trainer.train_step()
    engine = trainer.engine
    params = dict(engine.model.named_parameters())
    trained = [t for _, t in engine.trained_params()]  # the parameters, or zero1's master shard views
    buffers = ([engine.zero.master], [engine.zero.buffer, engine.zero.grad_shard]) if engine.zero else ([], [])
    state = [trainer.optimizer.state[t] for t in trained]
    grads = [t.grad for t in [*params.values(), *trained] if t.grad is not None]
    return {
        "stage": engine.coords.pp,
        "dp_rank": engine.coords.dp,
        "names": sorted(params),
        "params": _storage_bytes([*params.values(), *buffers[0]]),
        "grads": _storage_bytes([*grads, *buffers[1]]),
        "optimizer": _storage_bytes(t for s in state for t in (s["exp_avg"], s["exp_avg_sq"], s["step"])),
    }


# (dp, tp, pp, dp_mode, dtype): no wrapper, uneven FSDP shards, replicated with tp, a 3-stage pipeline with
# tp (middle stage without embeddings), all three dimensions, bf16 mixed precision (fp32 master state);
# zero1 with uneven shards, with tp, with a pipeline in bf16 (whole bf16 parameters), and on one rank
LAYOUTS = [
    (1, 1, 1, "fsdp", "fp32"),
    (3, 1, 1, "fsdp", "fp32"),
    (2, 2, 1, "ddp", "fp32"),
    (1, 2, 3, "fsdp", "fp32"),
    (2, 2, 2, "fsdp", "fp32"),
    (2, 1, 2, "ddp", "bf16"),
    (2, 1, 2, "fsdp", "bf16"),
    (3, 1, 1, "zero1", "fp32"),
    (2, 2, 1, "zero1", "fp32"),
    (2, 1, 2, "zero1", "bf16"),
    (1, 1, 1, "zero1", "fp32"),
]


@pytest.mark.parametrize("dp, tp, pp, mode, dtype", LAYOUTS, ids=lambda v: str(v))
def test_state_bytes_equal_bytes_held_on_every_rank(dp, tp, pp, mode, dtype):
    layout = Layout(dp, tp, pp, micro_batch=1, num_microbatches=2, dp_mode=mode)
    for held in run_ranks(held_bytes, layout.world_size, layout, dtype):
        stage, dp_rank = held["stage"], held["dp_rank"]
        assert held["names"] == sorted(name for name, _ in stage_shapes(MODEL, layout, stage))
        predicted = state_bytes(MODEL, layout, stage, dp_rank, dtype)
        assert (held["params"], held["grads"], held["optimizer"]) == (
            predicted.params,
            predicted.grads,
            predicted.optimizer,
        ), f"stage {stage}, dp rank {dp_rank}"


def kept_after_steps(rank: int, world: int, layout: Layout) -> dict:
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, 4096).astype(np.int64)
    cfg = TrainConfig(global_batch=layout.global_batch, seq_len=8, steps=2, dtype="fp32")
    trainer = Trainer(MODEL, cfg, layout, build_mesh(layout, "cpu"), torch.device("cpu"), tokens=tokens)
    # rank 1 holds 256 MiB more than rank 0, in pages of its own: a tensor could reuse free heap the fork
    # inherited, already resident (in CI a 48 MiB tensor left rank 1 1.7 MiB ahead)
    ballast = mmap.mmap(-1, rank * 256 * 2**20 + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(ballast, dtype=torch.uint8).fill_(1)  # written: resident
    records = [trainer.train_step() for _ in range(2)]
    with open("/proc/self/status") as f:  # this rank's own reading, right after its last step
        anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    return {"kept": [r["kept_memory_gib"] for r in records], "anon": anon, "ballast": len(ballast)}


def test_every_rank_records_the_largest_rank_s_kept_memory():
    """Each CPU step record carries the anonymous memory of the rank holding the most (train/loop.py): the same
    figure on every rank, the larger rank's own /proc reading (its 256 MiB ballast included), not its own."""
    ranks = run_ranks(kept_after_steps, 2, Layout(2, 1, 1, 2, 1, dp_mode="ddp"))
    largest = max(r["anon"] for r in ranks) / 2**30
    assert ranks[1]["anon"] - ranks[0]["anon"] > 200 * 2**20
    for r in ranks:
        assert r["kept"][-1] == ranks[0]["kept"][-1]
        assert r["kept"][-1] == pytest.approx(largest, abs=8 / 1024)  # within 8 MiB of the reading after it
