"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`): read and written without Megatron.

A prepared dataset's shards are written in this format, so Megatron-LM reads them as they are (`--data-path
PREFIX`), and Megatron's own files are read in place. The layout of `.idx` (version 1, little-endian):

    b"MMIDIDX\\x00\\x00"   magic, 9 bytes
    uint64             version (1)
    uint8              dtype code of the .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                       7 float32, 8 uint16)
    uint64             S, the number of sequences
    uint64             D, the number of document boundaries (documents + 1)
    int32[S]           sequence lengths, in tokens
    int64[S]           sequence pointers, byte offsets into .bin
    int64[D]           document indices: sequence index where each document starts, then S
    (int8[S]           sequence modes, multimodal datasets only: ignored here)

`.bin` is the sequences' tokens back to back. Megatron's tools append the end-of-document token to every
document (`--append-eod`); our shards do too, so the token stream is the file's tokens in order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastic_trainer.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
TOKEN_CODES = (1, 3, 4, 5, 8)
"""Integer dtypes a token file may have (int8 cannot hold a vocabulary, floats are not tokens)."""
_HEADER = struct.Struct("<9sQBQQ")


def idx_path(prefix: str | Path) -> Path:
    """PREFIX.idx (Megatron names a dataset by the prefix of its two files)."""
    return Path(prefix).with_name(Path(prefix).name + ".idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(prefix).with_name(Path(prefix).name + ".bin")


def code_of(dtype) -> int:
    for code, kind in CODES.items():
        if np.dtype(kind) == np.dtype(dtype):
            return code
    raise ValueError(f"Megatron's index has no code for {np.dtype(dtype)}")


def token_dtype(vocab_size: int) -> type:
    """uint16 while every id fits (Megatron's own rule: < 65500), else int32: the format has no uint32."""
    return np.uint16 if vocab_size < 65500 else np.int32


@dataclass(frozen=True)
class Index:
    """A read `.idx`: the dtype of its `.bin`, and per sequence its length and byte offset."""

    path: Path
    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


class IndexFileError(ConfigError):
    """An `.idx`/`.bin` pair that is not a Megatron indexed dataset we can read (one line, with the fix)."""


def read_index(path: str | Path) -> Index:
    """Read `path` (.idx), checking every field against the file's size: one-line IndexFileError otherwise."""
    path = Path(path)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise IndexFileError(f"{path}: cannot be read as a Megatron index ({e})") from None
    if raw.size < _HEADER.size or bytes(raw[:9]) != MAGIC:
        raise IndexFileError(
            f"{path}: not a Megatron indexed-dataset index (no MMIDIDX header); valid: the .idx "
            "written with its .bin by Megatron-LM's preprocess_data.py or prepare-data"
        )
    magic, version, code, seqs, docs = _HEADER.unpack(bytes(raw[: _HEADER.size]))
    if version != VERSION:
        raise IndexFileError(
            f"{path}: Megatron index version {version}; only version {VERSION} is read (valid: "
            "re-export it with a Megatron-LM that writes version 1)"
        )
    if code not in TOKEN_CODES:
        kind = np.dtype(CODES[code]).name if code in CODES else f"unknown code {code}"
        raise IndexFileError(f"{path}: the .bin holds {kind}, not integer token ids")
    need = _HEADER.size + seqs * 12 + docs * 8
    if raw.size < need or docs < 1:
        raise IndexFileError(
            f"{path}: truncated ({raw.size} bytes; {seqs} sequences and {docs} document "
            f"indices need {need}); regenerate it"
        )
    off = _HEADER.size
    lengths = np.frombuffer(raw, np.int32, seqs, off)
    pointers = np.frombuffer(raw, np.int64, seqs, off + 4 * seqs)
    documents = np.frombuffer(raw, np.int64, docs, off + 12 * seqs)
    return Index(path, np.dtype(CODES[code]), lengths, pointers, documents)


def bin_tokens(prefix: str | Path, index: Index | None = None) -> np.ndarray:
    """The `.bin` of `prefix` as one read-only memory-mapped token array, checked against its index: the
    sequences must lie back to back from offset 0 (as every writer lays them out)."""
    prefix = Path(prefix)
    index = index or read_index(idx_path(prefix))
    path = bin_path(prefix)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise IndexFileError(f"{path}: cannot be read ({e.strerror or e}); an .idx needs its .bin beside it") from None
    item = index.dtype.itemsize
    total = index.tokens
    if size != total * item:
        raise IndexFileError(
            f"{path}: {size} bytes, but its index {index.path.name} describes {total} tokens of "
            f"{index.dtype.name} ({total * item} bytes); the pair does not belong together"
        )
    if len(index.lengths):
        expected = np.concatenate(([0], np.cumsum(index.lengths[:-1], dtype=np.int64))) * item
        if not np.array_equal(expected, index.pointers):
            raise IndexFileError(f"{index.path}: its sequences are not stored back to back in {path.name}; not read")
    if total == 0:
        return np.zeros(0, dtype=index.dtype)
    return np.memmap(path, dtype=index.dtype, mode="r", shape=(total,))


def write_index(path: str | Path, dtype, lengths: np.ndarray, documents: np.ndarray) -> None:
    """Write an `.idx` for sequences of `lengths` stored back to back as `dtype`; `documents` is the
    document-start array (starting at 0, ending at len(lengths))."""
    lengths = np.asarray(lengths, dtype=np.int32)
    documents = np.asarray(documents, dtype=np.int64)
    item = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * item
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, code_of(dtype), len(lengths), len(documents)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())
