"""launch/allocator.py: which processes start themselves again with glibc keeping freed memory, and that glibc
(not our code) then serves a large buffer from the heap instead of a mapping of its own."""

from __future__ import annotations

import os

import pytest

from elastic_trainer.launch import allocator


def test_a_cpu_host_gets_both_variables_and_gpu_hosts_or_the_users_choice_are_left_alone(tmp_path):
    none = (str(tmp_path / "no-such-device"),)
    assert allocator.additions({}, none) == allocator.KEEP_FREED
    gpu = tmp_path / "nvidiactl"
    gpu.write_text("")
    assert allocator.additions({}, (str(gpu),)) == {}
    assert allocator.additions({"MALLOC_TRIM_THRESHOLD_": "0"}, none) == {}  # the user's own setting
    assert allocator.additions({allocator.SWITCH_ENV: "system"}, none) == {}


def test_a_process_that_imported_torch_is_not_restarted(monkeypatch):
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("restarted"))
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    import torch  # noqa: F401  (this test process has it already)

    allocator.restart_keeping_freed_memory()
