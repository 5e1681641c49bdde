"""The course as a participant sees it: JupyterLab in a real browser (`make test-lab`; part of `make test`).

One lab, started as `make lab` starts it, and one headless Chromium page driven by Playwright. Everything checked is
read from the page, as a participant reads it: the address the lab prints opens the README, rendered; its link opens
lesson 01, whose kernel is the course's; the lab's own Run All runs it to its last cell without an error and with the
committed outputs (compared as nbval compares them, so `make test` leaves these notebooks out of nbval); its live
ranks start, answer, stop, and stop again on a kernel restart; then lessons 00 and 10 the same way. At the end the
lab's terminal (its log) holds no traceback. Each page is saved under runs/browser/ as a screenshot (for a look, never
compared) and each notebook's time in the browser in runs/browser/times.json.

Playwright cannot download its browsers here, so it drives the system's Chromium (Debian's `chromium` package).
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import pytest

from tests.harness.launch import ROOT, course_env, warm_pool
from tests.harness.notebook_outputs import IN_BROWSER, output_differences
from tests.test_lab import lab_command
from tests.test_notebook_ranks import NOISE  # a traceback, or what ipyparallel prints when engines it watches stop
from utils.course.notebook import kill_tree
from utils.distributed_utils import free_port

SHOTS = ROOT / "runs" / "browser"
INSTALL = "install Chromium with `sudo apt-get install -y chromium` (Debian, Ubuntu), then `make test-lab`"
# Without the networking flags Chromium keeps calling Google's services, which a closed network refuses by the
# thousand; --no-sandbox because the suite may run as root (CI, a container), where Chromium's sandbox cannot start.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
KERNEL = "Python 3 (ipykernel)"  # the course's kernel: .venv's Python, which `make setup` gave ipykernel
STDERR = "application/vnd.jupyter.stderr"  # how the page marks an error or anything written to stderr
RUN_ALL_TIMEOUT_S = 600  # a whole notebook on a loaded 2-core machine
# The notebooks run in the browser: lesson 01 (the live ranks), lesson 00 (the first a participant opens), and of the
# 3D, context- and expert-parallel lessons the one that takes least time.
NOTEBOOKS = list(IN_BROWSER)


def missing(reason: str):
    """Skip where the browser cannot run, with the way to install it; in CI (CI=true) that is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"the browser test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright is not installed: `make setup` installs it (requirements.txt)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        missing(f"no Chromium on this machine: {INSTALL}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


