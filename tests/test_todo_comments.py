"""Each TODO comment states the goal, not the code, and its hints come on demand (tests/harness/todo_comments.py).

Per TODO: the comment an exercise shows names at most MAX_SHARE of its code's own identifiers (those the
learner has not been given already), and the TODO has three hints. Per lesson: the comments average at most
MAX_MEAN_WORDS words (a lab's, which describes its bug, apart)."""

import json

import pytest

from tests.harness import todo_comments
from tests.harness.todo_comments import MAX_MEAN_WORDS, MAX_SHARE, mean_words, measure
from utils.course import hints
from utils.course.make_exercises import make_exercise

LESSONS = todo_comments.lessons()


@pytest.mark.parametrize("lesson", LESSONS)
def test_comments_state_the_goal_not_the_code(lesson):
    measures = measure(lesson)
    over = [f"TODO {m.number} names {m.share:.0%}: {m.named}" for m in measures if m.share > MAX_SHARE]
    assert not over, f"lesson {lesson}: comments that name more than {MAX_SHARE:.0%} of their code: {over}"
    assert mean_words(measures) <= MAX_MEAN_WORDS, (
        f"lesson {lesson}: its TODO comments average {mean_words(measures):.0f} words, over {MAX_MEAN_WORDS}"
    )


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_todo_has_three_hints(lesson):
    missing = [m.number for m in measure(lesson) if m.hints != 3]
    assert not missing, f"lesson {lesson}: TODOs without their three hints: {missing}"


SOLUTION = '''def double(x):
    """Twice x."""
    # TODO 1: double it. The result is twice the input.
    # HINT 1: what does adding a number to itself give?
    # HINT 2: add the input
    #   to itself.
    # HINT 3: return x + x
    # BEGIN SOLUTION
    return x + x
    # END SOLUTION
'''


def test_the_exercise_shows_no_hint_and_the_measure_sees_the_code():
    text, (todo,) = make_exercise(SOLUTION, "00_x.py")
    assert "HINT" not in text and "itself" not in text and "TODO 1: double it." in text
    assert todo.hints == ["what does adding a number to itself give?", "add the input to itself.", "return x + x"]
    assert todo_comments.code_names(todo.code) == set()  # `return` is a keyword, `x` one letter: nothing counted


def test_hints_come_one_level_at_a_time_and_are_remembered(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "00_x.py").write_text(SOLUTION)
    seen = tmp_path / "seen.json"
    first = hints.hint_text("00", 1, root=tmp_path, path=seen)
    assert "hint 1 of 3" in first and "adding a number to itself" in first and "hint 2" in first
    assert "add the input to itself." in hints.hint_text("00", 1, root=tmp_path, path=seen)
    third = hints.hint_text("00", 1, root=tmp_path, path=seen)
    assert "return x + x" in third and "last hint" in third
    assert "return x + x" in hints.hint_text("00", 1, root=tmp_path, path=seen)  # stays at the last
    assert json.loads(seen.read_text()) == {"00/1": 3}
    assert "hint 1 of 3" in hints.hint_text("00", 1, level=1, root=tmp_path, path=seen)
    with pytest.raises(SystemExit, match="no TODO 2"):
        hints.hint_text("00", 2, root=tmp_path, path=seen)
    with pytest.raises(SystemExit, match="no lesson '99'"):
        hints.hint_text("99", 1, root=tmp_path, path=seen)
