"""FSDP2's copies counted in a real step on forked ranks, as plan/traffic.py counts them."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from elastic_trainer.config import load_model_config
from elastic_trainer.parallel.calibrate_modes import probe_trainer
from elastic_trainer.parallel.local_ranks import run_ranks
from elastic_trainer.plan.layout import Layout


def counted_step(rank: int, world: int, layout: Layout) -> dict[str, int]:
    """{'root unshards', 'block unshards', 'root reductions', 'block reductions'} of one step after a warm-up,
    summed over this rank's units (blocks: per block)."""
    counts: collections.Counter = collections.Counter()
    group_cls = _fsdp_param_group.FSDPParamGroup
    wait, reduce = group_cls.wait_for_unshard, _fsdp_param_group.foreach_reduce
    current = {}

    def kind(group) -> str:
        return "root" if any(hasattr(m, "layers") for m in group.modules) else "block"

    def counting_wait(self):
        if self._all_gather_result is not None:  # an unshard to copy out (or, in a group of one, to copy in)
            counts[f"{kind(self)} unshards"] += 1
        return wait(self)

    def counting_reduce(*args, **kwargs):
        counts[f"{current['kind']} reductions"] += 1
        return reduce(*args, **kwargs)

    post_backward = group_cls.post_backward

    def tracking_post_backward(self, *args, **kwargs):
        current["kind"] = kind(self)
        return post_backward(self, *args, **kwargs)

    group_cls.wait_for_unshard, _fsdp_param_group.foreach_reduce = counting_wait, counting_reduce
    group_cls.post_backward = tracking_post_backward
    trainer = probe_trainer(load_model_config("gpt-tiny"), layout, 32, torch.device("cpu"), "fp32", 2)
    trainer.train_step()
    counts.clear()
    trainer.train_step()
    return {**counts, "blocks": len(trainer.engine.model.layers)}


def per_unit(counts: dict[str, int]) -> dict[str, float]:
    return {k: v / (counts["blocks"] if k.startswith("block") else 1) for k, v in counts.items() if k != "blocks"}


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_unshards_and_reductions_per_step_as_the_model_counts_them(mode):
    micro = 3
    unpiped = Layout(2, 1, 1, 1, micro, dp_mode=mode)
    got = per_unit(run_ranks(counted_step, 2, unpiped, timeout=300)[0])
    if mode == "fsdp":
        assert got == {
            "block unshards": 2 * micro,
            "root unshards": micro,
            "block reductions": micro,
            "root reductions": micro,
        }
    else:
        assert got == {"block unshards": micro, "root unshards": micro, "block reductions": 1, "root reductions": 1}
    piped = Layout(2, 1, 2, 1, micro, dp_mode=mode)
    got = per_unit(run_ranks(counted_step, 4, piped, timeout=300)[0])
    assert got == {"block unshards": 1, "root unshards": 1, "block reductions": 1, "root reductions": 1}
