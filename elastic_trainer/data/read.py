"""Reading any piece or file of a corpus: the documents of a piece (`documents`), and a quick sample of every
file's start (`sample`), by format (`records` for text and JSON, `tables` for Parquet, Arrow, save_to_disk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from elastic_trainer.data import tables
from elastic_trainer.data.records import (
    SAMPLE_BYTES,
    SAMPLE_LINES,
    Bad,
    DataError,
    Piece,
    byte_lines,
    decoded,
    is_json_list,
    json_lines,
    kind_of,
    open_decompressed,
    open_file,
    read_json_lines,
    read_json_list,
    read_text,
    size_of,
)


def documents(piece: Piece, bad: Bad, skip: bool, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one piece, in order."""
    kind = piece.kind
    if kind in ("txt", "txt-compressed"):
        yield from read_text(piece, bad, skip)
    elif kind in ("jsonl", "jsonl-compressed"):
        yield from read_json_lines(piece, bad, skip, text_field)
    elif kind == "json-list":
        yield from read_json_list(piece.path, bad, skip, text_field)
    elif kind in ("parquet", "arrow", "hf"):
        yield from tables.read(piece, bad, skip, text_field)
    else:
        raise ValueError(f"unknown piece kind {kind!r}")


def sample(files: list[Path], skip: bool = False, text_field: str = "text") -> None:
    """Open every file and read its start as the full read would: a file that cannot be read, undecodable text,
    a bad record in the first lines, a table without the text column, or a corpus with no bytes at all fails
    here in one line."""
    if files and sum(size_of(p) for p in files) == 0:
        names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
        raise DataError(
            f"the data is empty: {names} {'holds' if len(files) == 1 else 'hold'} no text (valid: files with documents)"
        )
    bad = Bad()
    for path in files:
        kind = kind_of(path)
        if path.is_dir():
            tables.check_column(tables.load_hf(path).data.schema, path, text_field)
        elif kind == "txt":
            with open_file(path) as f:
                decoded(f.read(SAMPLE_BYTES), str(path), 1, bad, skip, final=False)
        elif kind == "parquet":
            tables.parquet_file(path, text_field)
        elif kind == "arrow":
            tables.check_column(tables.arrow_reader(path).schema, path, text_field)
        elif kind in ("txt-compressed", "jsonl-compressed"):
            try:
                with open_decompressed(path) as f:
                    head = f.read(SAMPLE_BYTES)
            except (OSError, EOFError) as e:
                raise DataError(f"{path}: cannot be decompressed ({e}); valid: a complete .gz or .zst file") from None
            if kind == "jsonl-compressed":
                lines = head.splitlines(keepends=True)[:-1] or head.splitlines(keepends=True)
                list(json_lines(lines, str(path), 1, bad, skip, text_field, limit=SAMPLE_LINES))
        elif kind == "json" and is_json_list(path):
            if size_of(path) <= SAMPLE_BYTES:
                list(read_json_list(str(path), bad, skip, text_field))
        else:
            list(json_lines(byte_lines(str(path), 0, -1), str(path), 1, bad, skip, text_field, limit=SAMPLE_LINES))
