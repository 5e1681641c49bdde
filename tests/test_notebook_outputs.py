"""The notebook outputs nbval compares depend only on the course's code, seeds and data.

nbval compares each committed output with a fresh run's. An output that prints something of the machine
(the clone's path, the host), of the torch release (the byte size of a pickled checkpoint file) or of the
moment (today's date, a timing) passes where it was made and fails for the next person: lesson 08 once
printed its checkpoint's `.metadata` size, 71,661 bytes under torch 2.13 and 72,245 under 2.15, and a
newcomer's `make test` failed. Cells that print timings carry `# NBVAL_IGNORE_OUTPUT` and are not compared;
rendering a committed data file (whose date and versions are the file's, not this run's) is stable.
"""

import json
import re
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

UNSTABLE = {
    "an absolute path (the clone's location)": re.compile(r"(?<![\w.])/(?:work|home|tmp|root|Users|scratch|private)/"),
    "a serialized file's size in bytes (it changes with the torch release)": re.compile(
        r"\.(?:metadata|distcp|pt|pth|bin|safetensors|pkl)[:\s]+\d[\d,]*\s*(?:bytes|B)\b"  # a listing: name, size
    ),
    "today's date": re.compile(r"\b20\d\d-\d\d-\d\d[ T]\d\d:\d\d"),  # a timestamp of this run
}


def compared_outputs(notebook: Path):
    """(cell number, text) of every output nbval compares."""
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in source or "NBVAL_SKIP" in source:
            continue
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            if text:
                yield number, text


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_compared_outputs_do_not_depend_on_the_machine_release_or_moment(notebook):
    problems = []
    host = socket.gethostname()
    for number, text in compared_outputs(notebook):
        for what, pattern in UNSTABLE.items():
            for match in pattern.finditer(text):
                line = text[text.rfind("\n", 0, match.start()) + 1 : text.find("\n", match.end()) % (len(text) + 1)]
                problems.append(f"cell {number}: {what}: {line.strip()[:120]}")
        if len(host) > 3 and host in text:
            problems.append(f"cell {number}: this machine's host name {host!r}")
    assert not problems, (
        f"{notebook.name}: outputs nbval compares would differ on another machine, clone or torch release; "
        "print what is stable (tensors, shapes, counts, paths relative to the course) or mark only a timing "
        "cell # NBVAL_IGNORE_OUTPUT:\n" + "\n".join(problems)
    )
