import pytest

from elastic_trainer.config import load_model_config
from elastic_trainer.plan.layout import Layout, LayoutError, factorizations, parse_degrees, split_batch, stage_layers

TINY = load_model_config("gpt-tiny")  # 4 layers, 4 heads
XL = load_model_config("gpt3-xl")  # 24 layers, 16 heads


def test_valid_layout_properties():
    layout = Layout(2, 2, 2, micro_batch=2, num_microbatches=2).validate(8, TINY, 8)
    assert layout.world_size == 8 and layout.global_batch == 8 and layout.local_batch == 4


@pytest.mark.parametrize(
    "layout, world, model, batch, message",
    [
        (Layout(2, 1, 1, 4, 1), 4, TINY, 8, "does not match world size 4 (valid DP,TP,PP: 4,1,1 2,1,2 1,1,4 2,2,1"),
        (Layout(1, 3, 1, 8, 1), 3, XL, 8, "tp=3 does not divide n_heads=16 (valid: 1, 2, 4, 8, 16)"),
        (Layout(1, 1, 5, 8, 1), 5, TINY, 8, "pp=5 exceeds n_layers=4"),
        (Layout(2, 1, 1, 2, 1), 2, TINY, 8, "= 4 does not equal global batch 8"),
    ],
)
def test_invalid_layouts_name_value_and_choices(layout, world, model, batch, message):
    with pytest.raises(LayoutError) as err:
        layout.validate(world, model, batch)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "micro_batch", "num_microbatches"])
def test_non_positive_degrees_rejected(field):
    values = dict(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=1)
    values[field] = 0
    with pytest.raises(LayoutError, match=f"{field}=0"):
        Layout(**values)


def test_unknown_dp_mode_rejected():
    with pytest.raises(LayoutError, match="dp_mode='zero3' is not one of fsdp, ddp, zero1"):
        Layout(1, 1, 1, 1, 1, dp_mode="zero3")


def test_split_batch():
    assert split_batch(8, 2) == (4, 1)
    assert split_batch(8, 2, 2) == (2, 2)
    with pytest.raises(LayoutError, match=r"global batch 10 is not divisible by dp=4 \(valid dp: 1, 2, 5, 10\)"):
        split_batch(10, 4)
    with pytest.raises(LayoutError, match=r"micro_batch=3 does not divide .* = 4 \(valid: 1, 2, 4\)"):
        split_batch(8, 2, 3)


def test_parse_degrees():
    assert parse_degrees("2,1,2") == (2, 1, 2)
    for bad in ("2,1", "a,b,c", "0,1,1", "1,1,1,1"):
        with pytest.raises(LayoutError, match="DP,TP,PP"):
            parse_degrees(bad)


@pytest.mark.parametrize("world", [1, 2, 6, 8, 12, 16])
def test_factorizations_are_complete_and_exact(world):
    found = factorizations(world)
    brute = {
        (d, t, p)
        for d in range(1, world + 1)
        for t in range(1, world + 1)
        for p in range(1, world + 1)
        if d * t * p == world
    }
    assert set(found) == brute and len(found) == len(brute)


@pytest.mark.parametrize("n_layers, pp", [(4, 1), (4, 2), (4, 3), (4, 4), (24, 5), (24, 7), (24, 24)])
def test_stage_layers_balanced_contiguous(n_layers, pp):
    stages = stage_layers(n_layers, pp)
    assert len(stages) == pp
    assert [i for r in stages for i in r] == list(range(n_layers))
    sizes = [len(r) for r in stages]
    assert max(sizes) - min(sizes) <= 1
    assert sizes[-1] == min(sizes)  # the last stage also carries the head


def test_stage_layers_rejects_too_many_stages():
    with pytest.raises(LayoutError, match="pp=5 must be between 1 and n_layers=4"):
        stage_layers(4, 5)
