"""README.md and docs/**/*.md against the code they describe.

1. Every command they show that is cheap to run (a `--help`, `--dry-run` or `--check` form, an instant `plan`,
   `kubernetes`'s manifest, `python scripts/check_structure.py`) runs as written from the repository root and
   exits 0; the others (they train, or need a run, a checkpoint or a cluster) are not run.
2. Every repository path they name exists: backticked tokens and command arguments under elastic_trainer/,
   configs/, launch/, benchmarks/, scripts/, tests/ or docs/, the package's own module paths (`plan/memory.py`,
   `train/job`), `elastic_trainer.*` module names, bare source file names, and relative links (with their
   `#anchors`), resolved from the doc's folder.
3. Every `--flag` they name is a flag of the program it is given to: `elastic-trainer` commands (and `./run.sh`,
   `launch/slurm/train.sbatch`, `torchrun ... train`) against the argparse parsers, walked in-process; torchrun's
   against torch's own parser; a repository script's against its source; other programs' against an allowlist.
   A flag named on its own must belong to one of these.

A self-test feeds the checkers a doc with a missing path, an unknown flag and a failing command, so each check is
shown to fail.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from elastic_trainer.cli_parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
PACKAGE = ROOT / "elastic_trainer"

# ---------------------------------------------------------------------------------------------------- allowlists

# Paths a doc names that are intentionally not in the repository.
MISSING_PATHS_OK = {
    # TensorBoard scalar tags (training.md), not module paths
    "train/loss": "TensorBoard tag",
    "train/learning_rate": "TensorBoard tag",
    "train/grad_norm": "TensorBoard tag",
    "train/tokens_per_s": "TensorBoard tag",
    "train/step_time_s": "TensorBoard tag",
    "elastic/world_size": "TensorBoard tag",
    "elastic/downtime_s": "TensorBoard tag",
    "elastic/layout": "TensorBoard tag",
    # Megatron-LM's tokenizing script (data.md), another project's file
    "preprocess_data.py": "Megatron-LM's script",
}

# Long flags of programs that are not this project's, by program (only what the docs use).
OTHER_PROGRAM_FLAGS = {
    "sbatch": {"--nodes", "--gpus-per-node", "--cpus-per-task", "--requeue", "--signal"},  # Slurm's sbatch
    "pytest": {"--durations"},  # ./scripts/test.sh passes its arguments to pytest
    "pip": {"--no-build-isolation"},  # pip install's
    "tensorboard": {"--logdir"},  # TensorBoard's server
    "ruff": {"--check"},  # `ruff format --check`
}
# Flags the docs name on their own that belong to other programs.
OTHER_FLAGS = {
    "--append-eod": "Megatron-LM's preprocess_data.py (data.md)",
    "--data-path": "Megatron-LM's training flag (data.md)",
    "--durations": "pytest's (testing.md: an argument of ./scripts/test.sh)",
}

# ------------------------------------------------------------------------------------------------ markdown parts

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass
class Doc:
    path: Path
    blocks: list[tuple[int, str, list[str]]] = field(default_factory=list)  # first line, language, lines
    spans: list[tuple[int, str]] = field(default_factory=list)  # inline code: line, text
    links: list[tuple[int, str]] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)  # text outside code and link targets
    problems: list[str] = field(default_factory=list)

    def where(self, line: int) -> str:
        try:
            return f"{self.path.relative_to(ROOT)}:{line}"
        except ValueError:
            return f"{self.path}:{line}"


def parse_doc(path: Path, text: str | None = None) -> Doc:
    doc = Doc(path)
    text = path.read_text() if text is None else text
    outside: list[tuple[int, str]] = []
    block = None
    for n, line in enumerate(text.splitlines(), 1):
        if block is None:
            m = FENCE.match(line)
            if m:
                block = (n + 1, m.group(2), [], m.group(1))
                outside.append((n, ""))
            else:
                outside.append((n, line))
        elif line.strip().startswith(block[3]) and not line.strip().strip(block[3][0]):
            doc.blocks.append(block[:3])
            block = None
            outside.append((n, ""))
        else:
            block[2].append(line)
            outside.append((n, ""))
    if block is not None:
        doc.problems.append(f"{doc.where(block[0] - 1)}: code block never closed")
    # paragraphs (inline code may wrap lines, never blank ones)
    paragraph: list[tuple[int, str]] = []
    for n, line in [*outside, (len(outside) + 1, "")]:
        if line.strip():
            paragraph.append((n, line))
            continue
        if paragraph:
            _paragraph(doc, paragraph[0][0], "\n".join(s for _, s in paragraph))
        paragraph = []
    return doc


def _paragraph(doc: Doc, first: int, text: str) -> None:
    if text.count("`") % 2:
        doc.problems.append(f"{doc.where(first)}: an odd number of backticks in this paragraph")
    rest = text
    for m in CODE_SPAN.finditer(text):
        line = first + text[: m.start()].count("\n")
        doc.spans.append((line, " ".join(m.group(1).replace("\\|", "|").split())))
        rest = rest.replace(m.group(0), " " * len(m.group(0)), 1)
    for m in LINK.finditer(rest):
        doc.links.append((first + rest[: m.start()].count("\n"), m.group(1)))
    rest = LINK.sub("]", rest)
    for i, line in enumerate(rest.split("\n")):
        doc.prose.append((first + i, line))


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@cache
def docs() -> tuple[Doc, ...]:
    return tuple(parse_doc(p) for p in doc_files())


# ------------------------------------------------------------------------------------------------------ commands


@cache
def cli_flags() -> dict[str, set[str]]:
    """Every (sub)command of `elastic-trainer` ("train", "checkpoint inspect", ...) and its option strings."""
    found: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        own: set[str] = set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}".strip())
            else:
                own.update(action.option_strings)
        found[name] = own

    walk(build_parser(), "")
    return found


@cache
def torchrun_flags() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {s for a in get_args_parser()._actions for s in a.option_strings}


SUBCOMMANDS = {name for name in cli_flags() if name and " " not in name}
# `plan --explain`: an elastic-trainer command named without its program (a bare `torchrun` is torch's)
LED = SUBCOMMANDS - {"torchrun"}
ET = {"elastic-trainer", ".venv/bin/elastic-trainer"}
PYTHON = {"python", "python3", ".venv/bin/python"}
PROGRAMS = {
    *ET,
    *PYTHON,
    "./run.sh",
    "bash",
    "sh",
    "source",
    "sbatch",
    "srun",
    "torchrun",
    "tensorboard",
    "pip",
    "nohup",
    "touch",
    "mv",
    "cp",
    "ssh",
    "kubectl",
    ".venv/bin/ruff",
    "ruff",
}
REPO_SCRIPT = re.compile(r"(\./)?(benchmarks|scripts|launch)/[\w./-]+\.(py|sh|sbatch)")
SEPARATORS = {"|", "&&", "||", ";", "&"}


@dataclass(frozen=True)
class Command:
    where: str
    tokens: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.tokens)


def is_command(tokens: list[str]) -> bool:
    if not tokens:
        return False
    first = tokens[0]
    if first == "./run.sh" or (first in PROGRAMS and len(tokens) > 1):
        return True
    if REPO_SCRIPT.fullmatch(first) and len(tokens) > 1:
        return True
    # `plan --model ...`, `checkpoint inspect DIR`: an elastic-trainer command without its program's name
    return first in LED and len(tokens) > 1 and (tokens[1].startswith("--") or f"{first} {tokens[1]}" in cli_flags())


def commands_of(doc: Doc) -> list[Command]:
    found = []
    for first, lang, lines in doc.blocks:
        if lang not in SHELL_LANGS:
            continue
        logical, start = "", None
        for i, line in enumerate(lines):
            start = first + i if start is None else start
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            tokens = shlex.split(logical, comments=True)
            if tokens:
                found.append(Command(doc.where(start), tuple(tokens)))
            logical, start = "", None
    for line, span in doc.spans:
        try:
            tokens = shlex.split(span)
        except ValueError:
            continue
        if tokens[:1] == ["-m"]:  # `-m elastic_trainer.rank --job ...`: a python command's tail
            tokens = ["python", *tokens]
        if is_command(tokens):
            found.append(Command(doc.where(line), tuple(tokens)))
    return found


def segments(tokens: tuple[str, ...] | list[str]) -> list[list[str]]:
    """A command line cut at pipes and `&&`, without redirections, `nohup`, `env` and VAR=VALUE prefixes."""
    out, current, skip = [], [], False
    for t in tokens:
        if skip:
            skip = False
        elif t in SEPARATORS:
            out.append(current)
            current = []
        elif re.fullmatch(r"\d*>>?(&\d+)?|<", t):
            skip = not t.endswith(tuple("0123456789"))
        elif re.fullmatch(r"\d*>>?\S+", t):
            pass
        else:
            current.append(t)
    out.append(current)
    cleaned = []
    for seg in out:
        while seg and (seg[0] in ("nohup", "env", "time") or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", seg[0])):
            seg = seg[1:]
        if seg:
            cleaned.append(seg)
    return cleaned


def as_flag(token: str) -> str | None:
    m = re.fullmatch(r"(--[A-Za-z0-9][\w-]*)(=.*)?", token.strip("[]()'\",;:."))
    return m.group(1) if m else None


def flags_in(tokens: list[str]) -> list[str]:
    return [f for t in tokens if (f := as_flag(t))]


def et_groups(rest: list[str]) -> list[tuple[str, list[str]]]:
    """(program, arguments) for `elastic-trainer REST`: a sub-command's, and `train`'s after `--` / `train`."""
    if not rest or rest[0].startswith("-") or rest[0] in ("...", "SUB"):
        return [("elastic-trainer", rest)]
    key, rest = rest[0], rest[1:]
    if rest and f"{key} {rest[0]}" in cli_flags():
        key, rest = f"{key} {rest[0]}", rest[1:]
    if key == "torchrun" and "train" in rest:
        i = rest.index("train")
        return [("torchrun", rest[:i]), ("elastic-trainer train", rest[i + 1 :])]
    if key in ("launch", "kubernetes", "experiment") and "--" in rest:
        i = rest.index("--")
        return [(f"elastic-trainer {key}", rest[:i]), ("elastic-trainer train", rest[i + 1 :])]
    return [(f"elastic-trainer {key}", rest)]


def groups(segment: list[str]) -> list[tuple[str, list[str]]]:
    """The programs a command segment gives arguments to: [(program, arguments)]."""
    prog, rest = segment[0], segment[1:]
    if prog in ET:
        return et_groups(rest)
    if prog in LED:
        return et_groups(segment)
    if prog == "./run.sh":
        return et_groups(["launch", *rest])
    if prog in PYTHON:
        if rest[:1] == ["-m"] and len(rest) > 1:
            module, rest = rest[1], rest[2:]
            if module == "elastic_trainer.cli":
                return et_groups(rest)
            if module == "torch.distributed.run":
                return torchrun_groups(rest)
            if module.startswith("elastic_trainer."):
                return [(f"script:{module_file(module)}", rest)]
            return [(f"other:{module}", rest)]
        return [(f"script:{rest[0].removeprefix('./')}", rest[1:])] if rest else []
    if prog in ("bash", "sh", "source") and rest:
        return [(f"script:{rest[0].removeprefix('./')}", rest[1:])]
    if prog == "torchrun":
        return torchrun_groups(rest)
    if prog == "sbatch":
        i = next((i for i, t in enumerate(rest) if t.endswith(".sbatch")), len(rest))
        found = [("sbatch", rest[:i])]
        if i < len(rest):
            script = rest[i].removeprefix("./")
            # everything after launch/slurm/train.sbatch goes to `train` on every rank
            program = "elastic-trainer train" if script == "launch/slurm/train.sbatch" else f"script:{script}"
            found.append((program, rest[i + 1 :]))
        return found
    name = prog.removeprefix("./")
    if name in ("scripts/test.sh",):
        return [("pytest", rest)]
    if REPO_SCRIPT.fullmatch(prog):
        return [(f"script:{name}", rest)]
    if prog in (".venv/bin/ruff", "ruff"):
        return [("ruff", rest)]
    return [(prog if prog in OTHER_PROGRAM_FLAGS else f"other:{prog}", rest)]


def torchrun_groups(rest: list[str]) -> list[tuple[str, list[str]]]:
    if "-m" in rest:
        i = rest.index("-m")
        module = rest[i + 1] if i + 1 < len(rest) else ""
        after = et_groups(rest[i + 2 :]) if module == "elastic_trainer.cli" else [(f"other:{module}", [])]
        return [("torchrun", rest[:i]), *after]
    return [("torchrun", rest)]


def targets(segment: list[str]) -> list[tuple[str, list[str]]]:
    """The programs a command segment gives flags to: [(program, flags)]."""
    return [(program, flags_in(args)) for program, args in groups(segment)]


def module_file(module: str) -> str:
    path = Path(*module.split("."))
    return str(path / "__main__.py") if (ROOT / path).is_dir() else f"{path}.py"


# ---------------------------------------------------------------------------------------------------- flag check


@cache
def source(path: str) -> str | None:
    file = ROOT / path
    return file.read_text(errors="replace") if file.is_file() else None


@cache
def declared_flags(path: str) -> frozenset[str] | None:
    """The option strings of a Python script's `add_argument(...)` calls; None when it declares none."""
    text = source(path) or ""
    found = {
        flag
        for call in re.finditer(r"add_argument\(\s*((?:(['\"])-[^'\"]*\2\s*,?\s*)+)", text)
        for flag in re.findall(r"['\"](-[^'\"]*)['\"]", call.group(1))
    }
    return frozenset(found) if path.endswith(".py") and found else None


