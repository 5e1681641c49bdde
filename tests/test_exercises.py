"""Exercises come from solutions: in sync, numbered, and an untouched exercise never hangs."""

import re

import pytest

from tests.harness.launch import ROOT, torchrun
from utils.course.make_exercises import MarkerError, expected_exercises, make_exercise

SOLUTION = """import torch


def step(x):
    # TODO 1: double it. Multiply by two.
    # BEGIN SOLUTION
    x = x * 2
    # END SOLUTION
    # TODO 2: keep the pre-lesson code in the exercise
    #   (a second comment line).
    # BEGIN SOLUTION
    y = x + 1
    # EXERCISE
    # y = x
    # END SOLUTION
    return y
"""


def test_generator_replaces_regions_and_keeps_the_todo_comments():
    exercise, todos = make_exercise(SOLUTION, "99_demo.py")
    assert [(t.number, t.title) for t in todos] == [(1, "double it"), (2, "keep the pre-lesson code in the exercise")]
    assert '    raise NotImplementedError("TODO 1: double it")' in exercise
    assert "    y = x\n" in exercise and "x * 2" not in exercise and "x + 1" not in exercise
    assert "# TODO 2: keep the pre-lesson code" in exercise and "(a second comment line)." in exercise
    assert "BEGIN SOLUTION" not in exercise and "EXERCISE" not in exercise.split("\n", 2)[2]
    namespace = {}
    exec(compile(exercise, "exercise", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="TODO 1: double it"):
        namespace["step"](1)


@pytest.mark.parametrize(
    "broken, complaint",
    [
        (SOLUTION.replace("TODO 2:", "TODO 1:"), "numbered 1, 2, 3"),  # a repeated number
        (SOLUTION.replace("TODO 2:", "TODO 3:"), "numbered 1, 2, 3"),  # a gap
        (SOLUTION.replace("    # END SOLUTION\n    return", "    return"), "has no # END SOLUTION"),
        (SOLUTION.replace("    # TODO 1: double it. Multiply by two.\n", ""), "without a '# TODO n"),
        (SOLUTION.replace("    # BEGIN SOLUTION\n    x = x * 2", "    x = x * 2"), "not followed by"),
    ],
    ids=["repeated", "gap", "unclosed", "no-header", "no-region"],
)
def test_generator_rejects_broken_markers(broken, complaint):
    with pytest.raises(MarkerError, match=complaint):
        make_exercise(broken, "99_demo.py")


def test_every_exercise_is_generated_from_its_solution():
    expected = expected_exercises()
    assert expected, "no solutions found"
    for path, text in expected.items():
        assert path.exists(), f"{path.name} is missing: run `python -m utils.course.make_exercises`"
        assert path.read_text() == text, (
            f"exercises/{path.name} is stale: run `python -m utils.course.make_exercises` "
            "(a learner's completed exercise differs on purpose; check it with `make check LESSON=NN`)"
        )


def test_every_lesson_has_its_notebook_sbatch_and_todos_cited_by_number():
    for solution in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py")):
        number = solution.name[:2]
        notebooks = list((ROOT / "notebooks").glob(f"{number}_*.ipynb"))
        assert notebooks, f"lesson {number} has no notebook"
        assert list((ROOT / "slurm").glob(f"{number}_*.sbatch")), f"lesson {number} has no sbatch file"
        todos = {t.number for t in make_exercise(solution.read_text(), solution.name)[1]}
        cited = {int(n) for n in re.findall(r"TODO (\d+)", notebooks[0].read_text())}
        assert cited <= todos, f"notebook {notebooks[0].name} cites TODOs {sorted(cited - todos)} that do not exist"
        assert re.search(r"\bline \d+", notebooks[0].read_text()) is None, "notebooks cite TODO numbers, not lines"


UNTOUCHED = [p for p, text in expected_exercises().items() if p.exists() and p.read_text() == text]
SINGLE_PROCESS_LESSONS = {"00"}  # the single-device baseline refuses a world size above 1


@pytest.mark.parametrize("exercise", UNTOUCHED, ids=lambda p: p.stem)
def test_untouched_exercise_runs_or_stops_at_once_naming_a_todo(exercise, tmp_path):
    nproc = 1 if exercise.name[:2] in SINGLE_PROCESS_LESSONS else 2
    # One exercise under torchrun itself (what a learner runs), the others on warm ranks: what is checked here
    # is the script's own stop, which torchrun does not change (a launch costs seconds of imports on 2 cores).
    cold = exercise == UNTOUCHED[0]
    run = torchrun(exercise, nproc, ["--steps", "2"], timeout=90, cold=cold)  # a hang fails here, with the output
    if run.returncode != 0:
        assert re.search(r"ERROR: TODO \d+: .+ is not done yet", run.output), run.tail()
        assert "Traceback" not in run.output.split("ERROR: TODO")[0], "the TODO message must not follow a traceback"
