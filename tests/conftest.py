"""Shared test options: which copy of the lessons to test (solutions/ or a learner's exercises/)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import utils` and `from tests.launch import ...` from any directory


def target_folder(config) -> Path:
    """Where the lesson scripts under test live: solutions/, exercises/, or --target-dir (a mutant's copy)."""
    folder = config.getoption("--target-dir", default=None)
    return Path(folder).resolve() if folder else ROOT / config.getoption("--target", default="solutions")


def pytest_configure(config):
    # The suite never downloads, and the notebooks' kernels inherit this: their launches then read what the
    # tests' launches read (HF_* at `import datasets`), so both can use the session's warm ranks.
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    if getattr(config.option, "nbval", False) and os.environ.get("COURSE_COLD_RANKS") != "1":
        from tests.launch import course_env, warm_pool

        warm_pool(course_env())  # started before the first kernel, so that every kernel finds it
    if config.getoption("--target", default="solutions") == "exercises" or config.getoption("--target-dir"):
        from tests.todo_report import TodoReport

        config.pluginmanager.register(TodoReport(target_folder(config)), "todo-report")  # one line per TODO at the end


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        choices=["solutions", "exercises"],
        default="solutions",
        help="test the reference solutions (default) or the exercises a learner completed",
    )
    parser.addoption(
        "--target-dir",
        default=None,
        help="test the lesson scripts in this folder instead (`make mutants` puts a mutated solution there)",
    )


@pytest.fixture(scope="session")
def target(request) -> str:
    return request.config.getoption("--target")


@pytest.fixture(scope="session")
def lesson(request):
    """lesson("01") -> the path of solutions/01_*.py (or exercises/01_*.py with --target exercises)."""
    folder = target_folder(request.config)

    def find(number: str) -> Path:
        matches = sorted(folder.glob(f"{number}_*.py"))
        assert matches, f"no {folder}/{number}_*.py"
        return matches[0]

    return find


# Each notebook's and each test file's time (set-up, run and tear-down summed), printed at the end: the
# figures `make notebooks` reports per notebook and that show where `make test` spends its time.
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    for title, suffix in (("time per test file", ".py"), ("time per notebook", ".ipynb")):
        files = {path: seconds for path, seconds in _seconds.items() if path.endswith(suffix)}
        if files:
            terminalreporter.section(title)
            for path, seconds in sorted(files.items()):
                terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
            terminalreporter.write_line(f"{sum(files.values()):7.1f} s  in all")
