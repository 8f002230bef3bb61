"""scripts/check_structure.py: the package's own structure, and each rule failing on a small fake package."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check_structure.py")
check_structure = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_structure", check_structure)
_spec.loader.exec_module(check_structure)
violations = check_structure.violations

ENV = "outside elastic_trainer/elastic/torchrun_env.py"


def write(root: Path, files: dict[str, str]) -> Path:
    """A fake elastic_trainer/ under root: {path below elastic_trainer/: source}; every folder gets an
    __init__.py unless one is given."""
    package = root / "elastic_trainer"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in [package, *package.rglob("*")]:
        if folder.is_dir() and not (folder / "__init__.py").exists():
            (folder / "__init__.py").write_text("")
    return root


def test_package_structure():
    assert violations(ROOT) == []


def test_cycle_through_a_function_level_import(tmp_path):
    write(
        tmp_path,
        {
            "a.py": """\
            import os


            def f():
                from elastic_trainer import b
                return b
            """,
            "b.py": "import elastic_trainer.a\n",
        },
    )
    assert violations(tmp_path) == [
        "cycle: elastic_trainer.a -> elastic_trainer.b -> elastic_trainer.a "
        "[elastic_trainer/a.py:5, elastic_trainer/b.py:1]"
    ]


def test_relative_imports_a_larger_component_and_a_self_import(tmp_path):
    write(
        tmp_path,
        {
            "pkg/x.py": "from .y import f\n",
            "pkg/y.py": "from ..pkg import z\n",
            "pkg/z.py": "from . import x, y\n",
            "single.py": "from elastic_trainer.single import name\n",
        },
    )
    assert violations(tmp_path) == [
        "cycle: elastic_trainer.pkg.x -> elastic_trainer.pkg.y -> elastic_trainer.pkg.z -> elastic_trainer.pkg.x "
        "[elastic_trainer/pkg/x.py:1, elastic_trainer/pkg/y.py:1, elastic_trainer/pkg/z.py:1]",
        "cycle: elastic_trainer.single -> elastic_trainer.single [elastic_trainer/single.py:1]",
    ]
    write(tmp_path, {"pkg/y.py": "from ..pkg import z\nfrom . import x\n"})
    assert violations(tmp_path)[0] == (
        "cycle: elastic_trainer.pkg.x -> elastic_trainer.pkg.y -> elastic_trainer.pkg.x "
        "[elastic_trainer/pkg/x.py:1, elastic_trainer/pkg/y.py:2] (one component of 3 modules: "
        "elastic_trainer.pkg.x, elastic_trainer.pkg.y, elastic_trainer.pkg.z)"
    )


def test_no_cycle_from_type_checking_or_the_package_pattern(tmp_path):
    write(
        tmp_path,
        {
            "c.py": """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from elastic_trainer.d import D
            """,
            "d.py": "import elastic_trainer.c\n",
            "pkg/__init__.py": "X = 1\nfrom elastic_trainer.pkg.sub import helper\n",
            "pkg/sub.py": "from elastic_trainer.pkg import X\nfrom . import X as Y\n\n\ndef helper():\n    return X\n",
            "user.py": "import elastic_trainer.pkg.sub\n",  # implies elastic_trainer.pkg: not an edge
            "other/__init__.py": "import elastic_trainer.user\n",
        },
    )
    assert violations(tmp_path) == []


def test_importing_the_cli(tmp_path):
    write(
        tmp_path,
        {
            "cli.py": "from elastic_trainer import a\n",
            "a.py": "def f():\n    from elastic_trainer import cli\n",
            "b.py": "import elastic_trainer.cli as c\n",
            "launch/agent.py": "from ..cli import main\n",
            "launch/driver.py": "from elastic_trainer.cli_parser import parser\n",  # another module
            "cli_parser.py": "parser = None\n",
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from elastic_trainer import cli\n",
        },
    )
    assert violations(tmp_path) == [
        "cycle: elastic_trainer.a -> elastic_trainer.cli -> elastic_trainer.a "
        "[elastic_trainer/a.py:2, elastic_trainer/cli.py:1]",
        "elastic_trainer/a.py:2: imports elastic_trainer.cli",
        "elastic_trainer/b.py:1: imports elastic_trainer.cli",
        "elastic_trainer/launch/agent.py:1: imports elastic_trainer.cli",
        "elastic_trainer/typed.py:3: imports elastic_trainer.cli",
    ]


READS = """\
    import os
    from elastic_trainer.config import env_int

    local = os.environ.get("LOCAL_RANK")
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    world = env_int("WORLD_SIZE", 1, minimum=1)
    addr = os.environ["MASTER_ADDR"]
    port = os.getenv("MASTER_PORT") or getenv("TORCH_ELASTIC_X")
    gone = "GROUP_RANK" not in os.environ or os.environ.pop("ROLE_RANK", None)
    for name in ("GROUP_WORLD_SIZE", "OTHER"):
        env_int(name, 0, minimum=0)
    """

SETS = """\
    import os
    import subprocess

    os.environ.update(RANK="0", WORLD_SIZE="1")
    env = dict(os.environ)
    env["LOCAL_RANK"] = "0"
    del env["TORCHELASTIC_RUN_ID"]
    subprocess.run(["x"], env={"MASTER_ADDR": "h", "MASTER_PORT": "1", **env})
    names = ["RANK", "WORLD_SIZE"]
    other = os.environ.get("RANKS") or os.environ.get("CUDA_VISIBLE_DEVICES")
    """


def test_torchrun_environment_reads(tmp_path):
    write(
        tmp_path,
        {
            "config.py": "def env_int(name, default, minimum):\n    return default\n",
            "reads.py": READS,
            "sets.py": SETS,
            "elastic/torchrun_env.py": READS,
        },
    )
    assert violations(tmp_path) == [
        f"elastic_trainer/reads.py:4: reads LOCAL_RANK {ENV}",
        f"elastic_trainer/reads.py:5: reads TORCHELASTIC_RUN_ID {ENV}",
        f"elastic_trainer/reads.py:6: reads WORLD_SIZE {ENV}",
        f"elastic_trainer/reads.py:7: reads MASTER_ADDR {ENV}",
        f"elastic_trainer/reads.py:8: reads MASTER_PORT {ENV}",
        f"elastic_trainer/reads.py:8: reads TORCH_ELASTIC_X {ENV}",
        f"elastic_trainer/reads.py:9: reads GROUP_RANK {ENV}",
        f"elastic_trainer/reads.py:9: reads ROLE_RANK {ENV}",
        f"elastic_trainer/reads.py:10: reads GROUP_WORLD_SIZE {ENV}",
    ]


def test_main_and_tree(tmp_path, capsys):
    write(tmp_path, {"a.py": "x = 1\ny = 2\n", "sub/b.py": "import os\nos.environ['RANK']\n"})
    assert check_structure.main(["--root", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"elastic_trainer/sub/b.py:2: reads RANK {ENV}",
        "structure: 1 violations (0 cycles, 0 cli importers, 1 env reads)",
    ]
    assert check_structure.main(["--root", str(tmp_path), "--tree"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "folder                files   lines",
        "elastic_trainer/          2       2",
        "elastic_trainer/sub/      2       2",
        "total                     4       4",
    ]
