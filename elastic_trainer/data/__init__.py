"""Data: GPT-2 tokenizer, corpora (prepared once into token shards, read in place) and the layout-independent
sample order. Names are imported on first use, so a data-preparation worker never imports torch."""

from __future__ import annotations

import importlib

_NAMES = {
    "load_tokens": "corpus",
    "SampleOrder": "order",
    "TokenSamples": "order",
    "microbatch_slices": "order",
    "samples_for": "order",
    "TokenStream": "stream",
}

__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"elastic_trainer.data.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'elastic_trainer.data' has no attribute {name!r}")