def script_has(path: str, flag: str) -> bool:
    """`flag` is one of the script's: declared by its argparse calls, or (a shell script) in its text."""
    text = source(path)
    if text is None:
        return False
    declared = declared_flags(path)
    if declared is not None:
        return flag in declared
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def flag_problem(program: str, flag: str) -> str | None:
    """Why `flag` is not a flag of `program`, or None."""
    if program.startswith("elastic-trainer"):
        key = program.removeprefix("elastic-trainer").strip()
        if key not in cli_flags():
            return f"`{program}` is not a command"
        return None if flag in cli_flags()[key] else f"{flag} is not a flag of `{program}`"
    if program == "torchrun":
        return None if flag in torchrun_flags() else f"{flag} is not one of torchrun's flags"
    if program.startswith("script:"):
        path = program.removeprefix("script:")
        if source(path) is None:
            return f"{flag}: the script {path} does not exist"
        return None if script_has(path, flag) else f"{flag} does not appear in {path}"
    if program in OTHER_PROGRAM_FLAGS:
        return None if flag in OTHER_PROGRAM_FLAGS[program] else f"{flag} of {program} is not in OTHER_PROGRAM_FLAGS"
    return f"{flag} of {program.removeprefix('other:')}: an unknown program (add it to OTHER_PROGRAM_FLAGS)"


