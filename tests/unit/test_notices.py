"""launch/notices.py: how the launcher hears of hosts that leave or join (a notice on its store, an edit of the
hosts file), against a real TCPStore and real files."""

from __future__ import annotations

import os
import time

import pytest

from elastic_trainer.elastic.handover import Control
from elastic_trainer.launch.hosts import read_hosts
from elastic_trainer.launch.notices import Notices


@pytest.fixture
def control():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return Control(store, "job")


def write(path, text: str) -> None:
    """A new version of the file, its stamp surely different (as an editor's save or a `mv` would be)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    stamp = time.time_ns() + 10**9
    os.utime(path, ns=(stamp, stamp))


def notices(path, text: str) -> Notices:
    path.write_text(text)
    return Notices(str(path), 4, read_hosts(str(path), 4))


def names(change) -> list[tuple[str, int]]:
    return [(h.name, h.slots) for h in change.hosts]


def test_nothing_changes_without_an_edit_or_a_notice(tmp_path, control):
    n = notices(tmp_path / "hosts", "a slots=2\nb slots=2\n")
    assert n.poll(control, [].append) is None
    os.utime(tmp_path / "hosts", ns=(time.time_ns() + 10**9,) * 2)  # touched, same hosts
    assert n.poll(control, [].append) is None


def test_the_hosts_file_edited(tmp_path, control):
    path = tmp_path / "hosts"
    n = notices(path, "a slots=2\nb slots=2\n")
    write(path, "a slots=2\n")
    change = n.poll(control, [].append)
    assert names(change) == [("a", 2)] and change.why == "b left the hosts file" and change.deadline is None
    write(path, "a slots=2\nc slots=3\nd\n")
    change = n.poll(control, [].append)
    assert names(change) == [("a", 2), ("c", 3), ("d", 4)] and change.why == "c, d joined the hosts file"
    said = []
    write(path, "a slots=two\n")  # a broken version: said once, the hosts kept
    assert n.poll(control, said.append) is None and n.poll(control, said.append) is None
    assert len(said) == 1 and "cannot be used" in said[0] and "slots" in said[0]
    write(path, "a slots=2\nd\n")
    assert names(n.poll(control, [].append)) == [("a", 2), ("d", 4)]


def test_a_notice_takes_the_host_out_until_the_file_lists_it_again(tmp_path, control):
    path = tmp_path / "hosts"
    n = notices(path, "a slots=2\nb slots=2\n")
    assert control.notify("b", 20.0)
    before = time.time()
    change = n.poll(control, [].append)
    assert names(change) == [("a", 2)] and "b gave notice" in change.why
    assert before + 5 <= change.deadline <= time.time() + 5  # a quarter of the grace: the stop, at the latest
    assert n.poll(control, [].append) is None  # the same notice is taken once
    write(path, "a slots=2\nb slots=2\nc slots=1\n")  # an edit that still lists b does not bring it back
    assert names(n.poll(control, [].append)) == [("a", 2), ("c", 1)]
    write(path, "a slots=2\nc slots=1\n")  # the file catches up: b is gone ...
    assert n.poll(control, [].append) is None
    write(path, "a slots=2\nc slots=1\nb slots=2\n")  # ... and when it is listed again, it is back
    change = n.poll(control, [].append)
    assert names(change) == [("a", 2), ("c", 1), ("b", 2)] and change.why == "b joined the hosts file"


def test_a_notice_from_a_host_the_job_does_not_know_changes_nothing(tmp_path, control):
    n = notices(tmp_path / "hosts", "a slots=2\n")
    control.notify("z", 30.0)
    assert n.poll(control, [].append) is None


def test_a_lost_store_is_no_news(tmp_path):
    class Gone:
        def add(self, *a):
            raise RuntimeError("connection reset")

    n = notices(tmp_path / "hosts", "a slots=2\n")
    control = Control(Gone(), "job")
    assert n.poll(control, [].append) is None and control.lost
