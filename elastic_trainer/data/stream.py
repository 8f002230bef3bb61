"""Token streams read in place: a prepared dataset's shards, a Megatron prefix, a nanoGPT .bin.

A `TokenStream` is segments of token files addressed as one array (`len`, `stream[a:b]`), memory-mapped on
demand with a bounded number of files open, so a dataset of many shards costs neither memory nor file
descriptors. `split_documents` holds a fraction of the documents out (for validation) by a hash of their
index, as two streams of segments over the same files.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastic_trainer.data import indexed, tokenizer
from elastic_trainer.data.pieces import FORMAT, digest, hash_files
from elastic_trainer.data.records import DataError
from elastic_trainer.data.sources import MANIFEST, TokenSource

OPEN_FILES = 64
SAMPLED_BLOCKS = 64
SAMPLED_BLOCK_BYTES = 64 << 10


@dataclass(frozen=True)
class TokenFile:
    """A file of tokens: `tokens` ids of `dtype` from byte 0; `index` is its Megatron .idx (None for nanoGPT)."""

    path: Path
    dtype: np.dtype
    tokens: int
    index: Path | None = None
    continues: bool = False
    """Its last document goes on in the next file (a .txt cut into pieces: one document over shards)."""


class TokenStream:
    """Segments (file, start, length) of token files, read as one stream of ids."""

    def __init__(self, files: list[TokenFile], segments: np.ndarray | None = None):
        """`segments`: int64 rows (file number, first token, length); default: every file whole, in order."""
        self.files = list(files)
        if segments is None:
            segments = np.array([(i, 0, f.tokens) for i, f in enumerate(self.files) if f.tokens], dtype=np.int64)
        self.segments = segments.reshape(-1, 3)
        self.starts = np.zeros(len(self.segments) + 1, dtype=np.int64)
        np.cumsum(self.segments[:, 2], out=self.starts[1:])
        kinds = {f.dtype for f in self.files}
        self.dtype = np.dtype(np.uint16) if kinds <= {np.dtype(np.uint16)} else np.dtype(np.int64)
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self.data_id: str | None = None
        """The content digest of the data this stream was opened for (set by data.corpus)."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getstate__(self):  # open maps stay with their process
        return {**self.__dict__, "_open": OrderedDict()}

    def _file(self, number: int) -> np.ndarray:
        array = self._open.get(number)
        if array is None:
            f = self.files[number]
            array = np.memmap(f.path, dtype=f.dtype, mode="r", shape=(f.tokens,))
            if len(self._open) >= OPEN_FILES:
                self._open.popitem(last=False)
            self._open[number] = array
        else:
            self._open.move_to_end(number)
        return array

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            k = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= k < len(self):
                raise IndexError(f"token {key} of a stream of {len(self)}")
            return self[k : k + 1][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenStream takes an index or a contiguous slice")
        start, stop, _ = key.indices(len(self))
        out = np.empty(max(stop - start, 0), dtype=self.dtype)
        pos = start
        seg = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < stop:
            number, first, length = self.segments[seg]
            offset = pos - self.starts[seg]
            take = min(stop - pos, length - offset)
            out[pos - start : pos - start + take] = self._file(int(number))[first + offset : first + offset + take]
            pos += take
            seg += 1
        return out

    def __array__(self, dtype=None, copy=None):
        array = self[0 : len(self)]
        return array if dtype is None else array.astype(dtype)

    def document_spans(self):
        """Per file, in order: (file number, (start, length) rows of its documents in token offsets), one file
        at a time (each ends with <|endoftext|> where the writer appended it)."""
        for number, f in enumerate(self.files):
            if f.index is not None:
                index = indexed.read_index(f.index)
                seq_starts = np.zeros(len(index.lengths) + 1, dtype=np.int64)
                np.cumsum(index.lengths, out=seq_starts[1:])
                docs = np.asarray(index.documents, dtype=np.int64)
                if not len(docs) or docs[-1] != len(index.lengths) or np.any(np.diff(docs) < 0):
                    raise DataError(
                        f"{f.index}: its document indices do not cover its {len(index.lengths)} "
                        "sequences in order; not a valid Megatron index"
                    )
                bounds = seq_starts[docs]
            else:
                bounds = _eot_bounds(self._file(number))
            yield number, np.stack([bounds[:-1], np.diff(bounds)], axis=1)


def _eot_bounds(tokens: np.ndarray, block: int = 1 << 24) -> np.ndarray:
    """Document bounds of a stream where every document ends with <|endoftext|> (read in blocks)."""
    ends = [np.zeros(1, dtype=np.int64)]
    for start in range(0, len(tokens), block):
        ends.append(np.flatnonzero(np.asarray(tokens[start : start + block]) == tokenizer.EOT_ID) + start + 1)
    bounds = np.concatenate(ends)
    if bounds[-1] != len(tokens):
        bounds = np.append(bounds, len(tokens))
    return bounds


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: document index -> a well-spread 64-bit value."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_documents(stream: TokenStream, fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, validation): document d (counted over the whole stream) is held out when the hash of d falls in
    the first `fraction` of the range. The choice depends on the documents' order only, not on the seed."""
    threshold = np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    train, held, counted, carried = [], [], 0, False
    for number, spans in stream.document_spans():
        n = len(spans)
        if n:
            ids = np.arange(counted, counted + n) - (1 if carried else 0)  # a continued document keeps its index
            counted = int(ids[-1]) + 1
            out = _mix(ids) < threshold
            for mask, into in ((~out, train), (out, held)):
                into.extend(_runs(number, spans, mask))
        carried = stream.files[number].continues if n else carried
    as_array = lambda rows: np.array(rows, dtype=np.int64).reshape(-1, 3)  # noqa: E731
    return TokenStream(stream.files, as_array(train)), TokenStream(stream.files, as_array(held))


def _runs(number: int, spans: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Consecutive selected documents of one file merged into (file, start, length) segments."""
    if not mask.any():
        return []
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    rows = []
    for a, b in zip(edges[::2], edges[1::2]):
        start = int(spans[a, 0])
        rows.append((number, start, int(spans[b - 1, 0] + spans[b - 1, 1]) - start))
    return rows


# -- opening what --data names --------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"{folder}: no {MANIFEST}; a prepared dataset is not visible here (put --data-cache on "
            "storage every host sees, or run prepare-data on this host)"
        ) from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); prepare the dataset again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(
            f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, not "
            f"{FORMAT!r}; prepare the dataset again with this version"
        )
    ours = {
        "name": tokenizer.NAME,
        "vocab_size": tokenizer.VOCAB_SIZE,
        "eot": tokenizer.EOT_ID,
        "encoder_json_sha256": tokenizer.ENCODER_JSON_SHA256,
        "vocab_bpe_sha256": tokenizer.VOCAB_BPE_SHA256,
    }
    theirs = manifest.get("tokenizer") or {}
    differ = [k for k in ours if theirs.get(k) != ours[k]]
    if differ:
        raise DataError(
            f"{path}: prepared with another tokenizer ({differ[0]}={theirs.get(differ[0])!r}, ours "
            f"{ours[differ[0]]!r}); prepare it again with this version's GPT-2 BPE"
        )
    return manifest


def prepared_files(folder: Path, manifest: dict | None = None, verify: str | None = None) -> list[TokenFile]:
    """The shards of a prepared dataset, each checked to exist with the size its manifest says. `verify`:
    "all" checks every shard's content digest against the manifest (reads the whole dataset: `prepare-data
    --verify`); "changed" only those modified after the manifest was written, cheap at every job start."""
    manifest = manifest or read_manifest(folder)
    dtype = np.dtype(manifest["dtype"])
    written = (folder / MANIFEST).stat().st_mtime_ns if verify else 0
    files = []
    for shard in manifest["shards"]:
        path = folder / "shards" / f"{shard['name']}.bin"
        try:
            st = path.stat()
        except OSError:
            raise DataError(
                f"{path}: missing from the prepared dataset {folder} (prepare it again: only missing "
                "shards are written)"
            ) from None
        if st.st_size != shard["tokens"] * dtype.itemsize:
            raise DataError(
                f"{path}: {st.st_size} bytes, its manifest says {shard['tokens']} tokens of "
                f"{dtype.name}; the dataset is damaged (delete the shard and prepare it again)"
            )
        if (verify == "all" or (verify == "changed" and st.st_mtime_ns > written)) and hash_files([path]) != shard[
            "digest"
        ]:
            raise DataError(
                f"{path}: its content digest does not match {folder}/{MANIFEST}; the shard changed "
                "after it was prepared (delete it and prepare the dataset again)"
            )
        files.append(
            TokenFile(
                path,
                dtype,
                shard["tokens"],
                path.with_suffix(".idx"),
                shard.get("sequences", 0) > shard.get("documents", 0),
            )
        )
    return files


def token_file(source: TokenSource) -> TokenFile:
    """A Megatron prefix or a nanoGPT .bin, checked."""
    if source.kind == "megatron":
        index = indexed.read_index(indexed.idx_path(source.path))
        indexed.bin_tokens(source.path, index)  # checks the .bin against the index
        return TokenFile(indexed.bin_path(source.path), index.dtype, index.tokens, index.path)
    size = source.path.stat().st_size
    if size % 2:
        raise DataError(
            f"{source.path}: {size} bytes, not a multiple of 2; a nanoGPT .bin holds uint16 GPT-2 tokens "
            "(a Megatron .bin needs its .idx beside it)"
        )
    return TokenFile(source.path, np.dtype(np.uint16), size // 2)


def sampled_digest(path: Path) -> str:
    """A digest of a large token file from its size and 64 blocks spread over it: cheap at every start, and
    enough to tell a replaced or regenerated file from the one a checkpoint was trained on."""
    size = path.stat().st_size
    h = digest()
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for k in range(SAMPLED_BLOCKS):
            f.seek(size * k // SAMPLED_BLOCKS)
            h.update(f.read(SAMPLED_BLOCK_BYTES))
    return h.hexdigest()
