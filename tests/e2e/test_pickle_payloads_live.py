"""The control of tests/unit/test_checkpoint_storage.py for the payloads whose code starts a process: each runs
when loaded without restriction (so the refusal tests there would see it run)."""

from __future__ import annotations

import pytest

from tests.unit.test_checkpoint_storage import STARTS_A_PROCESS, assert_payload_runs, plant  # noqa: F401  (fixture)


@pytest.mark.parametrize("key", STARTS_A_PROCESS)
def test_planted_pickles_that_start_a_process_run_when_loaded_without_restriction(key, plant):
    assert_payload_runs(key, plant)