class Lab:
    def __init__(self, process: subprocess.Popen, log: Path, address: str):
        self.process, self.log, self.address = process, log, address

    def kernels(self) -> list[psutil.Process]:
        """The kernels this lab has started (its notebooks' Python processes)."""
        children = psutil.Process(self.process.pid).children()
        return [p for p in children if "ipykernel_launcher" in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


# Settings of this test's own (the participant's are left alone): autosave off, so that running the notebooks never
# rewrites their committed outputs; every cell kept on the page, so that each one's prompt and outputs can be read.
TEST_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def lab_env() -> dict:
    """The suite's environment (one thread per rank, no downloads) with its warm ranks, as the kernels that nbval
    starts have them: a notebook's launches fork ranks that imported torch already instead of starting torchrun, which
    prints the same in a fraction of the time (utils/course/warm_ranks.py; COURSE_COLD_RANKS=1: torchrun itself)."""
    warm_pool(course_env())  # the session's pool, or one started now; it puts its address in this environment
    return course_env()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab as `make lab` starts it (with a free port and its own runtime, workspace and settings folders),
    and the address it prints, as a participant copies it."""
    home = tmp_path_factory.mktemp("lab")
    for plugin, values in TEST_SETTINGS.items():
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log = home / "server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [*lab_command(), "--no-browser", f"--port={free_port()}", "--LabApp.expose_app_in_browser=True",
             f"--LabApp.workspaces_dir={home / 'workspaces'}", f"--LabApp.user_settings_dir={home / 'settings'}"],
            cwd=ROOT, env={**lab_env(), "JUPYTER_RUNTIME_DIR": str(home / "runtime")}, stdout=sink,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (address := re.search(r"http://\S+\?token=\w+", log.read_text())):
            assert process.poll() is None, f"`make lab` ended (exit code {process.returncode}):\n{log.read_text()}"
            assert time.monotonic() < deadline, f"`make lab` printed no address within 120 s:\n{log.read_text()}"
            time.sleep(0.5)
        yield Lab(process, log, address.group(0))
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)


@pytest.fixture(scope="module")
def page(browser, lab):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    yield page
    page.close()


def screenshot(page, name: str):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def record_time(notebook: str, seconds: float, load_before: float, browser_version: str):
    """Each notebook's Run All time in the browser, with where and under what load it was measured."""
    path = SHOTS / "times.json"
    times = json.loads(path.read_text()) if path.is_file() else {}
    times[notebook] = {
        "seconds": round(seconds, 1),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "load_before_after": [load_before, os.getloadavg()[0]],
        "chromium": browser_version,
        "note": "Run All, from the click to the last cell's end; the suite's other stream runs meanwhile",
    }
    SHOTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(times, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# What the page shows
# --------------------------------------------------------------------------------------------------

ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def tab_labels(page) -> list[str]:
    return page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab .lm-TabBar-tabLabel").all_inner_texts()


def kernel_state(page) -> tuple[str, str]:
    """(the kernel's name in the notebook's toolbar, its status: idle, busy, ...)."""
    return page.evaluate(
        """active => {
            const panel = document.querySelector(active);
            const name = panel && panel.querySelector('.jp-Toolbar-kernelName');
            const status = panel && panel.querySelector('.jp-Notebook-ExecutionIndicator');
            return [name ? name.innerText.trim() : '', status ? status.getAttribute('data-status') : ''];
        }""",
        ACTIVE,
    )


def wait_for_kernel(page, notebook: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (state := kernel_state(page))[1] != "idle" or state[0] in ("", "No Kernel"):
        assert time.monotonic() < deadline, f"{notebook}: no idle kernel within {timeout_s:.0f} s; the page: {state}"
        time.sleep(0.5)
    return state


def cells(page) -> list[dict]:
    """Every cell of the notebook on display: its prompt ("[3]:", "[*]:", "[ ]:"), its stderr outputs, all its
    output text."""
    return page.evaluate(
        """([active, stderr]) => [...document.querySelectorAll(active + ' .jp-Cell')].map(cell => ({
            code: cell.classList.contains('jp-CodeCell'),
            prompt: (cell.querySelector('.jp-InputPrompt') || {innerText: ''}).innerText.trim(),
            errors: [...cell.querySelectorAll(`.jp-OutputArea-output[data-mime-type="${stderr}"]`)]
                .map(e => e.innerText),
            output: (cell.querySelector('.jp-OutputArea') || {innerText: ''}).innerText,
        }))""",
        [ACTIVE, STDERR],
    )


def menu(page, menu_name: str, command: str):
    """Open a menu of the menu bar and click one of its items (by the command it runs)."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu_name}$")).click()
    page.locator(f'li[data-command="{command}"]').click()


def cell_name(source: list[str], index: int) -> str:
    """How a failure names a cell: its number in the notebook (the lab's status bar counts the same) and its code."""
    first = next((line for line in source[index].splitlines() if not line.startswith("#")), "").strip()
    return f"cell {index + 1} of {len(source)} (`{first[:60]}`)"


def notebook_on_display(page) -> dict:
    """The notebook of the current tab as the lab holds it (its cells and their outputs: what a save would write).
    The lab of this test exposes its application to the page (--LabApp.expose_app_in_browser) for this."""
    return page.evaluate("() => window.jupyterapp.shell.currentWidget.context.model.toJSON()")


def run_all(page, notebook: str) -> float:
    """Run All from the Run menu; wait until no cell is pending and the kernel is idle. Returns the seconds taken.
    Fails naming the notebook, the cell and what the page showed: an error or stderr output, a cell never run, or
    outputs that differ from the committed ones where nbval would compare them (so nbval need not run it again)."""
    cells_on_disk = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    source = ["".join(cell["source"]) for cell in cells_on_disk]
    start = time.monotonic()
    menu(page, "Run", "runmenu:run-all")
    settled = 0
    while settled < 2:  # idle and nothing pending twice, a second apart: the kernel idles between queued cells
        time.sleep(1)
        pending = [i for i, cell in enumerate(cells(page)) if cell["prompt"] == "[*]:"]
        settled = settled + 1 if not pending and kernel_state(page)[1] == "idle" else 0
        if time.monotonic() - start > RUN_ALL_TIMEOUT_S:
            screenshot(page, f"{notebook}-timeout")
            pytest.fail(f"{notebook}: Run All still runs {cell_name(source, pending[0])} after {RUN_ALL_TIMEOUT_S} s")
    seconds = time.monotonic() - start
    screenshot(page, notebook)
    shown = cells(page)
    assert len(shown) == len(source), f"{notebook}: the page shows {len(shown)} cells, the file has {len(source)}"
    code = [i for i, cell in enumerate(shown) if cell["code"]]
    for count, i in enumerate(code, start=1):  # a fresh kernel numbers the cells 1, 2, ... as they run
        where = f"{notebook}, {cell_name(source, i)}"
        errors = "\n".join(shown[i]["errors"])
        assert not errors, f"{where}: the page shows an error (or stderr) output:\n{errors}"
        assert shown[i]["prompt"] == f"[{count}]:", (
            f"{where}: Run All did not run it in turn (its prompt is {shown[i]['prompt']!r}, not [{count}]:); "
            f"the page shows: {shown[i]['output'][-500:]!r}"
        )
    differences = output_differences(notebook_on_display(page)["cells"], cells_on_disk)
    assert not differences, f"{notebook}: outputs differ from the committed ones:\n" + "\n".join(differences[:5])
    return seconds


def open_from_readme(page, lab, notebook: str):
    """Back to the README's tab, click the lesson's link, and wait for the notebook and its kernel."""
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="README.md").click()
    link = page.locator(f'.jp-RenderedMarkdown a[href*="notebooks/{notebook}.ipynb"]').first
    assert link.count(), f"the README shows no link to notebooks/{notebook}.ipynb"
    link.click()
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current", has_text=f"{notebook}.ipynb").wait_for()
    name, _ = wait_for_kernel(page, notebook)
    assert name == KERNEL, f"{notebook}: the lab selected the kernel {name!r}, not the course's {KERNEL!r}"
    pythons = {Path(_cmdline(kernel)[0]).parent for kernel in lab.kernels()}
    assert pythons == {Path(sys.executable).parent}, f"{notebook}: a kernel runs outside the course's environment"


def rank_processes(kernel: psutil.Process) -> list[psutil.Process]:
    """The live ranks a notebook's kernel started (ipyparallel engines and their controller)."""
    try:
        return [p for p in kernel.children(recursive=True) if "ipyparallel" in " ".join(_cmdline(p))]
    except psutil.NoSuchProcess:
        return []


# --------------------------------------------------------------------------------------------------
# The checks, in the order a participant meets them (one page, one lab)
# --------------------------------------------------------------------------------------------------


def test_the_printed_address_opens_the_readme_rendered_as_the_first_tab(page, lab):
    assert "/lab/tree/README.md?token=" in lab.address, f"`make lab` prints {lab.address}, which opens no README"
    page.goto(lab.address)
    title = page.locator(".jp-RenderedMarkdown h1").first
    title.wait_for(timeout=120_000)
    screenshot(page, "README")
    assert tab_labels(page) == ["README.md"], f"the README should be the first and only tab: {tab_labels(page)}"
    heading = (ROOT / "README.md").read_text().splitlines()[0].removeprefix("# ")
    assert title.inner_text().strip() == heading, f"the README's title shows as {title.inner_text()!r}"
    rows = page.locator(".jp-RenderedMarkdown table tr", has=page.locator('a[href*="notebooks/"]'))
    lessons = rows.locator("td:first-child").all_inner_texts()
    assert lessons == [f"{n:02d}" for n in range(len(lessons))] and len(lessons) >= 11, f"the lesson table: {lessons}"


def test_lesson_01_runs_all_from_the_readme_and_its_live_ranks_start_answer_and_stop(page, lab, browser):
    open_from_readme(page, lab, "01_collectives")
    load = os.getloadavg()[0]
    seconds = run_all(page, "01_collectives")
    record_time("01_collectives", seconds, load, browser.version)
    answers = next(c["output"] for c in cells(page) if "of world size" in c["output"])
    said = re.findall(r"rank (\d) of world size (\d)", answers)
    assert said == [(str(r), "4") for r in range(4)], f"01_collectives: the ranks answered {answers!r}"
    (kernel,) = lab.kernels()
    assert not rank_processes(kernel), "01_collectives: ranks still run after the notebook's last cell stopped them"


def run_cell(page, text: str, timeout_s: float = 180) -> str:
    """Select the cell of the notebook on display that holds `text`, run it from the Run menu, wait for its end.
    Returns its output as the page shows it."""
    cell = page.locator(f"{ACTIVE} .jp-CodeCell", has_text=text).first
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text().strip()
    prompt.click()
    menu(page, "Run", "notebook:run-cell")
    deadline, started = time.monotonic() + timeout_s, False
    while True:  # done once it has run (its prompt showed [*] or changed) and the kernel is idle
        now = prompt.inner_text().strip()
        started = started or now != before
        if started and now != "[*]:" and kernel_state(page)[1] == "idle":
            break
        assert time.monotonic() < deadline, f"the cell `{text}` still runs after {timeout_s} s (prompt {now})"
        time.sleep(0.2)
    errors = cell.locator(f'.jp-OutputArea-output[data-mime-type="{STDERR}"]').all_inner_texts()
    assert not errors, f"the cell `{text}` shows an error (or stderr) output:\n" + "\n".join(errors)
    return cell.locator(".jp-OutputArea").inner_text()


def test_a_kernel_restart_stops_the_live_ranks_and_the_clusters_panel_never_shows_them(page, lab):
    """Lesson 01 says that restarting the kernel stops its ranks; the lab's IPython Parallel panel (whose server side
    prints the engines' logs into the lab's terminal when clusters it watches stop) must not list them."""
    if "01_collectives.ipynb" not in tab_labels(page):  # run alone
        open_from_readme(page, lab, "01_collectives")
    (kernel,) = lab.kernels()
    run_cell(page, "from utils.course.notebook import")
    assert "4 ranks ready" in run_cell(page, "start_ranks(4)")
    ranks = rank_processes(kernel)
    engines = [p for p in ranks if _cmdline(p)[1:3] == ["-m", "ipyparallel.engine"]]  # one process per rank
    assert len(engines) == 4, f"start_ranks(4) from the page started {len(engines)} ranks: {ranks}"
    page.locator('.jp-SideBar .lm-TabBar-tab[title="IPython Parallel"]').click()
    panel = page.locator(".ipp-ClusterManager")
    panel.wait_for()
    time.sleep(3)  # the panel asks the server for its clusters when it opens
    screenshot(page, "01_collectives-ranks-running")
    listed = panel.inner_text()
    assert "course-ranks" not in listed, f"the lab's IPython Parallel panel lists the course's ranks:\n{listed}"
    page.locator('.jp-SideBar .lm-TabBar-tab[title="IPython Parallel"]').click()  # closed again
    menu(page, "Kernel", "kernelmenu:restart")
    page.locator(".jp-Dialog .jp-mod-accept").click()  # "Restart"
    wait_for_kernel(page, "01_collectives")
    _, alive = psutil.wait_procs(ranks, timeout=30)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"the kernel restarted and {len(alive)} of its ranks still run: {[_cmdline(p) for p in alive]}"


@pytest.mark.parametrize("notebook", NOTEBOOKS[1:])
def test_the_lesson_runs_all_from_the_readme(page, lab, browser, notebook):
    open_from_readme(page, lab, notebook)
    load = os.getloadavg()[0]
    record_time(notebook, run_all(page, notebook), load, browser.version)


def test_the_labs_terminal_shows_no_traceback_and_no_notebook_was_saved(browser, lab):
    """Read before the lab stops (its own stop is logged as a signal). The lab logs every save: running the notebooks
    in the browser must leave their committed outputs as they are (autosave is off in this test's settings)."""
    terminal = lab.log.read_text().splitlines()
    noisy = [line for line in terminal if any(noise in line for noise in NOISE)]
    assert not noisy, "the lab's terminal shows:\n" + "\n".join(noisy[:20])
    saved = [line for line in terminal if "Saving file at" in line]
    assert not saved, f"the lab saved files while the test ran the notebooks: {saved}"
