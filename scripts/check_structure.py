"""Check the package's structure by reading its source with ast (it is never imported).

    python scripts/check_structure.py                    # the rules below on the working tree
    python scripts/check_structure.py --rev REV          # the same on a git revision
    python scripts/check_structure.py --tree [--rev REV] # .py files and lines per folder instead

Rules, one line per violation, then a summary line; exit status 1 when there is any:
1. no import cycle among the package's modules: every import of the package (module level and inside
   functions; not under `if TYPE_CHECKING:`) is an edge module -> module, as written: `from P import name`
   goes to P.name when that is a module, else to P; the parent packages an import implies are not edges,
   nor is an import of a module's own package (`from elastic_trainer.pkg import X` in pkg/sub.py, while
   pkg/__init__.py imports sub: Python's package pattern, the package is imported before sub anyway).
   Every strongly connected component of more than one module, and a self-import, is one line.
2. nothing imports CLI_MODULE (any import form, `if TYPE_CHECKING:` included).
3. torchrun's environment (TORCHRUN_VARIABLES, names starting with TORCHRUN_PREFIXES) is read only in
   ENV_MODULE. A read is the name as a string constant that is subscripted (`os.environ["RANK"]`; not an
   assignment or del target), an argument of `.get(...)`, `getenv(...)`, `env_int(...)` or `.pop(...)`, or
   the left side of `in` / `not in`; also a loop variable over a literal tuple/list/set of such names that is
   read that way in the loop's body. Setting the variables (`os.environ.update(RANK=...)`,
   `env["RANK"] = ...`, dicts given to subprocesses) is not a read.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path, PurePosixPath

PACKAGE = "elastic_trainer"
CLI_MODULE = "elastic_trainer.cli"
ENV_MODULE = "elastic_trainer/elastic/torchrun_env.py"  # the one file allowed to read torchrun's variables
TORCHRUN_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
READ_METHODS = frozenset({"get", "pop"})  # x.get("RANK"), x.pop("RANK")
READ_FUNCTIONS = frozenset({"getenv", "env_int"})  # getenv("RANK"), os.getenv(...), env_int(...), config.env_int(...)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- sources


def working_tree_files(root: Path) -> dict[str, str]:
    """{path relative to root, posix: text} of every .py file of the package in the working tree."""
    package = root / PACKAGE
    return {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(package.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def revision_files(root: Path, rev: str) -> dict[str, str]:
    """The same for a git revision (git ls-tree / git show; the working tree is not read)."""
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, PACKAGE], cwd=root, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    return {
        name: subprocess.run(
            ["git", "show", f"{rev}:{name}"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
        for name in sorted(names)
        if name.endswith(".py")
    }


def module_name(path: str) -> str:
    """elastic_trainer/a/b.py -> elastic_trainer.a.b; elastic_trainer/a/__init__.py -> elastic_trainer.a."""
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ---------------------------------------------------------------------------------------------- imports


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST, type_checking: bool):
    """(node, under_type_checking) for every Import / ImportFrom anywhere in the tree."""
    if isinstance(tree, (ast.Import, ast.ImportFrom)):
        yield tree, type_checking
        return
    if isinstance(tree, ast.If) and is_type_checking(tree.test):
        for child in tree.body:
            yield from import_nodes(child, True)
        for child in tree.orelse:
            yield from import_nodes(child, type_checking)
        return
    for child in ast.iter_child_nodes(tree):
        yield from import_nodes(child, type_checking)


def existing(name: str, modules: set[str]) -> str | None:
    """The longest prefix of the dotted name that is a module (or package) of the package, or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The package's modules one import statement names, as written (no implied parent packages)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [
            target
            for name in names
            if (name == PACKAGE or name.startswith(PACKAGE + ".")) and (target := existing(name, modules))
        ]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
        return []
    targets = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        target = submodule if submodule in modules else existing(source, modules)
        if target and target not in targets:
            targets.append(target)
    return targets


def import_edges(trees: dict[str, ast.AST], modules: set[str]) -> list[tuple[str, str, str, int, bool]]:
    """(from module, to module, file, line, under TYPE_CHECKING) for every import of the package."""
    edges = []
    for path, tree in trees.items():
        module = module_name(path)
        is_package = path.endswith("/__init__.py")
        for node, type_checking in import_nodes(tree, False):
            for target in import_targets(node, module, is_package, modules):
                edges.append((module, target, path, node.lineno, type_checking))
    return edges


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(graph[successor])))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(start: str, graph: dict[str, list[str]], members: set[str]) -> list[str]:
    """start -> ... -> start, the fewest edges, inside one component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in graph[node]:
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if successor in members and successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    return [start, start]


def cycle_violations(edges, modules: set[str]) -> list[str]:
    graph: dict[str, list[str]] = {module: [] for module in modules}
    where: dict[tuple[str, str], str] = {}
    for source, target, path, line, type_checking in edges:
        if type_checking or (source, target) in where or source.startswith(target + "."):
            continue  # a module reading names from its own package: Python imports that package first anyway
        graph[source].append(target)
        where[(source, target)] = f"{path}:{line}"
    found = []
    for component in strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        cycle = shortest_cycle(component[0], graph, set(component))
        line = "cycle: " + " -> ".join(cycle) + " [" + ", ".join(where[(a, b)] for a, b in zip(cycle, cycle[1:])) + "]"
        if len(component) > len(cycle) - 1:
            line += f" (one component of {len(component)} modules: {', '.join(component)})"
        found.append(line)
    return sorted(found)


def cli_violations(edges) -> list[str]:
    return [
        f"{path}:{line}: imports {CLI_MODULE}"
        for source, target, path, line, _ in edges
        if target == CLI_MODULE and source != CLI_MODULE
    ]


# ---------------------------------------------------------------------------------------------- environment


def is_torchrun_variable(value: object) -> bool:
    return isinstance(value, str) and (value in TORCHRUN_VARIABLES or value.startswith(TORCHRUN_PREFIXES))


def read_call(node: ast.Call) -> bool:
    function = node.func
    if isinstance(function, ast.Attribute):
        return function.attr in READ_METHODS or function.attr in READ_FUNCTIONS
    return isinstance(function, ast.Name) and function.id in READ_FUNCTIONS


def read_positions(tree: ast.AST):
    """Every expression in a read position: a loaded subscript's key, a read call's argument, the left side
    of `in` / `not in`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            yield node.slice
        elif isinstance(node, ast.Call) and read_call(node):
            yield from node.args
            yield from (keyword.value for keyword in node.keywords)
        elif isinstance(node, ast.Compare):
            lefts = [node.left] + node.comparators[:-1]
            yield from (left for left, op in zip(lefts, node.ops) if isinstance(op, (ast.In, ast.NotIn)))


