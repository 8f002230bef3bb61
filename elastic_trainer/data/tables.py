"""Tables of text: Parquet files, Arrow IPC files and Hugging Face `save_to_disk` folders, read through pyarrow
and `datasets.load_from_disk` batch by batch, memory-mapped: nothing is copied and nothing is downloaded.
A null text is a bad record, reported by file and row."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from elastic_trainer.data.records import ROW_BATCH, Bad, DataError, Piece


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def parquet_file(path: str | Path, text_field: str):
    """The open pyarrow ParquetFile, its text column checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    check_column(pf.schema_arrow, path, text_field)
    return pf


def check_column(schema, where, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(
            f"{where} has no {text_field!r} field (columns: {', '.join(schema.names) or 'none'}; "
            "choose one with --text-field)"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{where}: column {text_field!r} holds {kind}, not strings (choose another with --text-field)")


def _column_texts(values, where: str, first_row: int, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    for index, text in enumerate(values):
        if text is None:
            bad.add(f"{where} row {first_row + index + 1}: {text_field!r} is null, not a string", skip)
        elif text:
            yield text


def _read_parquet(piece: Piece, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    """Row groups [start, stop) of a Parquet file, one batch at a time."""
    pf = parquet_file(piece.path, text_field)
    stop = pf.num_row_groups if piece.stop < 0 else piece.stop
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    for group in range(piece.start, stop):
        for batch in pf.iter_batches(batch_size=ROW_BATCH, row_groups=[group], columns=[text_field]):
            values = batch.column(0).to_pylist()
            yield from _column_texts(values, piece.path, row, bad, skip, text_field)
            row += len(values)


def arrow_reader(path: str | Path):
    """Record batches of an Arrow IPC file (stream format, as datasets writes it, or file format)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot be read ({_first_line(e)})") from None
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowException:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowException as e:
            raise DataError(f"{path}: not an Arrow IPC file ({_first_line(e)})") from None
        return _FileBatches(reader)


class _FileBatches:
    def __init__(self, reader):
        self.schema = reader.schema
        self._reader = reader

    def __iter__(self):
        return (self._reader.get_batch(i) for i in range(self._reader.num_record_batches))


def _read_arrow(piece: Piece, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    reader = arrow_reader(piece.path)
    check_column(reader.schema, piece.path, text_field)
    row = 0
    for batch in reader:
        values = batch.column(batch.schema.get_field_index(text_field)).to_pylist()
        yield from _column_texts(values, piece.path, row, bad, skip, text_field)
        row += len(values)


def load_hf(path: str | Path):
    """A `save_to_disk` Dataset folder, memory-mapped (nothing copied, nothing downloaded)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a damaged folder
        raise DataError(f"{path}: not a readable Hugging Face save_to_disk folder ({_first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict; name one split folder (valid: {', '.join(ds)})")
    return ds


def _read_hf(piece: Piece, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    ds = load_hf(piece.path)
    check_column(ds.data.schema, piece.path, text_field)
    stop = ds.num_rows if piece.stop < 0 else piece.stop
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    column = table.column(text_field)
    indices = getattr(ds, "_indices", None)
    for row in range(piece.start, stop, ROW_BATCH):
        end = min(row + ROW_BATCH, stop)
        if indices is not None:  # a selected or shuffled Dataset: rows through its indices mapping
            values = ds[row:end][text_field]
        else:
            values = column.slice(row, end - row).to_pylist()
        yield from _column_texts(values, piece.path, row, bad, skip, text_field)


def read(piece: Piece, bad: Bad, skip: bool, text_field: str) -> Iterator[str]:
    reader = {"parquet": _read_parquet, "arrow": _read_arrow, "hf": _read_hf}[piece.kind]
    yield from reader(piece, bad, skip, text_field)
