"""Data: GPT-2 tokenizer, corpora (tokenized once, cached), and the layout-independent sample order."""

from elastic_trainer.data.corpus import load_tokens
from elastic_trainer.data.order import SampleOrder, TokenSamples, microbatch_slices, samples_for

__all__ = ["load_tokens", "SampleOrder", "TokenSamples", "microbatch_slices", "samples_for"]
