"""Score a mutmut run: per module killed / total, timeouts, the survivors by name, and the mutation score.

    python scripts/mutation_report.py [MODULE ...] [--equivalent FILE] [--survivors FILE] [--diff] [--min-score PCT]

Reads mutmut's results under mutants/ (run from the project root, after scripts/mutation.sh). MODULE is a
source path or a folder (elastic_trainer/data/order.py, elastic_trainer/parallel/); default: every mutated
file. Score = killed / (all - equivalent), where killed counts a failing test run, a timeout (a hang is
caught) and a crash; survived, "no tests" (no selected test reaches the function), interrupted, suspicious
and not-yet-checked mutants all count against it. The equivalent-mutants file (default
scripts/mutation_equivalent.txt) has one mutant a line, its name and then why no test can kill it;
'#' starts a comment. An entry whose mutant was killed, or that no longer exists, is reported and not set
aside. The survivors file (default scripts/mutation_survivors.txt), in the same format, says why each mutant
that is not equivalent still survives (it counts against the score); the report prints that reason beside
the survivor and lists the survivors that have none. --diff prints each survivor's changed lines;
--min-score makes the exit status 1 below that score.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

# mutmut's exit code -> status (mutmut.stats.status_by_exit_code in 3.8.1); anything else is "suspicious".
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    2: "interrupted",
    None: "not checked",
    33: "no tests",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    37: "type check",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "crash",
    -9: "crash",
}
KILLED = {"killed", "timeout", "crash", "type check"}
ORDER = [
    "killed",
    "timeout",
    "crash",
    "type check",
    "survived",
    "no tests",
    "interrupted",
    "suspicious",
    "skipped",
    "not checked",
]


def status_of(code: int | None) -> str:
    return STATUS.get(code, "suspicious")


def load_results(root: Path) -> dict[str, dict[str, str]]:
    """source path -> {mutant name: status}, from mutants/**/*.py.meta."""
    results: dict[str, dict[str, str]] = {}
    base = root / "mutants"
    for meta in sorted(base.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        source = str(meta.relative_to(base))[: -len(".meta")]
        results[source] = {name: status_of(code) for name, code in data["exit_code_by_key"].items()}
    return results


def stopped_by_test_timeout(root: Path) -> set[str]:
    """Mutants whose run had a test stopped by the per-test timeout of scripts/mutmut_plugin.py."""
    path = root / "mutants" / "mutation-timings.tsv"
    if not path.exists():
        return set()
    return {
        parts[0]
        for parts in (line.split("\t") for line in path.read_text().splitlines())
        if len(parts) > 5 and parts[5].strip()
    }


def load_reasons(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not line:
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            sys.exit(f"{path}:{n}: {name} has no reason; each entry must say why")
        out[name] = reason.strip()
    return out


def selected(source: str, modules: list[str]) -> bool:
    if not modules:
        return True
    return any(source == m or source.startswith(m.rstrip("/") + "/") for m in modules)


def diff_lines(name: str, source: str) -> list[str]:
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        diff = get_diff_for_mutant(name, path=source)
    except Exception as e:  # the report must not fail on a diff
        return [f"(no diff: {e})"]
    return [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def timings(root: Path, names: set[str]) -> dict[str, tuple[int, float, float]]:
    """kind (mutant / stats / clean / fail) -> (sessions, total s, max s), from scripts/mutmut_plugin.py's log."""
    path = root / "mutants" / "mutation-timings.tsv"
    acc: dict[str, list[float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) < 2:
                continue
            # since the fork when logged (a mutant's whole pytest run), else the session
            name, seconds = parts[0], float(parts[4] if len(parts) > 4 else parts[1])
            kind = name if name in ("stats", "clean", "fail", "list_all_tests", "mutant_generation") else "mutant"
            if kind == "mutant" and name not in names:
                continue
            acc.setdefault(kind, []).append(seconds)
    return {k: (len(v), sum(v), max(v)) for k, v in acc.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help="source files or folders to report (default: all mutated files)")
    ap.add_argument("--equivalent", type=Path, default=Path("scripts/mutation_equivalent.txt"))
    ap.add_argument("--survivors", type=Path, default=Path("scripts/mutation_survivors.txt"))
    ap.add_argument("--diff", action="store_true", help="print each survivor's changed lines")
    ap.add_argument("--min-score", type=float, default=None, help="exit 1 when the score is below this percentage")
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument(
        "--list-not-killed",
        action="store_true",
        help="only print the names of the mutants not killed and not set aside, one a line",
    )
    args = ap.parse_args(argv)

    results = load_results(args.root)
    for by_name in results.values():  # a test stopped by its timeout is a hang caught: a timeout
        for name in stopped_by_test_timeout(args.root) & set(by_name):
            if by_name[name] == "killed":
                by_name[name] = "timeout"
    if not results:
        print("no mutmut results under mutants/: run scripts/mutation.sh first", file=sys.stderr)
        return 2
    modules = [os.path.normpath(m) + ("/" if m.endswith("/") else "") for m in args.modules]
    equivalent = load_reasons(args.root / args.equivalent)  # an absolute path stays as it is
    reasons = load_reasons(args.root / args.survivors)
    all_names = {name for r in results.values() for name in r}
    killed_names = {name for r in results.values() for name, status in r.items() if status in KILLED}

    total = Counter()
    rows, survivors, equivalent_used, equivalent_killed, timeouts = [], [], [], [], []
    for source, by_name in results.items():
        if not selected(source, modules) or not by_name:
            continue
        c = Counter()
        for name, status in sorted(by_name.items()):
            if name in equivalent:
                if status in KILLED:
                    equivalent_killed.append(name)
                else:
                    c["equivalent"] += 1
                    equivalent_used.append((name, equivalent[name]))
                    continue
            c[status] += 1
            if status == "timeout":
                timeouts.append(name)
            if status not in KILLED:
                survivors.append((source, name, status))
        c["all"] = len(by_name)
        total += c
        rows.append((source, c))

    if args.list_not_killed:
        print("\n".join(name for _, name, _ in survivors))
        return 0

    def score(c: Counter) -> float:
        counted = c["all"] - c["equivalent"]
        return 100.0 * sum(c[s] for s in KILLED) / counted if counted else 100.0

    width = max(len(s) for s, _ in rows) if rows else 10
    print(f"{'module':<{width}}  killed/counted  timeout  survived  no-tests  other  equiv   score")
    for source, c in rows + [("TOTAL", total)]:
        killed = sum(c[s] for s in KILLED)
        other = sum(c[s] for s in ("interrupted", "suspicious", "skipped", "not checked"))
        print(
            f"{source:<{width}}  {killed:>6}/{c['all'] - c['equivalent']:<7}  {c['timeout']:>7}  "
            f"{c['survived']:>8}  {c['no tests']:>8}  {other:>5}  {c['equivalent']:>5}  {score(c):6.1f}%"
        )

    if survivors:
        print(f"\nnot killed ({len(survivors)}), each with why it survives ({args.survivors}):")
        for source, name, status in survivors:
            print(f"  {status:<11} {name}: {reasons.get(name, 'NO REASON GIVEN')}")
            if args.diff:
                for line in diff_lines(name, source):
                    print(f"                {line.strip()[:150]}")
    if timeouts:
        print(f"\ntimeouts, counted as killed ({len(timeouts)}): {', '.join(timeouts)}")
    if equivalent_used:
        print(f"\nset aside as equivalent ({len(equivalent_used)}):")
        for name, reason in equivalent_used:
            print(f"  {name}: {reason}")
    if equivalent_killed:
        print(f"\nlisted as equivalent but killed (remove from {args.equivalent}): {', '.join(equivalent_killed)}")
    stale = sorted(n for n in equivalent if n not in all_names)
    if stale:
        print(f"\nlisted as equivalent but no such mutant (stale entries in {args.equivalent}): {', '.join(stale)}")
    unexplained = [name for _, name, status in survivors if name not in reasons and status != "not checked"]
    if unexplained:
        print(f"\n{len(unexplained)} survivors have no reason in {args.survivors}")
    stale = sorted(n for n in reasons if n not in all_names or n in killed_names)
    if stale:
        print(
            f"\nlisted as survivors but killed or no such mutant (stale entries in {args.survivors}): "
            f"{', '.join(stale)}"
        )
    if total["not checked"]:
        print(
            f"\nwarning: {total['not checked']} mutants not checked yet (an interrupted run); they count as not killed"
        )

    t = timings(args.root, {n for source, r in results.items() if selected(source, modules) for n in r})
    if t:
        print("\npytest runs (scripts/mutmut_plugin.py's log; all runs so far, timeouts not included):")
        for kind in ("stats", "clean", "fail", "mutant"):
            if kind in t:
                n, s, mx = t[kind]
                print(f"  {kind:<7} {n:>5} sessions  {s:9.1f} s  mean {s / n:6.2f} s  max {mx:7.1f} s")
    final = score(total)
    print(
        f"\nmutation score: {final:.1f}% ({sum(total[s] for s in KILLED)} killed of "
        f"{total['all'] - total['equivalent']}; {total['equivalent']} equivalent set aside)"
    )
    if args.min_score is not None and final < args.min_score:
        print(f"below the required {args.min_score:.1f}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
