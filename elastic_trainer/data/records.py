"""A corpus's documents, read piece by piece with the file and line (or row) of every record.

A `Piece` is the unit of work of `prepare`: a byte range of a `.txt` or `.jsonl` file, a row range of a
Parquet file or a Hugging Face `save_to_disk` dataset, or a whole compressed, `.json`-list or `.arrow` file.
Formats:
- `.txt`: the whole file is one document (UTF-8, universal newlines). A large file is split into pieces at
  a newline between two non-space characters, where GPT-2's pre-tokenizer always splits, so the pieces
  tokenize to exactly the tokens of the whole; only the last piece ends the document.
- `.jsonl` (and `.json` holding one object per line): one JSON object per line with a string text field.
- `.json` holding one list of such objects (read whole: a list cannot be streamed by line).
- `.gz` / `.zst` of `.txt`/`.jsonl`: decompressed as a stream (one piece per file).
- `.parquet`, `.arrow` and `save_to_disk` folders: a string column, read batch by batch through pyarrow and
  `datasets.load_from_disk` (memory-mapped: nothing is copied).

The plain-text and JSON readers are our own because a bad record must be reported by file and line
(`a.jsonl line 7: not valid JSON (...)`). A bad record stops the read with a one-line DataError unless
`skip`: then it is left out, counted in `Bad`, and the first few are named at the end. `sample` reads the
start of every file the same way, so a wrong file fails in milliseconds, before the whole corpus is read.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.config import ConfigError

SAMPLE_BYTES = 1 << 20
SAMPLE_LINES = 200
COMPRESSED = (".gz", ".zst")
ROW_BATCH = 1024


class DataError(ConfigError):
    """A data file cannot be read; one line with the file (and line or row) and what would be valid."""


@dataclass
class Bad:
    """Bad records left out of a corpus (with `skip`)."""

    count: int = 0
    first: list[str] = field(default_factory=list)
    """The first few, as 'FILE line N: reason'."""

    def add(self, where: str, skip: bool) -> None:
        if not skip:
            raise DataError(f"{where} (pass --skip-bad-records to leave such records out)")
        self.count += 1
        if len(self.first) < 3:
            self.first.append(where)

    def merge(self, count: int, first: list[str]) -> None:
        self.count += count
        self.first = (self.first + list(first))[:3]


@dataclass(frozen=True)
class Piece:
    """One unit of reading: `kind` of `path` from `start` to `stop` (bytes, or rows for tables; -1: to the
    end). `line` is the number of the first line (text formats), for error messages."""

    path: str
    kind: str
    """txt, jsonl, json-list, txt-compressed, jsonl-compressed, parquet, arrow, hf"""
    start: int = 0
    stop: int = -1
    line: int = 1
    ends_document: bool = True
    """False for a .txt piece that is not the file's last: its document goes on in the next piece."""

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "kind": self.kind,
            "start": self.start,
            "stop": self.stop,
            "line": self.line,
            "ends_document": self.ends_document,
        }


def kind_of(path: Path) -> str | None:
    """The reader of a file by its name (None: not a text format)."""
    name = path.name.lower()
    inner = name
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            inner = name[: -len(suffix)]
    base = Path(inner).suffix
    if inner != name:
        return {".txt": "txt-compressed", ".jsonl": "jsonl-compressed", ".json": "jsonl-compressed"}.get(base)
    return {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(base)


def _text_of(obj, where: str, text_field: str) -> tuple[str | None, str | None]:
    """(text, None) of a record, or (None, why it is bad)."""
    if not isinstance(obj, dict):
        return None, f"{where}: not a JSON object with a {text_field!r} field (got {type(obj).__name__})"
    if text_field not in obj:
        keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
        return None, f"{where}: has no {text_field!r} field (keys: {keys}; choose one with --text-field)"
    text = obj[text_field]
    if not isinstance(text, str):
        return None, f"{where}: {text_field!r} is {'null' if text is None else type(text).__name__}, not a string"
    return text, None


def open_file(path: str | Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror or e})") from None


def open_decompressed(path: str | Path):
    """A binary stream of the file's bytes, decompressed when it is .gz or .zst."""
    raw = open_file(path)
    name = str(path).lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(f"{path}: reading .zst needs the PyPI package zstandard (pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def decoded(raw: bytes, path: str, first_line: int, bad: Bad, skip: bool, final: bool = True) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(raw, final=final)
    except UnicodeDecodeError as e:
        line = first_line + raw[: e.start].count(b"\n")
        bad.add(f"{path} line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})", skip)
        kept = []
        for number, chunk in enumerate(raw.splitlines(keepends=True), first_line):
            try:
                kept.append(chunk.decode("utf-8"))
            except UnicodeDecodeError:
                if number != line:
                    bad.add(f"{path} line {number}: not UTF-8 text", skip)
        text = "".join(kept)
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text mode reads it


def _read_range(path: str, start: int, stop: int) -> bytes:
    with open_file(path) as f:
        f.seek(start)
        return f.read() if stop < 0 else f.read(stop - start)


def read_text(piece: Piece, bad: Bad, skip: bool) -> Iterator[str]:
    if piece.kind == "txt-compressed":
        with open_decompressed(piece.path) as f:
            raw = f.read()
    else:
        raw = _read_range(piece.path, piece.start, piece.stop)
    text = decoded(raw, piece.path, piece.line, bad, skip)
    if text:  # an empty file is no document (as an empty record is none)
        yield text


def first_char(path: str | Path) -> bytes:
    with open_file(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    return head[:1]


def is_json_list(path: str | Path) -> bool:
    return first_char(path) == b"["


def read_json_list(path: str, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    try:
        with open_file(path) as f:
            items = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text at byte offset {e.start}") from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); a .json file "
            "holds one list of records or one record per line"
        ) from None
    if not isinstance(items, list):
        raise DataError(f"{path}: a JSON {type(items).__name__}, not a list of records")
    for index, obj in enumerate(items):
        text, why = _text_of(obj, f"{path} record {index + 1}", text_field)
        if why:
            bad.add(why, skip)
        elif text:
            yield text


def json_lines(
    lines, path: str, first: int, bad: Bad, skip: bool, text_field: str, limit: int | None = None
) -> Iterator[str]:
    for number, raw in enumerate(lines, first):
        if limit is not None and number - first >= limit:
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
        text, why = _text_of(obj, where, text_field)
        if why:
            bad.add(why, skip)
        elif text:
            yield text


def byte_lines(path: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines of bytes [start, stop) of a file (both at line starts), read in blocks."""
    with open_file(path) as f:
        f.seek(start)
        left = stop - start if stop >= 0 else None
        while left is None or left > 0:
            line = f.readline() if left is None else f.readline(left)
            if not line:
                return
            if left is not None:
                left -= len(line)
            yield line


def read_json_lines(piece: Piece, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    if piece.kind == "jsonl-compressed":
        with open_decompressed(piece.path) as f:
            try:
                yield from json_lines(f, piece.path, 1, bad, skip, text_field)
            except (OSError, EOFError) as e:
                raise DataError(
                    f"{piece.path}: cannot be decompressed ({e}); valid: a complete .gz or .zst file"
                ) from None
        return
    yield from json_lines(
        byte_lines(piece.path, piece.start, piece.stop), piece.path, piece.line, bad, skip, text_field
    )


def size_of(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.glob("*.arrow"))
        return path.stat().st_size
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror or e})") from None