def placeholders(tokens: list[str] | tuple[str, ...]) -> list[str]:
    """`...`, `[--json]`, `FILE`, `TRAIN-FLAGS`: tokens that stand for what the reader fills in."""
    return [t for t in tokens if "..." in t or t.startswith("[") or t.endswith("]") or PLACEHOLDER.fullmatch(t)]


def parse_problem(program: str, args: list[str]) -> str | None:
    """Why `args` do not parse as `program` parses them (argparse only: nothing runs), or None."""
    from elastic_trainer.cli_parser import UsageError, train_args

    if {"-h", "--help"} & set(args):
        return None
    try:
        if program == "elastic-trainer train":
            train_args(args)
        elif program.startswith("elastic-trainer "):
            build_parser().parse_args([*program.split()[1:], *args])
        elif program == "torchrun":
            from torch.distributed.run import get_args_parser

            parser = get_args_parser()

            def refuse(message: str):
                raise UsageError(f"torchrun: {message}")

            parser.error = refuse
            parser.parse_args([*args, "-m", "elastic_trainer.rank"])
    except UsageError as e:
        return str(e)
    return None


def scripts_named(doc: Doc) -> set[str]:
    texts = [s for _, s in doc.spans] + [line for _, _, lines in doc.blocks for line in lines]
    texts += [s for _, s in doc.prose] + [t for _, t in doc.links]
    return {
        m.group(0).removeprefix("./")
        for text in texts
        for m in re.finditer(r"(\./)?(benchmarks|scripts|launch|elastic_trainer)/[\w./-]+\.(py|sh|sbatch)", text)
    }


