"""Partial credit, in `make test`: a learner who finished a lesson's first TODO, and only that, reads
"1 of N TODOs done" from `make check`.

The mistake this catches is the one that made lesson 03 read "0 of 7" until its last TODO was done: a TODO's
tests that read a whole-script launch, which stops at the first unfinished TODO after it. The full ladder
(TODOs 1..k done must read "k of N" for every k) runs one lesson check per k, too slow for every `make test`:
`make mutants` runs it (`python -m tests.mutants --partial-credit`), before a workshop and for every changed TODO.
"""

import pytest

from tests.mutants.__main__ import check_lessons, lessons, solution_of
from utils.course.make_exercises import make_exercise


def first_todo_done(lesson: str) -> tuple[str, list]:
    """The lesson's exercise with TODO 1 completed (the solution's code) and the others as generated; its TODOs."""
    text, name = solution_of(lesson).read_text(), solution_of(lesson).name
    todos = make_exercise(text, name)[1]
    return make_exercise(text, name, done={todos[0].number})[0], todos


@pytest.fixture(scope="module")
def reports():
    """{lesson: (report, its TODOs)}: every lesson checked in one pytest session (one start of pytest and torch
    instead of one a lesson)."""
    learners = {lesson: first_todo_done(lesson) for lesson in lessons()}
    checked = check_lessons({lesson: script for lesson, (script, _) in learners.items()})
    return {lesson: (checked[lesson], todos) for lesson, (_, todos) in learners.items()}


@pytest.mark.parametrize("lesson", lessons())
def test_the_first_todo_done_alone_counts_as_one(lesson, reports):
    (statuses, count, output), todos = reports[lesson]
    assert count == f"1 of {len(todos)} TODOs done", (
        f"lesson {lesson}, TODO 1 completed (the solution's) and the others as generated: make check says "
        f"{count!r}, TODO lines {statuses}. A TODO's tests may only need that TODO and the ones before it.\n"
        + output[-3000:]
    )
    untouched = {t.number: statuses.get(t.number) for t in todos[1:]}
    assert set(untouched.values()) <= {"not started"}, (
        f"lesson {lesson}: the TODOs still as generated should read 'not started' (their tests skipped): {untouched}"
    )
