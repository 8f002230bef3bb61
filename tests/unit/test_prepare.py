"""prepare-data and the formats users bring: every format gives the token stream an independent writer would
(tiktoken on the documents, in order, each followed by <|endoftext|>); Megatron's files checked by megatron-core
both ways; resumption, incremental updates, interruption; splits and the validation fraction."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from elastic_trainer.config import ConfigError, TrainConfig
from elastic_trainer.data import corpus, indexed, prepare, sources, stream, tokenizer
from elastic_trainer.data.pieces import CHUNK_BYTES as CHUNK
from elastic_trainer.data.pieces import PROGRESS_EVERY_S, Settings, plan_source

DOCS = [
    "First document, with some words.",
    "Second: more text\nover two lines.",
    "Third one \u00e9\u00e8 \U0001f600.",
    "Fourth <|endoftext|> stays plain text.",
    "Fifth and last.",
]


def expected(docs) -> list[int]:
    """The reference stream: tiktoken's GPT-2 ordinary encoding of each document, then <|endoftext|>."""
    return [t for d in docs for t in [*tokenizer.gpt2_encoding().encode_ordinary(d), tokenizer.EOT_ID]]


def tokens_of(data, tmp_path, **kw) -> list[int]:
    cfg = TrainConfig(data=tuple(str(d) for d in data), data_cache=str(tmp_path / "cache"), seq_len=2, **kw)
    return np.asarray(corpus.load(cfg, quiet=True).train).tolist()


# -- cutting text into pieces ---------------------------------------------------------------------------------

TRICKY = [
    "word\nWord",
    "a \nb",
    "x\n\ny",
    "line\n  indented",
    "tab\t\nz",
    "nbsp\u00a0\nq",
    "end.\n\u00a0\u00a0w",
    "crlf\r\nnext",
    "it's\n's",
    "12\n34",
    "\u00e9\n\u00e9",
    "emoji\U0001f600\nA",
    "!!\n??",
]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_txt_cut_into_pieces_tokenizes_as_the_whole(tmp_path, chunk):
    """Cuts fall only where GPT-2's pre-tokenizer splits anyway, whatever the whitespace and characters
    around the newlines: the pieces' tokens are the whole file's."""
    rng = np.random.default_rng(0)
    text = "".join(TRICKY[i] + (" " if rng.random() < 0.5 else "") for i in rng.integers(0, len(TRICKY), 400))
    (tmp_path / "a.txt").write_bytes(text.encode())
    pieces = plan_source(tmp_path / "a.txt", Settings(chunk_bytes=chunk))
    assert len(pieces) > 20 and [p.ends_document for p in pieces].count(True) == 1
    manifest = prepare.prepare([tmp_path / "a.txt"], tmp_path / "out", chunk_bytes=chunk, quiet=True)
    got = np.asarray(stream.TokenStream(stream.prepared_files(tmp_path / "out", manifest))).tolist()
    whole = text.replace("\r\n", "\n")
    assert got == expected([whole])


def test_jsonl_pieces_end_at_lines_and_keep_line_numbers(tmp_path):
    lines = [json.dumps({"text": f"record {i} " * 3}) for i in range(300)]
    lines[250] = "{broken"
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    pieces = plan_source(tmp_path / "d.jsonl", Settings(chunk_bytes=500))
    assert len(pieces) > 10 and all(
        p.start == 0 or (tmp_path / "d.jsonl").read_bytes()[p.start - 1 : p.start] == b"\n" for p in pieces
    )
    with pytest.raises(ConfigError, match=r"d\.jsonl line 251: not valid JSON"):
        prepare.prepare([tmp_path / "d.jsonl"], tmp_path / "out", chunk_bytes=500, quiet=True)
    assert not (tmp_path / "out").exists()  # a failed first preparation leaves nothing


# -- every format gives the same stream -------------------------------------------------------------------------


def test_every_text_format_gives_the_reference_stream(tmp_path):
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    want = expected(DOCS)
    body = "".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(DOCS))
    (tmp_path / "a.jsonl").write_text(body)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(body.encode()))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body.encode()))
    (tmp_path / "d.json").write_text(json.dumps([{"body": d} for d in DOCS]))
    table = pa.table({"body": DOCS})
    pq.write_table(table, tmp_path / "e.parquet", row_group_size=2)
    with pa.ipc.new_stream(str(tmp_path / "f.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=2)
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "g"))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.json", "e.parquet", "f.arrow", "g"):
        assert tokens_of([tmp_path / name], tmp_path, text_field="body") == want, name
    with pytest.raises(
        ConfigError,
        match=r"a\.jsonl line 1: has no 'text' field \(keys: body, n; choose one with "
        r"--text-field\)",
    ):
        tokens_of([tmp_path / "a.jsonl"], tmp_path)
    with pytest.raises(ConfigError, match=r"e\.parquet has no 'text' field \(columns: body; choose one"):
        tokens_of([tmp_path / "e.parquet"], tmp_path)


