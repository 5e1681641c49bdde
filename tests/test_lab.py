"""`make lab`, the front door: JupyterLab at the course root, the README rendered, its links reaching the notebooks.

What the lab then shows is checked in a real browser (tests/test_browser.py); these checks read the command and the
files it names, and need no browser, so they hold wherever the suite runs.
"""

import json
import re
import shlex
import subprocess

from tests.harness.launch import ROOT

README_URL = "/lab/tree/README.md"


def lab_command() -> list[str]:
    """The command `make lab` runs (make -n prints it without running it)."""
    printed = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in printed.splitlines() if "jupyter lab" in line)
    return shlex.split(line)


def option(command: list[str], name: str) -> str | None:
    return next((arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")), None)


def test_make_lab_serves_the_course_root_and_its_printed_address_opens_the_readme():
    command = lab_command()
    # The lab's root is the folder it starts in: the course root (make runs in it), unless a folder is named.
    assert not [arg for arg in command[2:] if not arg.startswith("-")], f"make lab names a folder or file: {command}"
    assert option(command, "--LabApp.default_url") == README_URL, "the printed address would not open the README"
    settings = option(command, "--LabApp.app_settings_dir")
    overrides = json.loads((ROOT / "utils" / "course" / "lab_settings" / "overrides.json").read_text())
    assert settings and (ROOT / "utils" / "course" / "lab_settings").samefile(settings), command
    viewer = overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewer.get("markdown") == "Markdown Preview", f"the README would open as source: {viewer}"


def test_the_readmes_lesson_links_name_files_of_the_course():
    links = re.findall(r"\]\((notebooks/[^)#]+\.ipynb)\)", (ROOT / "README.md").read_text())
    assert len(links) >= 11, links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"the README's links to notebooks that do not exist: {missing}"


def test_the_cluster_starts_the_lab_as_make_lab_does():
    """slurm/jupyterlab.sh, the cluster's way in: the same root and settings, so the same front door."""
    script = (ROOT / "slurm" / "jupyterlab.sh").read_text().replace("\\\n", " ")  # continued lines joined
    start = next(line for line in script.splitlines() if line.startswith("exec jupyter lab"))
    assert f"--LabApp.default_url={README_URL}" in start, start
    assert "utils/course/lab_settings" in start, start
    assert 'cd "$SLURM_SUBMIT_DIR"' in script and "notebooks/" not in start, f"not the course root: {start}"


def test_notebook_outputs_are_compared_as_nbval_compares_them():
    """The browser test's comparison (tests/harness/notebook_outputs.py), which stands in for nbval on the notebooks
    it runs: a changed printed line fails, naming the cell; an ignored cell's or an image's change does not."""
    from tests.harness.notebook_outputs import checked, output_differences

    committed = json.loads((ROOT / "notebooks" / "10_mixture_of_experts.ipynb").read_text())["cells"]
    assert output_differences(json.loads(json.dumps(committed)), committed) == []
    printed = next(i for i, c in enumerate(committed) if checked(c) and any(o.get("name") == "stdout"
                                                                              for o in c["outputs"]))  # fmt: skip
    ignored = next(i for i, c in enumerate(committed) if c["cell_type"] == "code" and not checked(c) and c["outputs"])
    changed = json.loads(json.dumps(committed))
    stream = next(o for o in changed[printed]["outputs"] if o.get("name") == "stdout")
    stream["text"] = ["something else\n"]
    changed[ignored]["outputs"] = []
    (difference,) = output_differences(changed, committed)
    assert difference.startswith(f"cell {printed + 1}: its 'stdout' output differs"), difference
    for cell in changed:  # images are not compared (nbval without --nbdime)
        for output in cell.get("outputs", []):
            if "image/png" in output.get("data", {}):
                output["data"]["image/png"] = "AAAA"
    assert len(output_differences(changed, committed)) == 1
