"""Calling a learner's function from a test: a failure that names the TODO instead of a traceback."""

import pytest


def call(todo: int, function, *args):
    """function(*args), or a failure naming the TODO when the exercise has not done it yet or raises."""
    try:
        return function(*args)
    except NotImplementedError as error:
        pytest.fail(f"TODO {todo}: not done yet ({error})", pytrace=False)
    except Exception as error:  # a learner's mistake that raises: name the TODO, keep the cause
        pytest.fail(f"TODO {todo}: {function.__name__} raised {type(error).__name__}: {error}", pytrace=False)