def test_token_files_are_read_in_place(tmp_path):
    """nanoGPT's train.bin (uint16 tokens) and Megatron's PREFIX.bin/.idx give the same stream as the text."""
    want = np.array(expected(DOCS), dtype=np.uint16)
    want.tofile(tmp_path / "train.bin")
    lengths = [len(tokenizer.encode(d)) + 1 for d in DOCS]
    want.tofile(tmp_path / "mega_text_document.bin")
    indexed.write_index(tmp_path / "mega_text_document.idx", np.uint16, np.array(lengths), np.arange(6))
    for source in ("train.bin", "mega_text_document", "mega_text_document.bin", "mega_text_document.idx"):
        assert tokens_of([tmp_path / source], tmp_path) == want.tolist(), source


def test_megatron_reads_our_shards_and_we_read_megatrons_files(tmp_path):
    """The format checked by a program we did not write: megatron-core's IndexedDataset reads every shard of a
    prepared dataset as its documents; its IndexedDatasetBuilder writes files our reader takes."""
    mc = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core is a dev dependency (pip install megatron-core --no-deps)",
    )
    import torch

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare.prepare([tmp_path / "a.jsonl"], tmp_path / "out", quiet=True)
    [shard] = manifest["shards"]
    theirs = mc.IndexedDataset(str(tmp_path / "out" / "shards" / shard["name"]), mmap=True)
    assert [theirs[i].tolist() for i in range(len(theirs))] == [[*tokenizer.encode(d), tokenizer.EOT_ID] for d in DOCS]
    assert theirs.document_indices.tolist() == list(range(len(DOCS) + 1))

    builder = mc.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for d in DOCS:
        builder.add_document(torch.tensor([*tokenizer.encode(d), tokenizer.EOT_ID]), [len(tokenizer.encode(d)) + 1])
    builder.finalize(str(tmp_path / "m.idx"))
    assert tokens_of([tmp_path / "m"], tmp_path) == expected(DOCS)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("odd-bin", "not a multiple of 2; a nanoGPT .bin holds uint16"),
        ("idx-version", "Megatron index version 2; only version 1 is read"),
        ("idx-no-bin", "a Megatron index without its t.bin beside it"),
        ("idx-short-bin", "does not belong together"),
    ],
)
def test_bad_token_files_are_one_line(tmp_path, damage, message):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    indexed.write_index(tmp_path / "t.idx", np.uint16, np.array([4, 6]), np.arange(3))
    if damage == "odd-bin":
        (tmp_path / "t.idx").unlink()
        (tmp_path / "t.bin").write_bytes(b"\0" * 11)
    elif damage == "idx-version":
        raw = bytearray((tmp_path / "t.idx").read_bytes())
        raw[9] = 2
        (tmp_path / "t.idx").write_bytes(bytes(raw))
    elif damage == "idx-no-bin":
        os.replace(tmp_path / "t.bin", tmp_path / "u.bin")
    else:
        (tmp_path / "t.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError) as err:
        tokens_of([tmp_path / ("t.idx" if damage != "odd-bin" else "t.bin")], tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_damaged_or_foreign_prepared_dataset_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("Some text to prepare. " * 40)
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds", quiet=True)
    data = TrainConfig(data=(str(tmp_path / "ds"),), seq_len=4)
    corpus.load(data, builder=True)
    [shard] = (tmp_path / "ds" / "shards").glob("*.bin")
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="its content digest does not match .*manifest.json"):
        corpus.load(data, builder=True)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 32000
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"prepared with another tokenizer \(vocab_size=32000, ours 50257\)"):
        corpus.load(data)