def env_violations(path: str, tree: ast.AST) -> list[str]:
    if path == ENV_MODULE:
        return []
    reads = {
        (node.lineno, node.value)
        for node in read_positions(tree)
        if isinstance(node, ast.Constant) and is_torchrun_variable(node.value)
    }
    for loop in ast.walk(tree):  # for name in ("GROUP_RANK", ...): env_int(name, ...)
        if not (
            isinstance(loop, (ast.For, ast.AsyncFor))
            and isinstance(loop.target, ast.Name)
            and isinstance(loop.iter, (ast.Tuple, ast.List, ast.Set))
        ):
            continue
        names = [
            element
            for element in loop.iter.elts
            if isinstance(element, ast.Constant) and is_torchrun_variable(element.value)
        ]
        if names and any(
            isinstance(node, ast.Name) and node.id == loop.target.id
            for statement in loop.body
            for node in read_positions(statement)
        ):
            reads |= {(element.lineno, element.value) for element in names}
    return [f"{path}:{line}: reads {name} outside {ENV_MODULE}" for line, name in sorted(reads)]


# ---------------------------------------------------------------------------------------------- checks


def check(files: dict[str, str]) -> dict[str, list[str]]:
    """The violations of each rule, for {path: text} of the package's .py files."""
    trees: dict[str, ast.AST] = {}
    result: dict[str, list[str]] = {
        "syntax errors": [],
        "cycles": [],
        "cli importers": [],
        "env reads": [],
    }
    for path, text in files.items():
        try:
            trees[path] = ast.parse(text, filename=path)
        except SyntaxError as error:
            result["syntax errors"].append(f"{path}:{error.lineno}: syntax error: {error.msg}")
    modules = {module_name(path) for path in files}
    modules |= {
        module_name(str(parent) + "/__init__.py")
        for path in files
        for parent in PurePosixPath(path).parents
        if parent.parts and parent.parts[0] == PACKAGE
    }
    edges = import_edges(trees, modules)
    result["cycles"] = cycle_violations(edges, modules)
    result["cli importers"] = cli_violations(edges)
    for path, tree in trees.items():
        result["env reads"] += env_violations(path, tree)
    return result


def violations(root: Path, rev: str | None = None) -> list[str]:
    """Every violation, one line each, for the package under root (or at a git revision of root)."""
    files = revision_files(root, rev) if rev else working_tree_files(root)
    return [line for lines in check(files).values() for line in lines]


def tree_rows(files: dict[str, str]) -> list[tuple[str, int, int]]:
    """(folder, .py files directly in it, their lines) per folder, sorted, then ("total", files, lines)."""
    rows: dict[str, list[int]] = {}
    for path, text in files.items():
        row = rows.setdefault(str(PurePosixPath(path).parent) + "/", [0, 0])
        row[0] += 1
        row[1] += len(text.splitlines())
    table = [(folder, count, lines) for folder, (count, lines) in sorted(rows.items())]
    return table + [("total", sum(row[1] for row in table), sum(row[2] for row in table))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="store_true", help="print .py files and lines per folder instead")
    parser.add_argument("--rev", help="read a git revision (git show REV:path) instead of the working tree")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: %(default)s)")
    args = parser.parse_args(argv)
    files = revision_files(args.root, args.rev) if args.rev else working_tree_files(args.root)
    if args.tree:
        rows = tree_rows(files)
        width = max(len(row[0]) for row in rows)
        print(f"{'folder':<{width}}  {'files':>5}  {'lines':>6}")
        for folder, count, lines in rows:
            print(f"{folder:<{width}}  {count:>5}  {lines:>6}")
        return 0
    result = check(files)
    for lines in result.values():
        for line in lines:
            print(line)
    total = sum(len(lines) for lines in result.values())
    counts = ", ".join(f"{len(lines)} {rule}" for rule, lines in result.items() if lines or rule != "syntax errors")
    print(f"structure: {'clean' if not total else f'{total} violations'} ({counts})")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
