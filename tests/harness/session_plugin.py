"""The session's set-up and report for every run of the suite, notebooks included (pyproject.toml loads it with
`-p tests.harness.session_plugin`: a conftest.py under tests/ would not see the notebooks' cells).

- The suite never downloads: HF_*_OFFLINE and WANDB_MODE=offline for this process and the kernels it starts.
  The kernels' launches then read what the tests' launches read (HF_* at `import datasets`), so both use the
  session's warm ranks (utils/course/warm_ranks.py), started before the first kernel when notebooks run.
- With several streams (pytest-xdist, `make test`), the files that take longest start first.
- At the end: the time of each test file and of each notebook.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    if getattr(config.option, "nbval", False) and os.environ.get("COURSE_COLD_RANKS") != "1":
        from tests.harness.launch import course_env, warm_pool

        warm_pool(course_env())  # started before the first kernel, so that every kernel finds it


def pytest_ignore_collect(collection_path, config):
    """Lessons 00, 01 and 10 run in the browser when the browser test runs in the same session (`make test`), which
    compares their outputs as nbval does (tests/harness/notebook_outputs.py): nbval leaves them out then."""
    from tests.harness.notebook_outputs import IN_BROWSER, browser_runs_in

    if collection_path.suffix == ".ipynb" and collection_path.stem in IN_BROWSER and browser_runs_in(config.args):
        return True
    return None


# The longest files and notebooks, longest first (their times in `make test`'s report, two streams on 2 cores).
# A stream takes a whole file at a time: started last, a long file would leave the other stream idle at the end.
# xdist hands each stream two files to begin with, in turn (the 1st and 3rd to one stream): test_slurm.py and
# lesson 08's file, whose requeue test queues a Slurm job too, go to the same stream, so that job does not wait
# behind the sbatch files' jobs (test_slurm.py submits them all at once). The browser test (one lab; lessons 00, 01 and
# 10, which nbval then leaves out: pytest_ignore_collect above) starts at once in the other stream.
LONGEST_FIRST = [
    "tests/test_slurm.py",
    "tests/test_browser.py",
    "tests/test_08_fault_tolerance.py",
    "tests/test_03_zero_fsdp.py",
    "tests/test_04_tensor_parallel.py",
    "tests/test_06_3d_parallelism.py",
    "tests/test_notebook_ranks.py",
    "tests/test_02_data_parallel.py",
    "notebooks/02_data_parallel.ipynb",
    "tests/test_05_pipeline_parallel.py",
    "tests/test_11_where_the_time_goes.py",
    "tests/test_01_collectives.py",
    "notebooks/03_zero_fsdp.ipynb",
    "tests/test_07_communication_efficient.py",
]


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return  # one stream: the order of the files does not change its time
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), position[id(item)]))


# Each notebook's and each test file's time (set-up, run and tear-down summed), printed at the end: the
# figures `make notebooks` reports per notebook and that show where `make test` spends its time.
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.config.get_verbosity() < -1:
        return  # make check (-qq): the learner sees the TODO lines only
    for title, suffix in (("time per test file", ".py"), ("time per notebook", ".ipynb")):
        files = {path: seconds for path, seconds in _seconds.items() if path.endswith(suffix)}
        if files:
            terminalreporter.section(title)
            for path, seconds in sorted(files.items()):
                terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
            terminalreporter.write_line(f"{sum(files.values()):7.1f} s  in all")
