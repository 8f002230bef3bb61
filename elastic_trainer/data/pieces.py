"""Planning a preparation: every source's size, content digest and pieces, and each piece's shard name.

A piece is about `chunk_bytes` of a source: a .txt cut at a newline between two printable ASCII characters
(GPT-2's pre-tokenizer splits there anyway, so the pieces tokenize exactly as the whole), a .jsonl at a line
end, a Parquet file at row groups, a save_to_disk dataset at rows; other files are one piece. A shard's name
is a digest of its source's content digest, its range and the settings, so an unchanged source keeps its
shards' names and a changed one gets new ones.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.data import records, tables, tokenizer
from elastic_trainer.data.records import DataError, Piece

FORMAT = "elastic-trainer-prepared/1"
CHUNK_BYTES = 64 << 20
"""Source bytes per piece (and shard): a worker's unit of work, a few seconds of tokenizing."""
HASH_BLOCK = 8 << 20
PROGRESS_EVERY_S = 3.0
"""Seconds between progress lines."""
SEARCH_WINDOW = 1 << 20
_TXT_CUT = re.compile(rb"\r?\n[\x21-\x7e]")
"""A newline right before a printable ASCII character: GPT-2's pre-tokenizer makes such a newline a token of its
own (no pattern joins a newline to a following non-space, and the patterns that end in whitespace match the
same up to it), so text cut just before it tokenizes exactly as the whole. Blank lines are cut too."""


def digest():
    """The content digest used for sources, shards and datasets (xxh3, 128 bits)."""
    import xxhash

    return xxhash.xxh3_128()


@dataclass(frozen=True)
class Settings:
    """What a shard's tokens depend on besides its bytes."""

    text_field: str = "text"
    chunk_bytes: int = CHUNK_BYTES

    def key(self) -> str:
        return f"{tokenizer.NAME}:{tokenizer.VOCAB_SIZE}:{self.text_field}:{self.chunk_bytes}"


def stat_source(path: Path) -> tuple[int, int]:
    """(size, mtime_ns) of a file, or of a save_to_disk folder's data files."""
    try:
        if path.is_dir():
            files = sorted(path.glob("*.arrow")) + [path / "state.json"]
            return sum(f.stat().st_size for f in files), max(f.stat().st_mtime_ns for f in files)
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError as e:
        raise DataError(f"data source {str(path)!r} cannot be read ({e.strerror or e})") from None


def hash_files(paths: list[Path]) -> str:
    """The content digest of files, read in order."""
    h = digest()
    for p in paths:
        with records.open_file(p) as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
    return h.hexdigest()


def _find_cut(f, target: int, size: int, kind: str, after: int) -> int | None:
    """The first cut at or after `target` (and past `after`, the previous cut): after a newline (jsonl), or
    before a newline that precedes a printable ASCII character, never inside a CRLF (txt). None: no cut
    before the end."""
    pos = max(target - 1, 0)
    while pos < size:
        f.seek(pos)
        window = f.read(SEARCH_WINDOW + 2)
        if kind == "jsonl":
            at = window.find(b"\n", 1)
            if at >= 0:
                return pos + at + 1
        else:
            for match in _TXT_CUT.finditer(window, 1):
                at = match.start()
                if window[at : at + 1] == b"\n" and window[at - 1 : at] == b"\r":
                    at -= 1  # before the whole CRLF
                if pos + at > after:
                    return pos + at
        pos += SEARCH_WINDOW
    return None


def _byte_pieces(path: Path, size: int, kind: str, chunk: int) -> tuple[list[Piece], str]:
    """The pieces of a .txt or .jsonl and the file's content digest, from one read of the file (the cuts
    are found by seeking; the same pass hashes the bytes and counts each piece's lines, for error messages)."""
    cuts = [0]
    h = digest()
    with records.open_file(path) as f:
        while cuts[-1] + chunk < size:
            cut = _find_cut(f, cuts[-1] + chunk, size, kind, cuts[-1])
            if cut is None or cut >= size:
                break
            cuts.append(cut)
        cuts.append(size)
        counts, piece, pos = [0] * (len(cuts) - 1), 0, 0
        f.seek(0)
        while block := f.read(HASH_BLOCK):
            h.update(block)
            start = 0
            while start < len(block):
                end = min(len(block), cuts[piece + 1] - pos)
                counts[piece] += block.count(b"\n", start, end)
                if pos + end >= cuts[piece + 1] and piece + 1 < len(counts):
                    piece += 1
                elif end == start:
                    break
                start = end
            pos += len(block)
    lines = [1]
    for count in counts:
        lines.append(lines[-1] + count)
    last = len(cuts) - 2
    return [
        Piece(str(path), kind, a, b, lines[i], kind != "txt" or i == last)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
    ], h.hexdigest()


