"""Shared test options: which copy of the lessons to test (solutions/ or a learner's exercises/)."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import utils` and `from tests.harness.launch import ...` from any directory


def target_folder(config) -> Path:
    """Where the lesson scripts under test live: solutions/, exercises/, or --target-dir (a mutant's copy)."""
    folder = config.getoption("--target-dir", default=None)
    return Path(folder).resolve() if folder else ROOT / config.getoption("--target", default="solutions")


def checks_a_learners_copy(config) -> bool:
    return config.getoption("--target", default="solutions") == "exercises" or bool(config.getoption("--target-dir"))


def pytest_configure(config):
    if checks_a_learners_copy(config):
        from tests.harness.todo_report import TodoReport

        config.pluginmanager.register(TodoReport(target_folder(config)), "todo-report")  # one line per TODO at the end


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    reason = make_check_skips(item)
    if reason:
        pytest.skip(reason)


def make_check_skips(item) -> str | None:
    """`make check` on a learner's copy: a TODO still as generated is "not started" whatever its tests would
    say, so they do not run (an untouched exercise is checked in seconds); the lesson's whole-script checks
    (tests not named after a TODO) wait until every TODO is started, since the script stops at the first
    one that is not. The reason `item` is skipped, or None where it runs."""
    if not checks_a_learners_copy(item.config):
        return None
    from tests.harness.todo_report import not_started, todos_of

    lesson = re.match(r"tests/test_(\d\d)_", item.nodeid)
    if not lesson:
        return None
    waiting = not_started(lesson.group(1), target_folder(item.config))
    todos = todos_of(item.originalname or item.name)
    if todos and set(todos) <= waiting:
        return f"TODO {todos[0]} not started"
    if not todos and waiting:
        return f"waits for TODO {min(waiting)} to be started"
    return None


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