@cache
def all_known_flags() -> frozenset[str]:
    known = set().union(*cli_flags().values(), torchrun_flags(), *OTHER_PROGRAM_FLAGS.values(), OTHER_FLAGS)
    return frozenset(known)


def check_flags(doc: Doc) -> tuple[list[str], int]:
    """Problems with the flags a doc names, and how many flag mentions were checked."""
    problems, checked = [], 0
    in_commands: set[tuple[str, str]] = set()
    for command in commands_of(doc):
        for segment in segments(command.tokens):
            # a whole command line with its program named (not `plan --explain` in a sentence) also parses
            whole = segment[0] not in LED and not placeholders(segment)
            for program, args in groups(segment):
                if program.startswith("elastic-trainer ") and program.split(" ", 1)[1] not in cli_flags():
                    checked += 1
                    problems.append(f"{command.where}: `{program}` is not a command (in `{command.text}`)")
                    continue
                flags = flags_in(args)
                for flag in flags:
                    checked += 1
                    in_commands.add((command.where, flag))
                    if why := flag_problem(program, flag):
                        problems.append(f"{command.where}: {why} (in `{command.text}`)")
                        whole = False
                if whole and flags and (why := parse_problem(program, args)):
                    problems.append(f"{command.where}: `{command.text}` does not parse: {why}")
    scripts = scripts_named(doc)
    known = all_known_flags()
    alone = [(line, text) for line, text in doc.spans]
    alone += [
        (first + i, line)
        for first, lang, lines in doc.blocks
        if lang not in SHELL_LANGS
        for i, line in enumerate(lines)
    ]
    alone += doc.prose
    for line, text in alone:
        for m in re.finditer(r"(?<![\w`-])(--[A-Za-z0-9][\w-]*)", text):
            flag = m.group(1)
            if (doc.where(line), flag) in in_commands:
                continue
            checked += 1
            if flag not in known and not any(script_has(s, flag) for s in scripts):
                problems.append(
                    f"{doc.where(line)}: {flag} is no flag of elastic-trainer, torchrun or a script this doc names"
                )
    return problems, checked


