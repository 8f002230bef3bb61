"""Shared fixtures: the default corpus tokenized once per session into a private cache."""

from __future__ import annotations

import logging
import os

import pytest

# DTensor warns about multi-step all-gathers when tests gather full parameters; that is expected.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    path = os.environ.get("ET_TEST_DATA_CACHE") or str(tmp_path_factory.mktemp("data-cache"))
    return path


@pytest.fixture(scope="session")
def sotu_tokens(data_cache):
    from elastic_trainer.data import load_tokens

    return load_tokens(["sotu"], data_cache)
