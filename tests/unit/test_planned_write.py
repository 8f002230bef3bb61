"""The hand-over's write planned ahead (checkpoint/planned.py), in one process:

- a write planned before the values change (as a world plans its hand-over while it waits, then trains)
  stores every piece where DCP's save of the new values on the spot stores it, on 1 and 3 threads: the same
  files, offsets and lengths, and the same metadata once completed; the state reads back equal;
- a plan refuses a state it was not made for: an item more or less, a tensor of another shape or dtype, a
  tensor that became a plain value or the reverse (`raw.StalePlan`, so that `memory.write` falls back to
  DCP's save);
- files allocated ahead (checkpoint/spare.py) are the ones written into, and end as large as new files;
- repeated non-tensor values are serialized once, yet 1, 1.0 and True (equal and of equal hash in Python)
  read back as what they were.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import planned, raw, spare
from tests.unit.test_raw_checkpoint import assert_equal, blank, load, state


def prepare(like: dict, threads: int) -> planned.Prepared:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" warning
        return planned.prepare(None, like, threads)


def later() -> dict:
    """`state()`'s structure with other values: what the state holds when the world hands over."""
    out = state()
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            out[key] = value * 3 + 1
    out["hyper"] = {"lr": 0.0005, "betas": [0.9, 0.99]}
    return out


def write(prepared: planned.Prepared, values: dict, folder, spares=None) -> tuple[dict, object]:
    folder.mkdir()
    late, pieces = planned.write(prepared, values, folder, spares)
    return pieces, planned.metadata(prepared, [late], None)


@pytest.mark.parametrize("ahead", [False, True], ids=["new-files", "allocated-ahead"])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_planned_write_is_the_write_dcp_plans_on_the_spot(tmp_path, threads, ahead):
    prepared = prepare(state(), threads)
    larger = {name: size + 4096 for name, size in planned.sizes(prepared).items()}  # cut to size when written
    allocated = spare.Spares(tmp_path / "shm", larger).start() if ahead else None
    files, _ = allocated.take() if ahead else ({}, 0.0)
    inodes = {name: path.stat().st_ino for name, path in files.items()}
    assert len(inodes) == (threads if ahead else 0)
    assert all(path.stat().st_blocks * 512 >= allocated.sizes[name] > 0 for name, path in files.items())
    pieces, metadata = write(prepared, later(), tmp_path / "planned", files)
    spot = raw.Writer(tmp_path / "dcp", thread_count=threads)  # DCP's save of the same values, planned now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(later(), storage_writer=spot, no_dist=True)
    assert {i: p.info for i, p in pieces.items()} == {i: p.info for i, p in spot.pieces.items()}
    on_the_spot = raw.Reader(str(tmp_path / "dcp")).read_metadata()
    assert metadata.storage_data == on_the_spot.storage_data
    assert metadata.state_dict_metadata == on_the_spot.state_dict_metadata
    for piece in pieces.values():  # the tensor bytes too
        a = (tmp_path / "planned" / piece.info.relative_path).read_bytes()[piece.info.offset :][: piece.info.length]
        b = (tmp_path / "dcp" / piece.info.relative_path).read_bytes()[piece.info.offset :][: piece.info.length]
        assert piece.is_bytes or a == b
    for name in {p.info.relative_path for p in pieces.values()}:  # as large as DCP's, written where allocated
        assert (tmp_path / "planned" / name).stat().st_size == (tmp_path / "dcp" / name).stat().st_size
        assert (tmp_path / "planned" / name).stat().st_ino == inodes.get(
            name, (tmp_path / "planned" / name).stat().st_ino
        )
    if ahead:
        allocated.remove()
        assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").iterdir())
    got = blank(later())
    load(got, raw.Reader(str(tmp_path / "planned"), metadata=metadata))
    assert_equal(got, later())


def _more(s):
    s["extra"] = torch.zeros(2)


def _less(s):
    del s["steps"]


def _shape(s):
    s["w"] = torch.zeros(17, 33)


def _dtype(s):
    s["w"] = s["w"].double()


def _not_a_tensor(s):
    s["scalar"] = 3.25


def _now_a_tensor(s):
    s["hyper"]["lr"] = torch.tensor(0.0005)


@pytest.mark.parametrize("change", [_more, _less, _shape, _dtype, _not_a_tensor, _now_a_tensor])
def test_a_plan_refuses_a_state_it_was_not_made_for(tmp_path, change):
    prepared = prepare(state(), 1)
    other = later()
    change(other)
    with pytest.raises(raw.StalePlan):
        write(prepared, other, tmp_path / "planned")


def test_repeated_plain_values_are_serialized_once_and_keep_their_type(tmp_path):
    values = {
        "int": 1,
        "float": 1.0,
        "bool": True,
        "ints": (1, 2),
        "floats": (1.0, 2.0),
        "none": None,
        "again": 1.0,
        "w": torch.ones(3),
    }
    prepared = prepare(values, 1)
    _, metadata = write(prepared, values, tmp_path / "planned")
    got = {k: (torch.zeros(3) if k == "w" else None) for k in values}
    load(got, raw.Reader(str(tmp_path / "planned"), metadata=metadata))
    assert torch.equal(got.pop("w"), values["w"])
    assert [(type(got[k]), got[k]) for k in got] == [(type(values[k]), values[k]) for k in got]
    assert [type(x) for x in got["ints"]] == [int, int] and [type(x) for x in got["floats"]] == [float, float]