# ---------------------------------------------------------------------------------------------------- path check

PATH_PREFIXES = ("elastic_trainer/", "configs/", "launch/", "benchmarks/", "scripts/", "tests/", "docs/", ".ci/")
SOURCE_SUFFIXES = (".py", ".sh", ".sbatch")
IGNORED_PREFIXES = ("runs/", "RUN_DIR", ".venv", "/", "~", "$", "http://", "https://", "mailto:")
PLACEHOLDER = re.compile(r"(?!README$)[A-Z][A-Z_-]*")  # RUN_DIR, JOB, NAME-KEY (README is a real name)


@cache
def subpackages() -> frozenset[str]:
    return frozenset(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())


@cache
def file_names() -> frozenset[str]:
    skip = {".git", ".venv", "node_modules", "__pycache__", "mutants"}
    names = set()
    for _, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        names.update(filenames)
    return frozenset(names)


def is_placeholder(path: str) -> bool:
    if "..." in path or any(c in path for c in "<>{}[]|"):
        return True
    return any(PLACEHOLDER.fullmatch(part.split(".")[0]) for part in path.strip("/").split("/") if part)


def exists(path: Path) -> bool:
    return bool(glob.glob(str(path))) if "*" in str(path) else path.exists()


def path_candidates(doc: Doc) -> list[tuple[int, str]]:
    """Tokens of inline code and of code blocks that look like repository paths."""
    found = []
    texts = list(doc.spans) + [(first + i, line) for first, _, lines in doc.blocks for i, line in enumerate(lines)]
    for line, text in texts:
        for token in text.split():
            token = token.strip("'\"`,;:()")
            token = token.split("=", 1)[-1] if token.startswith("--") else token
            if token and ("/" in token or token.endswith(SOURCE_SUFFIXES)):
                found.append((line, token))
            elif token.startswith("elastic_trainer.") and re.fullmatch(r"[\w.]+", token):
                found.append((line, token))
    return found


