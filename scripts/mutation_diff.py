"""The mutation score of two revisions, compared without running the whole scope at both.

    python scripts/mutation_diff.py select BEFORE AFTER > /tmp/names    # mutants whose verdict can differ
    python scripts/mutation_diff.py compare BEFORE AFTER                # their verdicts at both, and the score
    python scripts/mutation_diff.py sample BEFORE AFTER N > /tmp/names  # N mutants of the whole scope at random
    python scripts/mutation_diff.py compare BEFORE AFTER --names /tmp/names  # the score of those at both

BEFORE and AFTER are checkouts of the two revisions (a `git worktree` for the older one), each with mutants/
after mutmut's stats run (`scripts/mutation.sh` there collects them; `select` needs only the stats).

A mutant's verdict depends on its function's code and on the tests that judge it: those mutmut's stats run
saw reach the function, cut by scripts/mutmut_plugin.py to the fastest within MUTATION_TEST_BUDGET_S of clean
time. Where the function's code (its AST: formatting and docstrings aside) is the same at both revisions, the
judging tests are the same ones (by file name and test id, so a file moved between tiers is the same file),
and each of those tests is the same (its code, its file's module-level code and helpers, and the fixtures it
names), the mutant is judged the same way at both. `select` prints one mutant-name glob per function where any
of this differs, each with why on stderr; run those at both revisions (`scripts/mutation.sh` takes them after
`--names`, or mutmut run takes them as they are). `compare` reads both results: the verdicts of the selected
functions' mutants side by side, each mutant judged differently by name, and the score of the selected part
at both. What it leaves out is the same at both by the argument above, within the spread of test times at the
budget's edge (a test whose clean time moves across the cut changes the selection, and is then selected).

Where the tests themselves were reorganized (moved between tiers, which orders them differently in the cut, or
into files of other names), nearly every function is selected, and the whole scope at both revisions is hours of
work. `sample` then draws N mutants of the whole scope (seeded; only names both revisions have), to be run at
both; `compare --names` scores exactly those, each revision's verdict beside the other's, counting only mutants
checked at both. The difference of two scores on the same mutants is paired, so it needs far fewer mutants than
either score alone: the share judged differently is what moves it.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_report import KILLED, load_results  # noqa: E402
from mutmut_plugin import judging_tests  # noqa: E402

BUDGET_S = float(os.environ.get("MUTATION_TEST_BUDGET_S", "15"))
FUNCTION_SEPARATOR = "\u01c1"  # mutmut's between a class and its method in a mangled name


def _stripped(node: ast.AST) -> str:
    """The AST without docstrings."""
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            n.body = body[1:] or [ast.Pass()]
    return ast.dump(node)


def functions(root: Path) -> dict[str, str]:
    """mutmut's mangled name (package.module.x_f, package.module.xǁClassǁmethod) -> the function's AST."""
    out = {}
    for path in sorted((root / "elastic_trainer").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{module}.x_{node.name}"] = _stripped(node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        sep = FUNCTION_SEPARATOR
                        out[f"{module}.x{sep}{node.name}{sep}{item.name}"] = _stripped(item)
    return out


class Tests:
    """The test files of one checkout: each test's code, its file's other code and the fixtures of conftest.py."""

    def __init__(self, root: Path):
        self.files: dict[str, list[tuple[str, dict[str, str], dict[str, list[str]]]]] = {}
        self.fixtures: dict[str, set[str]] = {}
        for path in sorted((root / "tests").rglob("*.py")):
            tree = ast.parse(path.read_text())
            own, rest, args = {}, [], {}
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(("test", "Test")):
                    own[node.name] = _stripped(node)
                    args[node.name] = [
                        a.arg
                        for n in ast.walk(node)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for a in n.args.args
                    ]
                else:
                    rest.append(_stripped(node))
                    if path.name == "conftest.py" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.fixtures.setdefault(node.name, set()).add(_stripped(node))
            self.files.setdefault(path.name, []).append(("\n".join(rest), own, args))

    def of(self, test_id: str):
        """(file-level code, test code, fixture names) of a test id, or None where its file name is ambiguous."""
        file, _, rest = test_id.partition("::")
        name = rest.split("::")[0].split("[")[0]
        entries = self.files.get(os.path.basename(file), [])
        if len(entries) != 1 or name not in entries[0][1]:
            return None
        module_code, own, args = entries[0]
        return module_code, own[name], args[name]


def same_test(test_id: str, before: Tests, after: Tests) -> bool:
    a, b = before.of(test_id), after.of(test_id)
    if a is None or b is None or a[:2] != b[:2]:
        return False
    return all(before.fixtures.get(name) == after.fixtures.get(name) for name in b[2])


def _key(test_id: str) -> str:
    file, _, rest = test_id.partition("::")
    return f"{os.path.basename(file)}::{rest}"


def _stats(root: Path) -> dict:
    path = root / "mutants" / "mutmut-stats.json"
    if not path.exists():
        print(f"mutation_diff: no {path}; run mutmut's stats there first (scripts/mutation.sh)", file=sys.stderr)
        raise SystemExit(2)
    return json.loads(path.read_text())


def differing(before: Path, after: Path) -> dict[str, list[str]]:
    """Mangled function name -> why its mutants can be judged differently at the two revisions."""
    sa, sb = _stats(before), _stats(after)
    ta, tb = sa["tests_by_mangled_function_name"], sb["tests_by_mangled_function_name"]
    fa, fb = functions(before), functions(after)
    tests_a, tests_b = Tests(before), Tests(after)
    reasons = {}
    for fn in sorted(set(tb) | {f for f in fb if f in ta}):
        if fn not in fb:
            continue
        why = []
        if fa.get(fn) != fb[fn]:
            why.append("new" if fn not in fa else "code changed")
        ja = judging_tests(ta.get(fn, []), sa["duration_by_test"], BUDGET_S)
        jb = judging_tests(tb.get(fn, []), sb["duration_by_test"], BUDGET_S)
        ka, kb = {_key(t) for t in ja}, {_key(t) for t in jb}
        if ka != kb:
            why.append(f"judging tests {len(ka)} -> {len(kb)}: {len(ka - kb)} left, {len(kb - ka)} came")
        else:
            changed = [t for t in jb if not same_test(t, tests_a, tests_b)]
            if changed:
                why.append(f"{len(changed)} judging tests changed ({changed[0]})")
        if why:
            reasons[fn] = why
    return reasons


def _mangled(mutant: str) -> str:
    return mutant.partition("__mutmut_")[0]


def _verdicts(root: Path) -> dict[str, str]:
    return {m: s for per_file in load_results(root).values() for m, s in per_file.items()}


def sample(before: Path, after: Path, count: int, seed: int = 0) -> list[str]:
    """`count` mutant names drawn at random from those both revisions have, sorted."""
    common = sorted(set(_verdicts(before)) & set(_verdicts(after)))
    return sorted(random.Random(seed).sample(common, min(count, len(common))))


def compare(before: Path, after: Path, selected: set[str], names: set[str] | None = None) -> int:
    """The selected functions' mutants (or exactly `names`, those checked at both) scored at both revisions."""
    va, vb = _verdicts(before), _verdicts(after)
    if names is not None:
        unchecked = {
            m for m in names if va.get(m, "not checked") == "not checked" or vb.get(m, "not checked") == "not checked"
        }
        va = {m: s for m, s in va.items() if m in names and m not in unchecked}
        vb = {m: s for m, s in vb.items() if m in names and m not in unchecked}

    def counted(m: str) -> bool:
        return m in vb if names is not None else _mangled(m) in selected

    pairs = Counter()
    differ = []
    score = {"before": [0, 0], "after": [0, 0]}
    for side, verdicts in (("before", va), ("after", vb)):
        for m, s in verdicts.items():
            if counted(m):
                score[side][0] += s in KILLED
                score[side][1] += 1
    for m in sorted(vb):
        if not counted(m):
            continue
        a, b = va.get(m, "absent"), vb[m]
        pairs[(a, b)] += 1
        if (a in KILLED) != (b in KILLED):
            differ.append((m, a, b))
    if names is not None:
        print(f"{len(names)} mutants named, {len(unchecked)} not checked at both (left out)")
    else:
        print(f"{len(selected)} functions selected")
    for side, (killed, total) in score.items():
        pct = 100.0 * killed / total if total else 0.0
        # Wilson's 95 % interval of a share, for a sample
        z, p = 1.96, (killed / total if total else 0.0)
        half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total) if total else 0
        mid = (p + z * z / (2 * total)) / (1 + z * z / total) if total else 0
        interval = f"; 95 % {100 * (mid - half):.1f}-{100 * (mid + half):.1f}%" if names is not None else ""
        print(f"  {side}: {killed} / {total} killed ({pct:.1f}%{interval})")
    print("verdicts (before -> after), mutants that exist after:")
    for (a, b), n in sorted(pairs.items(), key=lambda x: -x[1]):
        print(f"  {a:>12} -> {b:<12} {n}")
    print(f"{len(differ)} judged differently:")
    for m, a, b in differ:
        print(f"  {m}: {a} -> {b}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["select", "compare", "sample"])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("count", type=int, nargs="?", help="sample: how many mutants")
    parser.add_argument("--seed", type=int, default=0, help="sample: the random draw's seed (default 0)")
    parser.add_argument("--names", type=Path, help="compare: score exactly the mutants named in this file")
    args = parser.parse_args(argv)
    if args.what == "sample":
        if not args.count or args.count < 1:
            parser.error("sample needs a count of mutants >= 1")
        _stats(args.before), _stats(args.after)
        print("\n".join(sample(args.before, args.after, args.count, args.seed)))
        return 0
    if args.what == "compare" and args.names is not None:
        names = {line.strip() for line in args.names.read_text().splitlines() if line.strip()}
        return compare(args.before, args.after, set(), names)
    reasons = differing(args.before, args.after)
    if args.what == "select":
        for fn, why in reasons.items():
            print(f"{fn}__mutmut_*")
            print(f"{fn}: {'; '.join(why)}", file=sys.stderr)
        print(f"[mutation_diff] {len(reasons)} functions", file=sys.stderr)
        return 0
    return compare(args.before, args.after, set(reasons))


if __name__ == "__main__":
    sys.exit(main())
