"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.conftest import computed_once


@pytest.fixture(scope="session")
def reference(sotu_tokens, pytestconfig):
    """The default job's 32 steps in one plain process, layout 1,1,1 (once per run, whichever worker asks
    first: several modules' launcher jobs are checked against it)."""
    from tests.e2e.test_launch import DEFAULT, static_run

    return computed_once(
        pytestconfig, "default-job-losses", lambda: static_run(sotu_tokens, DEFAULT.train, DEFAULT.train.steps)
    )
