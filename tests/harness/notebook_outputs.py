"""A notebook's outputs, as run somewhere else (the lab in a browser), compared with its committed ones as nbval
compares them: the same cells (not those marked NBVAL_IGNORE_OUTPUT or NBVAL_SKIP, nor cells never run in the
committed copy), streams of one name joined, the same fields (images, metadata and counters left out).

`make test` runs lessons 00, 01 and 10 in the browser (tests/test_browser.py), which compares their outputs this way,
so nbval need not run them a second time (the Makefile leaves them out of its nbval run where Chromium is there).
"""

import shutil
from pathlib import Path

import nbformat
from nbval.plugin import coalesce_streams, find_comment_markers, transform_streams_for_comparison

ROOT = Path(__file__).resolve().parents[2]
IN_BROWSER = ("01_collectives", "00_setup_and_baseline", "10_mixture_of_experts")  # in the order the browser runs them


def browser_runs_in(args: list[str]) -> bool:
    """Will the browser test run in a pytest session given these paths? (tests/ or tests/test_browser.py named, and
    Chromium and Playwright there: without them it is skipped, and nbval must run those notebooks itself.)"""
    named = {(ROOT / arg.split("::")[0]).resolve() for arg in args}
    if not named & {ROOT / "tests", ROOT / "tests" / "test_browser.py"}:
        return False
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return bool(shutil.which("chromium") or shutil.which("chromium-browser"))


# nbval's defaults without --nbdime: what it never compares
SKIP_COMPARE = {
    "metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
    "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg",
}  # fmt: skip


def compared_fields(outputs: list) -> dict[str, list]:
    """nbval's view of a cell's outputs: each field (a stream's name, or a data MIME type) -> its values, in order."""
    fields: dict[str, list] = {}
    nodes = coalesce_streams([nbformat.from_dict(joined(output)) for output in outputs])
    for output in transform_streams_for_comparison(nodes):
        for key, value in output.items():
            if key in SKIP_COMPARE:
                continue
            if key == "data":
                for mime, data in value.items():
                    if mime not in SKIP_COMPARE:
                        fields.setdefault(mime, []).append(data)
            else:
                fields.setdefault(key, []).append(value)
    return fields


def joined(output: dict) -> dict:
    """An output with its multi-line strings as one string each (a .ipynb file stores them as lists of lines)."""

    def join(value):
        return "".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value

    output = {key: join(value) for key, value in output.items()}
    if isinstance(output.get("data"), dict):
        output["data"] = {mime: join(value) for mime, value in output["data"].items()}
    return output


def checked(cell: dict) -> bool:
    """Does nbval compare this cell's outputs (a code cell, run in the committed copy, not marked otherwise)?"""
    markers = dict(find_comment_markers("".join(cell["source"])))
    return (
        cell["cell_type"] == "code"
        and cell.get("execution_count") is not None
        and markers.get("check", True)
        and not markers.get("skip", False)
    )


def output_differences(ran: list[dict], committed: list[dict]) -> list[str]:
    """For each cell nbval would check whose outputs differ: its number, and the first field that differs with the
    committed and the new value (shortened)."""
    if len(ran) != len(committed):
        return [f"{len(ran)} cells ran, the committed notebook has {len(committed)}"]
    found = []
    for number, (new, old) in enumerate(zip(ran, committed), start=1):
        if not checked(old):
            continue
        got, want = compared_fields(new.get("outputs", [])), compared_fields(old.get("outputs", []))
        if got == want:
            continue
        keys = sorted(set(got) | set(want))
        key = next(k for k in keys if got.get(k) != want.get(k))
        found.append(
            f"cell {number}: its {key!r} output differs from the committed one:\n"
            f"  committed: {str(want.get(key))[:600]!r}\n  now:       {str(got.get(key))[:600]!r}"
        )
    return found
