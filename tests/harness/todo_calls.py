"""Calling a learner's function from a test: a failure that names the TODO instead of a traceback."""

import pytest

from tests.harness.blame import blame_exception


def call(todo: int, function, *args):
    """function(*args), or a failure naming the TODO when the exercise has not done it yet or raises: the TODO
    whose code raised (it may be an earlier one that `function` calls), the file, the line and the error."""
    try:
        return function(*args)
    except NotImplementedError as error:
        if str(error).startswith("TODO"):
            pytest.fail(f"TODO {todo}: not done yet ({error})", pytrace=False)
        failure = error
    except Exception as error:  # a learner's mistake that raises: name the TODO, keep the cause
        failure = error
    blame = blame_exception(failure)
    if blame:
        pytest.fail(f"{blame} (called by TODO {todo}'s check as {function.__name__})", pytrace=False)
    pytest.fail(f"TODO {todo}: {function.__name__} raised {type(failure).__name__}: {failure}", pytrace=False)
