"""A corpus's documents, read record by record with the file and line of every record.

Formats: `.txt` (the whole file is one document, UTF-8, universal newlines), `.jsonl`/`.json` (one JSON object
per line with a string `text`; a `.json` file may instead hold one list of such objects) and `.parquet` (a
string `text` column, read through Hugging Face datasets). The plain-text and JSON readers are our own
because a bad record must be reported by file and line (`a.jsonl line 7: not valid JSON (...)`), which
datasets' JSON builder cannot do (it fails with pyarrow's error and a long traceback), and its text builder
is a plain `open().read()`.

A bad record (undecodable bytes, invalid JSON, no string `text`) stops the read with a one-line DataError,
unless `skip_bad`: then it is left out, counted in `Bad`, and the first few are named at the end.
`sample` reads the start of every file the same way, so a wrong file fails in milliseconds, before the
tokenizing read of the whole corpus.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from elastic_trainer.config import ConfigError

TEXT_FIELD = "text"
SAMPLE_BYTES = 1 << 20
SAMPLE_LINES = 200


class DataError(ConfigError):
    """A data file cannot be read; one line with the file (and line or row) and what would be valid."""


@dataclass
class Bad:
    """Bad records left out of a corpus (with `skip_bad`)."""

    count: int = 0
    first: list[str] = field(default_factory=list)
    """The first few, as 'FILE line N: reason'."""

    def add(self, where: str, skip: bool) -> None:
        if not skip:
            raise DataError(f"{where} (pass --skip-bad-records to leave such records out)")
        self.count += 1
        if len(self.first) < 3:
            self.first.append(where)

    def summary(self) -> str:
        return f"skipped {self.count} bad record(s); first: {'; '.join(self.first)}"


def _text_of(obj, where: str) -> tuple[str | None, str | None]:
    """(text, None) of a record, or (None, why it is bad)."""
    if not isinstance(obj, dict):
        return None, f"{where}: not a JSON object with a {TEXT_FIELD!r} field (got {type(obj).__name__})"
    if TEXT_FIELD not in obj:
        keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
        return None, f"{where}: has no {TEXT_FIELD!r} field (keys: {keys})"
    text = obj[TEXT_FIELD]
    if not isinstance(text, str):
        return None, f"{where}: {TEXT_FIELD!r} is {'null' if text is None else type(text).__name__}, not a string"
    return text, None


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror or e})") from None


def _read_text(path: Path, bad: Bad, skip: bool, limit: int | None = None) -> Iterator[str]:
    with _open(path) as f:
        raw = f.read() if limit is None else f.read(limit)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(raw, final=limit is None)
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        bad.add(f"{path} line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})", skip)
        kept = []
        for number, chunk in enumerate(raw.splitlines(keepends=True), 1):
            try:
                kept.append(chunk.decode("utf-8"))
            except UnicodeDecodeError:
                if number != line:
                    bad.add(f"{path} line {number}: not UTF-8 text", skip)
        text = "".join(kept)
    yield text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text mode reads it


def _first_char(path: Path) -> bytes:
    with _open(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    return head[:1]


def _read_json_list(path: Path, bad: Bad, skip: bool) -> Iterator[str]:
    try:
        with _open(path) as f:
            items = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text at byte offset {e.start}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); a .json file "
                        "holds one list of records or one record per line") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: a JSON {type(items).__name__}, not a list of records")
    for index, obj in enumerate(items):
        text, why = _text_of(obj, f"{path} record {index + 1}")
        if why:
            bad.add(why, skip)
        elif text:
            yield text


def _read_json_lines(path: Path, bad: Bad, skip: bool, limit: int | None = None) -> Iterator[str]:
    with _open(path) as f:
        for number, raw in enumerate(f, 1):
            if limit is not None and number > limit:
                return
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.add(f"{where}: not UTF-8 text (at column {e.start + 1})", skip)
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad.add(f"{where}: not valid JSON ({e.msg} at column {e.colno})", skip)
                continue
            text, why = _text_of(obj, where)
            if why:
                bad.add(why, skip)
            elif text:
                yield text


def _parquet_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else e})") from None
    if TEXT_FIELD not in schema.names:
        raise DataError(f"{path} has no {TEXT_FIELD!r} field (columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field(TEXT_FIELD).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {TEXT_FIELD!r} holds {kind}, not strings")


def _read_parquet(path: Path, bad: Bad, skip: bool, cache_dir: Path | None) -> Iterator[str]:
    import os

    _parquet_table(path)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train",
                                   cache_dir=str(cache_dir / "hf") if cache_dir else None, columns=[TEXT_FIELD])
    except Exception as e:  # datasets wraps pyarrow's errors in several types
        first = str(e).strip().splitlines()
        raise DataError(f"{path}: not a readable Parquet file ({first[-1] if first else type(e).__name__})") from None
    for index, text in enumerate(ds[TEXT_FIELD]):
        if text is None:
            bad.add(f"{path} row {index + 1}: {TEXT_FIELD!r} is null, not a string", skip)
        elif text:
            yield text


def documents(path: Path, bad: Bad, skip: bool, cache_dir: Path | None = None) -> Iterator[str]:
    """The non-empty documents of one file, in order."""
    if path.suffix == ".txt":
        yield from _read_text(path, bad, skip)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path, bad, skip, cache_dir)
    elif path.suffix == ".json" and _first_char(path) == b"[":
        yield from _read_json_list(path, bad, skip)
    else:
        yield from _read_json_lines(path, bad, skip)


def read_all(files: list[Path], skip: bool, cache_dir: Path | None = None) -> tuple[list[str], Bad]:
    bad = Bad()
    docs = [d for path in files for d in documents(path, bad, skip, cache_dir) if d]
    return docs, bad


def sample(files: list[Path], skip_bad: bool = False) -> None:
    """Open every file and read its start as the full read would: a file that cannot be read, undecodable text,
    a bad record in the first lines, a Parquet file without a text column, or a corpus with no bytes at all
    fails here in one line."""
    if files and sum(_size(p) for p in files) == 0:
        names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
        raise DataError(f"the data is empty: {names} {'holds' if len(files) == 1 else 'hold'} no text (valid: files "
                        "with documents)")
    bad = Bad()
    for path in files:
        if path.suffix == ".txt":
            list(_read_text(path, bad, skip_bad, limit=SAMPLE_BYTES))
        elif path.suffix == ".parquet":
            _parquet_table(path)
        elif path.suffix == ".json" and _first_char(path) == b"[":
            if _size(path) <= SAMPLE_BYTES:
                list(_read_json_list(path, bad, skip_bad))
        else:
            list(_read_json_lines(path, bad, skip_bad, limit=SAMPLE_LINES))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror or e})") from None
