"""pytest as instructors type it, in the activated environment: from the course root on the notebooks, one notebook
and one lesson's tests, and from notebooks/ on one notebook. Each starts (the session plugin imports, the items are
collected) without `python -m` and without a make target."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launch import ROOT

ACTIVATED = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
ACTIVATED.pop("PYTHONPATH", None)  # an activated environment sets none
ACTIVATED["COURSE_COLD_RANKS"] = "1"  # collecting only: no warm ranks for kernels that will not start


@pytest.mark.parametrize(
    "folder, args",
    [
        (".", ["--nbval", "notebooks/"]),
        (".", ["--nbval", "notebooks/01_collectives.ipynb"]),
        (".", ["tests/test_01_collectives.py"]),
        ("notebooks", ["--nbval", "01_collectives.ipynb"]),
    ],
    ids=["root: notebooks/", "root: one notebook", "root: one lesson's tests", "notebooks/: one notebook"],
)
def test_pytest_starts_as_an_instructor_types_it(folder, args):
    command = ["pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    result = subprocess.run(command, cwd=ROOT / folder, env=ACTIVATED, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Error importing plugin" not in result.stderr and " collected" in result.stdout
