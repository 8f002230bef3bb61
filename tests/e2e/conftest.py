"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference(sotu_tokens):
    """The default job's 32 steps in one plain process, layout 1,1,1 (once per session: several modules'
    launcher jobs are checked against it)."""
    from tests.e2e.test_launch import DEFAULT, static_run

    return static_run(sotu_tokens, DEFAULT.train, DEFAULT.train.steps)
