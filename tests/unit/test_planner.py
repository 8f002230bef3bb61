"""The planner: complete enumeration (against brute force), valid and ranked choices, GPT-3 XL on H100 hosts
against Tenplex's hand-written table, and one-line advice when nothing works."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.plan import PlanError, Request, load_hardware, plan
from elastic_trainer.plan.candidates import enumerate_candidates
from elastic_trainer.plan.layout import stage_layers
from elastic_trainer.plan.memory import peak_memory
from elastic_trainer.plan.report import candidate_dict, plan_dict
from elastic_trainer.plan.step_time import step_time

XL = load_model_config("gpt3-xl")
TINY = load_model_config("gpt-tiny")
H100 = load_hardware("h100-80g")
TENPLEX = {16: (2, 2, 4), 8: (1, 2, 4), 4: (1, 2, 2)}  # dp, tp, pp of Tenplex's GPT-3 XL runs


def xl_request(gpus: int, hardware=H100, **kw) -> Request:
    return Request(XL, gpus, 128, 1024, hardware, 8, **kw)


def brute_force(req: Request) -> set:
    """Every (dp, tp, pp, micro, accumulation, mode, recompute) satisfying the rules, by exhaustive search."""
    n, b = req.world_size, req.global_batch
    found = set()
    for dp, tp, pp, m, a in itertools.product(range(1, n + 1), range(1, n + 1), range(1, n + 1),
                                              range(1, b + 1), range(1, b + 1)):
        hosts_of_tp = {{r // req.gpus_per_host for r in range(g, g + tp)}.__len__() for g in range(0, n, tp)}
        if dp * tp * pp != n or dp * m * a != b or req.model.n_heads % tp or pp > req.model.n_layers \
                or hosts_of_tp != {1}:
            continue
        for mode in (("fsdp", "ddp") if dp > 1 else ("fsdp",)):
            for rc in (False, True):
                found.add((dp, tp, pp, m, a, mode, rc))
    return found


@pytest.mark.parametrize("model, gpus, per_host, batch", [(TINY, 6, 8, 12), (XL, 12, 8, 16), (XL, 16, 4, 8)])
def test_enumeration_matches_brute_force(model, gpus, per_host, batch):
    req = Request(model, gpus, batch, 128, H100, per_host)
    sized = [c for c in enumerate_candidates(req) if c.micro_batch is not None]
    keys = [(c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.dp_mode, c.recompute) for c in sized]
    assert len(keys) == len(set(keys)) and set(keys) == brute_force(req)


@pytest.mark.parametrize("gpus", [16, 8, 4, 12, 6, 2, 1])
def test_gpt3_xl_plans_are_valid_and_keep_the_global_batch(gpus):
    result = plan(xl_request(gpus))
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times)
    for c in (result.chosen, *result.candidates[:20]):
        layout = c.layout.validate(gpus, XL, 128)  # degrees multiply to N, tp | heads, pp <= layers, batch kept
        assert layout.dp * layout.micro_batch * layout.num_microbatches == 128
        assert c.tp <= 8 and 8 % c.tp == 0 or gpus <= 8
        sizes = [len(r) for r in stage_layers(XL.n_layers, c.pp)]
        assert max(sizes) - min(sizes) <= 1
        assert c.memory.total == peak_memory(XL, layout, 1024, "bf16").total <= H100.usable_bytes
        assert c.step_time_s == step_time(XL, layout, 1024, "bf16", H100, 8).total


@pytest.mark.parametrize("gpus", sorted(TENPLEX))
def test_chosen_is_no_slower_than_tenplex_table(gpus):
    result = plan(xl_request(gpus))
    tenplex = result.best_for(*TENPLEX[gpus])
    assert tenplex.valid and tenplex.degrees == TENPLEX[gpus]
    # the same model, evaluated independently of the ranking
    assert result.chosen.step_time_s <= step_time(XL, tenplex.layout, 1024, "bf16", H100, 8).total


def test_rejected_candidates_keep_their_reasons():
    result = plan(xl_request(12))
    reasons = {c.degrees: c.reason for c in result.rejected if c.micro_batch is None}
    assert reasons[(1, 12, 1)] == "tp=12 does not divide n_heads=16"
    assert reasons[(3, 4, 1)] == "dp=3 does not divide the global batch 128"
    assert (1, 1, 12) not in reasons and any(c.degrees == (1, 1, 12) for c in result.candidates)
    small = dataclasses.replace(H100, memory_gb=30.0)
    tight = plan(xl_request(1, hardware=small))
    assert tight.rejected and tight.candidates
    assert all(c.reason.startswith("needs ") and "GiB per GPU > 26.0 GiB usable" in c.reason
               for c in tight.rejected)
    assert all(c.memory.total <= small.usable_bytes for c in tight.candidates)


def test_tp_stays_within_a_host():
    reasons = {c.degrees: c.reason for c in plan(xl_request(32)).rejected if c.micro_batch is None}
    assert reasons[(2, 16, 1)] == "tp=16 groups would span hosts (8 per host)"


def test_many_gpus_plan_and_constraints():
    result = plan(xl_request(1024))
    assert result.chosen.dp * result.chosen.tp * result.chosen.pp == 1024
    assert result.chosen.dp <= 128 and result.chosen.tp <= 8 and result.chosen.pp <= 24


def test_forced_choices_are_respected():
    result = plan(xl_request(8, micro_batch=2, dp_modes=("ddp",), recompute=(True,)))
    assert {(c.micro_batch, c.dp_mode, c.recompute) for c in result.candidates if c.dp > 1} == {(2, "ddp", True)}


@pytest.mark.parametrize("req, message", [
    (xl_request(29), "no DP,TP,PP of 29 GPUs is valid (29,1,1: dp=29 does not divide the global batch 128; "
                     "1,1,29: pp=29 exceeds n_layers=24; 1,29,1: tp=29 does not divide n_heads=16); "
                     "nearest GPU count that works: 28, nearest global batch that works on 29 GPUs: 116"),
    (xl_request(100_000), "100000 GPUs are more than gpt3-xl with global batch 128 can use: at most dp=128 x "
                          "tp=8 x pp=24 = 24576"),
    (xl_request(1, hardware=dataclasses.replace(H100, memory_gb=12.0)),
     "no layout of 1 GPU(s) fits in memory: the smallest (dp=1 tp=1 pp=1 micro_batch=1 recompute) needs"),
    (xl_request(2, micro_batch=3), "micro_batch=3 does not divide the per-replica batch 128/2 = 64"),
])
def test_impossible_requests_say_why_in_one_line(req, message):
    with pytest.raises(PlanError) as err:
        plan(req)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_memory_shortage_suggests_more_gpus_that_work():
    req = xl_request(1, hardware=dataclasses.replace(H100, memory_gb=12.0))
    with pytest.raises(PlanError, match=r"; (\d+) GPUs would work$") as err:
        plan(req)
    more = int(str(err.value).rsplit("; ", 1)[1].split()[0])
    assert plan(dataclasses.replace(req, world_size=more)).chosen.valid
    with pytest.raises(PlanError):
        plan(dataclasses.replace(req, world_size=more - 1))


def test_json_has_chosen_and_ranked_candidates():
    result = plan(xl_request(16))
    out = plan_dict(result, result.best_for(2, 2, 4))
    assert {"dp", "tp", "pp", "micro_batch", "num_microbatches", "memory_gb", "step_time_s"} <= set(out["chosen"])
    assert out["chosen"] == candidate_dict(result.chosen, result.request) == out["candidates"][0]
    assert out["compare"]["step_time_s"] >= out["chosen"]["step_time_s"]
    assert all("reason" in r for r in out["rejected"])