def _byte_kind(path: Path) -> str | None:
    """ "txt" or "jsonl" for a file cut at byte offsets (a .json of one object per line is JSON lines), else None."""
    if not path.is_file():
        return None
    kind = records.kind_of(path)
    if kind == "json" and not records.is_json_list(path):
        return "jsonl"
    return kind if kind in ("txt", "jsonl") else None


def _row_pieces(path: Path, kind: str, rows: list[int], sizes: list[int], chunk: int) -> list[Piece]:
    """Pieces of whole units (row groups or rows) of about `chunk` bytes."""
    pieces, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= chunk and i + 1 < len(sizes):
            pieces.append(Piece(str(path), kind, rows[start], rows[i + 1]))
            start, acc = i + 1, 0
    pieces.append(Piece(str(path), kind, rows[start], -1))
    return pieces


def plan_source(path: Path, settings: Settings) -> list[Piece]:
    """The pieces of one source (a file, or a save_to_disk Dataset folder)."""
    chunk = settings.chunk_bytes
    if path.is_dir():
        ds = tables.load_hf(path)
        tables.check_column(ds.data.schema, path, settings.text_field)
        n = ds.num_rows
        per_row = max(ds.data.nbytes // max(n, 1), 1)
        step = max(chunk // per_row, 1)
        starts = list(range(0, n, step)) or [0]
        return [Piece(str(path), "hf", s, min(s + step, n) if s + step < n else -1) for s in starts]
    if _byte_kind(path):
        return _byte_pieces(path, stat_source(path)[0], _byte_kind(path), chunk)[0]
    kind = records.kind_of(path)
    if kind == "json":
        return [Piece(str(path), "json-list")]
    if kind == "parquet":
        meta = tables.parquet_file(path, settings.text_field).metadata
        groups = meta.num_row_groups
        if groups == 0:
            return [Piece(str(path), "parquet", 0, -1)]
        return _row_pieces(
            path, "parquet", list(range(groups + 1)), [meta.row_group(g).total_byte_size for g in range(groups)], chunk
        )
    return [Piece(str(path), kind)]


def _source_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.arrow")) + [path / "state.json"] if path.is_dir() else [path]


def _shard_name(content: str, piece: Piece, settings: Settings) -> str:
    h = digest()
    h.update(f"{FORMAT}\0{settings.key()}\0{content}\0{piece.kind}\0{piece.start}\0{piece.stop}".encode())
    return f"{Path(piece.path).name[:40]}-{h.hexdigest()[:16]}"


def plan(sources: list[Path], settings: Settings, previous: dict | None, say) -> list[dict]:
    """Every source with its size, digest and pieces. A source whose size and mtime match the previous manifest
    keeps its digest and pieces without reading it again."""
    same = previous and previous.get("settings") == settings.key() and previous.get("format") == FORMAT
    known = {s["path"]: s for s in previous["sources"]} if same else {}
    planned, hashed_bytes, t0 = [], 0, time.monotonic()
    for i, path in enumerate(sources):
        size, mtime = stat_source(path)
        old = known.get(str(path))
        if old and old["size"] == size and old["mtime_ns"] == mtime:
            planned.append(old)
            continue
        kind = _byte_kind(path)
        if kind:  # one read gives both
            pieces, content = _byte_pieces(path, size, kind, settings.chunk_bytes)
        else:
            content, pieces = hash_files(_source_files(path)), plan_source(path, settings)
        hashed_bytes += size
        planned.append(
            {
                "path": str(path),
                "size": size,
                "mtime_ns": mtime,
                "digest": content,
                "pieces": [p.to_dict() | {"shard": _shard_name(content, p, settings)} for p in pieces],
            }
        )
        if time.monotonic() - t0 > PROGRESS_EVERY_S:
            say(f"planning: {i + 1}/{len(sources)} sources read ({hashed_bytes / 1e6:,.0f} MB)")
            t0 = time.monotonic()
    return planned
