"""Shared test options: which copy of the lessons to test (solutions/ or a learner's exercises/)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import utils` and `from tests.launch import ...` from any directory


def pytest_configure(config):
    if config.getoption("--target", default="solutions") == "exercises":
        from tests.todo_report import TodoReport

        config.pluginmanager.register(TodoReport(), "todo-report")  # one line per TODO at the end


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        choices=["solutions", "exercises"],
        default="solutions",
        help="test the reference solutions (default) or the exercises a learner completed",
    )


@pytest.fixture(scope="session")
def target(request) -> str:
    return request.config.getoption("--target")


@pytest.fixture(scope="session")
def lesson(target):
    """lesson("01") -> the path of solutions/01_*.py (or exercises/01_*.py with --target exercises)."""

    def find(number: str) -> Path:
        matches = sorted((ROOT / target).glob(f"{number}_*.py"))
        assert matches, f"no {target}/{number}_*.py"
        return matches[0]

    return find