def path_problem(doc: Doc, token: str) -> tuple[bool, str | None]:
    """(whether `token` names a repository path, why that path does not exist or None)."""
    if token in MISSING_PATHS_OK or token.startswith(IGNORED_PREFIXES) or is_placeholder(token):
        return False, None
    if token.startswith("elastic_trainer."):
        return True, module_problem(token)
    plain = token.removeprefix("./")
    first = plain.split("/")[0]
    if plain.startswith("../"):
        return True, None if exists(
            doc.path.parent / plain
        ) else f"{token} does not exist (from {doc.path.parent.name}/)"
    if plain.startswith(PATH_PREFIXES) or plain in ("run.sh", "hosts.txt"):
        # launch/ is the repository's folder, or the package's (`launch/notices.py`, `launch/driver.Driver`)
        bases = (ROOT, PACKAGE) if first == "launch" else (ROOT,)
        return True, None if any(in_tree(base, plain) for base in bases) else f"{token} does not exist"
    if first in subpackages():  # a module path inside the package: `plan/memory.py`, `train/job`, `model/`
        return True, None if in_tree(PACKAGE, plain) else f"{token} is not a module or folder of elastic_trainer/"
    if "/" not in plain and plain.endswith(SOURCE_SUFFIXES):
        return True, None if plain in file_names() else f"{token}: no file of that name in the repository"
    return False, None


def in_tree(base: Path, path: str) -> bool:
    """`path` under `base`: as named, as a module without .py, or as module.NAME of a name it defines."""
    if exists(base / path) or exists(base / f"{path}.py"):
        return True
    module, _, name = path.rpartition(".")
    file = base / f"{module}.py"
    return bool(module) and file.is_file() and defines(file, name)


def defines(file: Path, name: str) -> bool:
    return (
        re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", file.read_text(), re.M)
        is not None
    )


def module_problem(name: str) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        file = base.with_suffix(".py") if not base.is_dir() else base / "__init__.py"
        if file.exists():
            missing = parts[n:]
            if not missing:
                return None
            if len(missing) == 1 and defines(file, missing[0]):
                return None
            return f"{name}: {'.'.join(parts[:n])} has no {'.'.join(missing)}"
    return f"{name} is not a module"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@cache
