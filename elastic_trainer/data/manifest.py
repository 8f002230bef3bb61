"""A prepared dataset's manifest: what it was made from and of, its digest (its identity), and the bad records
it left out."""

from __future__ import annotations

from pathlib import Path

from elastic_trainer.data import tokenizer
from elastic_trainer.data.pieces import FORMAT, digest
from elastic_trainer.data.records import Bad, DataError


def check_bad_records(manifest: dict, skip_bad: bool) -> None:
    """A dataset prepared with --skip-bad-records left records out: a run without the flag refuses it."""
    if manifest.get("bad_records") and not skip_bad:
        raise DataError(f"the data has {bad_summary(manifest)} (pass --skip-bad-records to leave them out)")


def bad_summary(manifest: dict) -> str | None:
    if not manifest.get("bad_records"):
        return None
    return f"{manifest['bad_records']} bad record(s); first: {'; '.join(manifest.get('first_bad_records', []))}"


def build(planned, shard_records, settings, dtype, skip_bad) -> dict:
    h = digest()
    h.update(f"{FORMAT}\0{tokenizer.NAME}\0{dtype.name}\0".encode())
    for r in shard_records:
        h.update(f"{r['digest']}:{r['tokens']}\n".encode())
    bad = Bad()
    for r in shard_records:
        bad.merge(r["bad_records"], r["first_bad_records"])
    return {
        "format": FORMAT,
        "digest": h.hexdigest(),
        "tokenizer": {
            "name": tokenizer.NAME,
            "vocab_size": tokenizer.VOCAB_SIZE,
            "eot": tokenizer.EOT_ID,
            "encoder_json_sha256": tokenizer.ENCODER_JSON_SHA256,
            "vocab_bpe_sha256": tokenizer.VOCAB_BPE_SHA256,
        },
        "dtype": dtype.name,
        "settings": settings.key(),
        "text_field": settings.text_field,
        "tokens": sum(r["tokens"] for r in shard_records),
        "documents": sum(r["documents"] for r in shard_records),
        "bad_records": bad.count,
        "first_bad_records": bad.first,
        "skip_bad_records": skip_bad,
        "sources": planned,
        "shards": [{k: r[k] for k in ("name", "tokens", "sequences", "documents", "digest")} for r in shard_records],
    }


def remove_stale(shards: Path, keep: set[str]) -> int:
    removed = 0
    for path in shards.glob("*.json"):
        name = path.name[: -len(".json")]
        if name not in keep:
            for ext in ("json", "bin", "idx"):
                (shards / f"{name}.{ext}").unlink(missing_ok=True)
            removed += 1
    return removed


def check_length(manifest: dict, min_tokens: int, sources) -> None:
    """Data with no tokens, or fewer than one sample needs, is bad input."""
    if manifest["tokens"] == 0:
        raise DataError(f"the data has no text: {_names(sources)} hold no non-empty documents")
    if manifest["tokens"] < min_tokens:
        raise DataError(too_short(manifest["tokens"], min_tokens, sources))


def too_short(tokens: int, min_tokens: int, sources) -> str:
    """Data with fewer tokens than one sample needs, in one line."""
    return (
        f"the data has {tokens} tokens ({_names(sources)}); one sample of --seq-len {min_tokens - 1} needs "
        f"{min_tokens} (valid: more text or a shorter --seq-len)"
    )


def _names(files) -> str:
    return ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
