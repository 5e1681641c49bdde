"""`make lab`, the front door: JupyterLab at the course root, the README rendered, its links reaching the notebooks."""

import json
import re
import shlex
import socket
import subprocess
import time
import urllib.request

from tests.harness.launch import ROOT


def lab_command() -> list[str]:
    """The command `make lab` runs (make -n prints it without running it)."""
    printed = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in printed.splitlines() if "jupyter lab" in line)
    return shlex.split(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_lab_opens_the_readme_at_the_course_root_and_its_links_reach_the_notebooks(tmp_path):
    command = lab_command()
    assert command[-1] == "README.md", f"make lab should open the README first: {command}"
    port, token = free_port(), "course-test"
    server = subprocess.Popen([*command, "--no-browser", f"--port={port}", f"--IdentityProvider.token={token}",
                               "--allow-root", f"--ServerApp.runtime_dir={tmp_path}"],  # fmt: skip
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def get(path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={token}&content=0", timeout=10) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as error:
            return error.code, {}

    try:
        for _ in range(240):
            try:
                if get("/api/status")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("JupyterLab did not answer within two minutes")
        assert get("/api/contents/README.md")[0] == 200, "the lab does not serve the course root"
        viewer = get("/lab/api/settings/@jupyterlab/docmanager-extension:plugin")[1]
        default = viewer["schema"]["properties"]["defaultViewers"]["default"]
        assert default.get("markdown") == "Markdown Preview", f"the README would open as source: {default}"
        links = re.findall(r"\]\((notebooks/[^)#]+\.ipynb)\)", (ROOT / "README.md").read_text())
        assert len(links) >= 11, links
        missing = [link for link in links if get(f"/api/contents/{link}")[0] != 200]
        assert not missing, f"the README's links that the lab cannot open: {missing}"
    finally:
        server.terminate()
        server.wait(timeout=30)