def anchors(path: Path) -> frozenset[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            found.add(slug(m.group(1)))
    return frozenset(found)


def link_problem(doc: Doc, target: str) -> str | None:
    if target.startswith(("http://", "https://", "mailto:")):
        return None
    file, _, anchor = target.partition("#")
    path = (doc.path.parent / file) if file else doc.path
    if not path.exists():
        return f"link {target}: {file} does not exist"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"link {target}: no heading #{anchor} in {file or doc.path.name}"
    return None


def check_paths(doc: Doc) -> tuple[list[str], int]:
    problems, checked = [], 0
    for line, token in path_candidates(doc):
        is_path, why = path_problem(doc, token)
        checked += is_path
        if why:
            problems.append(f"{doc.where(line)}: {why}")
    for line, target in doc.links:
        checked += 1
        if why := link_problem(doc, target):
            problems.append(f"{doc.where(line)}: {why}")
    return problems, checked


# ------------------------------------------------------------------------------------------------- running them

CHEAP_FLAGS = {"--help", "-h", "--dry-run", "--check"}


def skip_reason(command: Command) -> str | None:
    """None when the command is cheap enough to run here; else why not."""
    parts = segments(command.tokens)
    if not parts:
        return "empty"
    first = parts[0]
    words = set(first)
    unfilled = placeholders(first)
    if first[0] in (".venv/bin/ruff", "ruff"):
        return "tests/e2e/test_lint.py runs ruff on the whole tree"
    is_et = first[0] in ET or first[0] in LED or first[0] == "./run.sh"
    sub = first[0] if first[0] in LED else (first[1] if len(first) > 1 and first[0] in ET else "")
    cheap = False
    if (is_et or first[0] == "torchrun") and words & CHEAP_FLAGS:
        cheap = True
    elif sub == "plan" and "--gpus" in words and "--run-dir" not in words:
        cheap = True  # the planner alone (with the GPU count it needs; no run folder to read): instant
    elif sub == "kubernetes" and "--image" in words:
        cheap = True  # prints the manifest (a pipe into kubectl is left out)
    elif first[0] in PYTHON and first[1:2] == ["scripts/check_structure.py"]:
        cheap = True  # reads the package's source
    if not cheap:
        return (
            "not a cheap form: it trains, measures, installs, changes files or needs a run, a checkpoint or a cluster"
        )
    if unfilled:
        return f"has placeholders ({' '.join(unfilled)})"
    if len(parts) > 1 and sub != "kubernetes":
        return "a pipeline"
    return None


def argv_of(tokens: list[str]) -> list[str]:
    """A doc's command as this interpreter runs it (`elastic-trainer` and `python` from sys.executable's venv)."""
    bindir = Path(sys.executable).parent
    if tokens[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *tokens[1:]]
    if tokens[0] in ET or tokens[0] in LED:
        rest = tokens[1:] if tokens[0] in ET else tokens
        program = bindir / "elastic-trainer"
        return [str(program), *rest] if program.exists() else [sys.executable, "-m", "elastic_trainer.cli", *rest]
    if tokens[0] in PYTHON:
        return [sys.executable, *tokens[1:]]
    return list(tokens)


def run_command(command: Command, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if sys.prefix != sys.base_prefix:
        env["ET_VENV"] = sys.prefix  # ./run.sh's set-up uses this interpreter's venv
    return subprocess.run(
        argv_of(segments(command.tokens)[0]),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def command_problem(command: Command) -> str | None:
    proc = run_command(command)
    if proc.returncode == 0:
        return None
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return f"{command.where}: `{command.text}` exited {proc.returncode}:\n{tail}"


def unique_commands() -> dict[str, list[Command]]:
    found: dict[str, list[Command]] = {}
    for doc in docs():
        for command in commands_of(doc):
            found.setdefault(command.text, []).append(command)
    return found


def tree(folder: Path) -> set[Path]:
    return set(folder.rglob("*")) if folder.exists() else set()


# ------------------------------------------------------------------------------------------------------- tests

COMMANDS = unique_commands()
# Only the cheap forms become cases (the others would be a skip line each in every run's summary); the doc
# commands left out are counted by test_the_docs_give_the_checks_something_to_check.
RUNNABLE = sorted(text for text, found in COMMANDS.items() if skip_reason(found[0]) is None)


@pytest.mark.parametrize("text", RUNNABLE, ids=lambda t: t[:80])
def test_command_runs_as_written(text):
    command = COMMANDS[text][0]
    where = ", ".join(c.where for c in COMMANDS[text])
    runs = ROOT / "runs"
    had_runs, before = runs.exists(), tree(runs)
    problem = command_problem(command)
    created = sorted(tree(runs) - before)
    for path in sorted(created, reverse=True):  # what it wrote there goes again, deepest first
        path.unlink() if path.is_file() or path.is_symlink() else path.rmdir()
    if runs.exists() and not had_runs and not any(runs.iterdir()):
        created.append(runs)
        runs.rmdir()
    assert problem is None, f"{where}: {problem}"
    assert not created, f"{where}: `{text}` wrote into runs/: {[str(p.relative_to(ROOT)) for p in created[:5]]}"


@pytest.mark.parametrize("command", sorted(name for name in cli_flags() if name))
def test_every_command_has_help(command, capsys):
    """`elastic-trainer SUB --help`, which every one-line usage error points to, prints usage and exits 0."""
    from elastic_trainer import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: elastic-trainer {command}")


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_exist(path):
    doc = parse_doc(path)
    problems, _ = check_paths(doc)
    assert not doc.problems + problems, "\n".join(doc.problems + problems)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_flags_exist(path):
    problems, _ = check_flags(parse_doc(path))
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"


def test_the_docs_give_the_checks_something_to_check():
    """Guards the extraction itself: an empty harvest would pass every test above."""
    counts = {"commands": len(COMMANDS), "runnable": sum(skip_reason(c[0]) is None for c in COMMANDS.values())}
    counts["paths"] = sum(check_paths(d)[1] for d in docs())
    counts["flags"] = sum(check_flags(d)[1] for d in docs())
    assert counts["commands"] >= 40 and counts["runnable"] >= 8, counts
    assert counts["paths"] >= 150 and counts["flags"] >= 300, counts


def test_the_checks_can_fail(tmp_path):
    """A doc with a missing path, a dead link, unknown flags and a failing command: each is reported."""
    fake = tmp_path / "docs" / "fake.md"
    fake.parent.mkdir()
    fake.write_text(
        "# Fake\n\n"
        "Read `scripts/no_such_script.py`, `plan/no_such_module.py`, `elastic_trainer.plan.no_such_name`,\n"
        "[a page](gone.md), [a heading](../docs/fake.md#no-such-heading), `--no-such-option`, `elastic-trainer frob`.\n"
        "Fine: `scripts/check_structure.py`, `plan/memory.py`, [here](#fake), `--save-every`.\n\n"
        "```bash\n"
        ".venv/bin/elastic-trainer plan --model gpt-tiny --gpus 2 --no-such-flag\n"
        "./run.sh --dry-run -- --no-such-train-flag\n"
        "python benchmarks/gpu/checkup.py --no-such-checkup-flag\n"
        ".venv/bin/elastic-trainer plan --model gpt-tiny --gpus two\n"
        "elastic-trainer experiment --dry-run --no-such-experiment-flag\n"
        "```\n"
    )
    doc = parse_doc(fake)
    paths, _ = check_paths(doc)
    assert len(paths) == 5, paths
    for missing in ("scripts/no_such_script.py", "plan/no_such_module.py", "no_such_name", "gone.md", "#no-such"):
        assert any(missing in p for p in paths), (missing, paths)
    flags, _ = check_flags(doc)
    assert len(flags) == 7, flags
    assert any("plan --model gpt-tiny --gpus two` does not parse" in p and "'two'" in p for p in flags), flags
    assert any("`elastic-trainer frob` is not a command" in p for p in flags), flags
    for unknown, program in [
        ("--no-such-option", "a script this doc names"),
        ("--no-such-flag", "`elastic-trainer plan`"),
        ("--no-such-train-flag", "`elastic-trainer train`"),
        ("--no-such-checkup-flag", "benchmarks/gpu/checkup.py"),
        ("--no-such-experiment-flag", "`elastic-trainer experiment`"),
    ]:
        assert any(unknown in p and program in p for p in flags), (unknown, flags)
    failing = next(c for c in commands_of(doc) if "experiment" in c.text)
    assert skip_reason(failing) is None
    problem = command_problem(failing)
    assert problem is not None and "exited 2" in problem and "--no-such-experiment-flag" in problem, problem
    broken = parse_doc(fake, "one `unbalanced\n\n```bash\n./run.sh --dry-run\n")
    assert len(broken.problems) == 2, broken.problems
