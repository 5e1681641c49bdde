"""Every TODO of every lesson has at least two plausible mistakes that apply (`make mutants` runs them)."""

import pytest

from tests.mutants.__main__ import apply, lessons, mutants_of, solution_of
from utils.course.make_exercises import make_exercise


@pytest.mark.parametrize("lesson", lessons())
def test_every_todo_has_two_mutants_that_apply(lesson):
    solution = solution_of(lesson)
    text = solution.read_text()
    _, todos = make_exercise(text, solution.name)
    mutants = mutants_of(lesson)
    for mutant in mutants:
        mutated = apply(mutant, text)  # raises, naming the mutant, if it does not apply inside its TODO
        make_exercise(mutated, solution.name)  # the markers are intact
    per_todo = {t.number: sum(m.todo == t.number for m in mutants) for t in todos}
    missing = {n: count for n, count in per_todo.items() if count < 2}
    assert not missing, (
        f"lesson {lesson}: TODOs with fewer than two mutants in tests/mutants/lesson_{lesson}.py: {missing}; "
        "add the mistakes a learner makes there (see tests/mutants/__init__.py)"
    )


# Every mistake of every lesson names the words its failing line must show (make mutants checks the words), so that
# a learner's failing line says what differed and, for a known mistake, its cause: a new mistake or lesson too.
@pytest.mark.parametrize("lesson", lessons())
def test_every_mistake_names_the_words_its_failing_line_must_show(lesson):
    unnamed = [m.what for m in mutants_of(lesson) if not m.shows]
    assert not unnamed, f"lesson {lesson}: mutants without `shows` (the words their failing line must show): {unnamed}"
    with_words = [v.what for v in mutants_of(lesson, "VARIANTS") if v.shows]
    assert not with_words, f"lesson {lesson}: correct variants pass, so they have no failing line: {with_words}"