def test_a_slow_tokenizer_build_does_not_make_a_quick_preparation_talk(tmp_path, monkeypatch, capsys):
    """Progress lines are held back for the first PROGRESS_EVERY_S of the preparation's work: building the
    tokenizer before it (about 1 s, several on a loaded machine) is not counted, so a tiny corpus says nothing
    and a bad one only its error (tests/e2e/test_bad_input.py's data-too-short)."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # for every caller, during this test
    build, built = tokenizer.gpt2_encoding, []

    def slow_build():
        if not built:  # the first build takes ten progress periods of the (frozen) clock
            clock[0] += 10 * PROGRESS_EVERY_S
            built.append(True)
        return build()

    monkeypatch.setattr(prepare.tokenizer, "gpt2_encoding", slow_build)
    (tmp_path / "a.txt").write_text("A few words.\n")
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds")
    assert built and capsys.readouterr().err == ""


# -- resumable, incremental, interruptible ------------------------------------------------------------------------


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").iterdir())}


# -- splits and validation -------------------------------------------------------------------------------------


def test_a_validation_split_beside_train_is_never_trained_on(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:3]))
    (d / "validation.jsonl").write_text(json.dumps({"text": DOCS[3]}) + "\n")
    (d / "test.jsonl").write_text(json.dumps({"text": DOCS[4]}) + "\n")
    got = corpus.load(
        TrainConfig(data=(str(d),), data_cache=str(tmp_path / "cache"), seq_len=2, global_batch=1), quiet=True
    )
    assert np.asarray(got.train).tolist() == expected(DOCS[:3])
    assert np.asarray(got.val).tolist() == expected(DOCS[3:4])
    assert any("left out of training: 1 file(s) of split test" in line for line in got.lines)
    with pytest.raises(ConfigError, match="holds the splits test, train, validation but no 'dev'"):
        corpus.load(TrainConfig(data=(str(d),), data_split="dev", seq_len=2))


def test_a_datasetdict_trains_on_its_split_and_validates_on_validation(tmp_path):
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS[:4]}),
            "validation": datasets.Dataset.from_dict({"text": DOCS[4:]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    got = corpus.load(
        TrainConfig(data=(str(tmp_path / "dd"),), data_cache=str(tmp_path / "c"), seq_len=2, global_batch=1), quiet=True
    )
    assert np.asarray(got.train).tolist() == expected(DOCS[:4]) and np.asarray(got.val).tolist() == expected(DOCS[4:])
    with pytest.raises(ConfigError, match=r"a DatasetDict without the split 'test' \(valid --data-split: train, "):
        corpus.load(TrainConfig(data=(str(tmp_path / "dd"),), data_split="test", seq_len=2))


def test_val_fraction_holds_out_whole_documents_by_a_fixed_rule(tmp_path):
    docs = [f"document {i}: " + "words " * (i % 7 + 1) for i in range(400)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = TrainConfig(data=(str(tmp_path / "a.jsonl"),), data_cache=str(tmp_path / "c"), seq_len=2, val_fraction=0.1)
    got = corpus.load(cfg, quiet=True)
    # the rule, written out: document d is held out when splitmix64(d) < 0.1 * 2**64
    held = [d for d in range(len(docs)) if int(stream._mix(np.array([d]))[0]) < int(0.1 * 2**64)]
    assert 20 < len(held) < 60
    assert np.asarray(got.val).tolist() == expected([docs[d] for d in held])
    assert np.asarray(got.train).tolist() == expected([t for d, t in enumerate(docs) if d not in held])
    assert got.data_id != corpus.load(TrainConfig(data=cfg.data, data_cache=cfg.data_cache, seq_len=2)).data_id


def test_the_data_id_is_the_content_not_the_path(tmp_path):
    import shutil

    (tmp_path / "a.txt").write_text("Some text to prepare. " * 40)
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds", quiet=True)
    shutil.copytree(tmp_path / "ds", tmp_path / "moved")
    ids = [corpus.load(TrainConfig(data=(str(tmp_path / n),), seq_len=4)).data_id for n in ("ds", "moved")]
    assert ids[0] == ids[1]
    (tmp_path / "a.txt").write_text("Other text to prepare. " * 40)
    prepare.prepare([tmp_path / "a.txt"], tmp_path / "ds", quiet=True)
    assert corpus.load(TrainConfig(data=(str(tmp_path / "ds"),), seq_len=4)).data_id != ids[0]


def test_sources_resolution_refuses_mixtures_and_unknown_types(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ConfigError, match="--data mixes text .* and tokens"):
        sources.resolve([str(tmp_path / "a.txt"), str(tmp_path / "t.bin")])
    with pytest.raises(ConfigError, match=r"unsupported type '\.csv'"):
        sources.resolve([str(tmp_path / "x.csv")])


def test_every_format_of_one_corpus_trains_the_same_losses(tmp_path, group):
    """The same documents as raw .jsonl, a prepared dataset, a nanoGPT .bin, a Megatron prefix and a
    save_to_disk folder: the same per-step losses (they are the same token order, so exactly)."""
    import datasets
    import torch

    from elastic_trainer.config import ModelConfig
    from elastic_trainer.parallel.mesh import build_mesh
    from elastic_trainer.plan.layout import Layout
    from elastic_trainer.train.loop import Trainer

    docs = [f"Paragraph {i}: " + " ".join(DOCS[j % len(DOCS)] for j in range(i % 4 + 1)) for i in range(60)]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare.prepare([tmp_path / "raw.jsonl"], tmp_path / "prepared", quiet=True)
    ids = np.array(expected(docs), dtype=np.uint16)
    ids.tofile(tmp_path / "nano.bin")
    ids.tofile(tmp_path / "mega.bin")
    lengths = [len(tokenizer.encode(d)) + 1 for d in docs]
    indexed.write_index(tmp_path / "mega.idx", np.uint16, np.array(lengths), np.arange(len(docs) + 1))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))

    model = ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=tokenizer.VOCAB_SIZE, context_length=16)
    one = Layout(1, 1, 1, 4, 1)
    losses = {}
    for name in ("raw.jsonl", "prepared", "nano.bin", "mega", "hf"):
        cfg = TrainConfig(
            data=(str(tmp_path / name),),
            data_cache=str(tmp_path / "cache"),
            global_batch=4,
            seq_len=16,
            steps=3,
            seed=5,
        )
        trainer = Trainer(model, cfg, one, build_mesh(one, "cpu"), torch.device("cpu"))
        losses[name] = [trainer.train_step()["loss"] for _ in range(3)]
    assert len({tuple(v) for v in losses.values()}) == 1, losses


def test_a_missing_or_truncated_shard_is_written_again(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 9}) + "\n" for i in range(3000)))
    manifest = prepare.prepare([tmp_path / "a.jsonl"], tmp_path / "ds", chunk_bytes=50_000, quiet=True)
    whole = _shard_bytes(tmp_path / "ds")
    bins = sorted((tmp_path / "ds" / "shards").glob("*.bin"))
    bins[0].unlink()
    bins[1].write_bytes(bins[1].read_bytes()[:10])
    again = prepare.prepare([tmp_path / "a.jsonl"], tmp_path / "ds", chunk_bytes=50_000, quiet=True)
    assert again["digest"] == manifest["digest"] and _shard_bytes(tmp_path / "ds") == whole


def test_identical_files_in_two_folders_are_prepared_once_and_read_twice(tmp_path):
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare.prepare(
        [tmp_path / "x" / "part.jsonl", tmp_path / "y" / "part.jsonl"], tmp_path / "ds", quiet=True, workers=None
    )
    assert len(manifest["shards"]) == 2 and manifest["shards"][0] == manifest["shards"][1]
    assert np.asarray(stream.TokenStream(stream.prepared_files(tmp_path / "ds"))).tolist() == expected(DOCS) * 2


def test_blank_lines_are_cut_and_one_long_document_is_held_out_whole(tmp_path):
    """Paragraphs separated by blank lines give cuts (memory stays bounded), and --val-fraction holds out
    whole documents whatever the pieces: a .txt cut into many shards is still one document."""
    paragraphs = "\n\n".join(f"Paragraph {i}. " + "Words and more words. " * 5 for i in range(300))
    docs = [f"Short book {i}." for i in range(6)]
    docs.insert(3, paragraphs)  # document 3: held out at 0.5 (documents 3, 4, 5 of 0..6 are)
    files = []
    for i, text in enumerate(docs):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text)
    pieces = plan_source(files[3], Settings(chunk_bytes=2000))
    assert len(pieces) > 10
    held = [d for d in range(len(docs)) if int(stream._mix(np.array([d]))[0]) < int(0.5 * 2**64)]
    assert held == [3, 4, 5]
    for chunk in (2000, CHUNK):
        manifest = prepare.prepare(files, tmp_path / f"ds{chunk}", chunk_bytes=chunk, quiet=True)
        assert (len(manifest["shards"]) > 10) == (chunk == 2000) and manifest["documents"] == len(docs)
        got = corpus.load(
            TrainConfig(data=(str(tmp_path / f"ds{chunk}"),), seq_len=2, val_fraction=0.5, global_batch=1)
        )
        assert np.asarray(got.val).tolist() == expected([docs[d] for d in held]), chunk
        assert np.asarray(got.train).tolist() == expected([docs[d] for d in range(len(docs)) if d not in held]), chunk


def test_one_read_gives_the_digest_and_every_piece_s_first_line(tmp_path, monkeypatch):
    """Planning reads a text file once: its digest and each piece's first line number, whatever the block
    size against the cuts, equal xxh3 of the bytes and a count of the newlines before the piece."""
    import xxhash

    from elastic_trainer.data import pieces as planning

    rng = np.random.default_rng(0)
    for trial in range(20):
        data = bytes(rng.choice(list(b"ab \nX\r."), size=int(rng.integers(1, 3000))))
        (tmp_path / "f.txt").write_bytes(data)
        monkeypatch.setattr(planning, "HASH_BLOCK", int(rng.integers(1, 200)))
        for kind in ("txt", "jsonl"):
            got, content = planning._byte_pieces(tmp_path / "f.txt", len(data), kind, int(rng.integers(1, 300)))
            assert content == xxhash.xxh3_128(data).hexdigest()
            assert [p.line for p in got] == [data[: p.start].count(b"\n") + 1 for p in got], (trial, kind)
            assert got[0].start == 0 and got[-1].stop == len(data)
            assert all(a.stop == b.start for a, b in zip(got, got[1:]))
