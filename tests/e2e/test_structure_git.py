"""scripts/check_structure.py on a git revision (a real git repository)."""

from __future__ import annotations

from tests.unit.test_structure import ENV, check_structure, violations, write


def test_tree_and_check_of_a_git_revision(tmp_path, capsys):
    import subprocess

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True
        )

    write(tmp_path, {"a.py": "import os\nos.environ.get('RANK')\n"})
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    write(tmp_path, {"a.py": "x = 1\n", "sub/b.py": "y = 2\n"})  # the working tree differs from HEAD
    assert violations(tmp_path) == []
    assert violations(tmp_path, rev="HEAD") == [f"elastic_trainer/a.py:2: reads RANK {ENV}"]
    assert check_structure.main(["--root", str(tmp_path), "--tree", "--rev", "HEAD"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "folder            files   lines",
        "elastic_trainer/      2       2",
        "total                 2       2",
    ]
