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


def prerequisites(passes):
    """needs(1, 3, ...) for a test that builds on earlier TODOs: skips it, naming them, while those TODOs fail their
    own checks, so that one mistake is blamed on one TODO (the report shows the test as waiting). passes(todo) runs
    that TODO's own check and returns whether it held (a check that raises, or pytest.fail's exception, is False);
    each TODO is checked once a module."""
    outcome = {}

    def needs(*todos):
        for todo in todos:
            if todo not in outcome:
                try:
                    outcome[todo] = passes(todo) is not False
                except BaseException:  # AssertionError, or pytest.fail's exception
                    outcome[todo] = False
        failing = [todo for todo in todos if not outcome[todo]]
        if failing:
            pytest.skip(f"needs TODO {', '.join(map(str, failing))} first (see its own test)")

    return needs
