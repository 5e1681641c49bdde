"""A crash is blamed on the TODO whose code raised (tests/harness/blame.py), in a launched run and in the test's own
process, and `make check` shows it on that TODO's line with the file, the line and the error."""

import textwrap

from tests.harness.blame import blame_exception, blame_in, blame_output, todo_lines, tracebacks
from tests.harness.launch import ROOT, python
from tests.mutants import Mutant
from tests.mutants.__main__ import apply, check, solution_of
from utils.course.make_exercises import make_exercise

SCRIPT = textwrap.dedent("""\
    import sys


    def first(x):
        # TODO 1: the first step. A comment of the TODO.
        y = x + 1
        return y


    def second(x):
        # TODO 2: the second step.
        #   More comment.
        return first(x) / 0


    def main():
        value = second(int(sys.argv[1]))  # not in a TODO: the blame goes to the innermost TODO frame
        print(value)


    main()
""")


def test_todo_lines_run_from_the_comment_to_the_end_of_its_block():
    lines = todo_lines(SCRIPT)
    assert lines == {1: range(5, 8), 2: range(11, 14)}, lines


def test_a_crash_in_a_launched_run_is_blamed_on_the_todo_whose_code_raised(tmp_path):
    script = tmp_path / "99_example.py"
    script.write_text(SCRIPT)
    run = python(script, ["1"], cold=True)
    assert run.returncode != 0
    blame = run.blame()
    assert blame is not None and blame.todo == 2 and blame.line == 13, run.output
    assert str(blame).startswith("TODO 2's code raised at ") and str(blame).endswith(
        ":13 (`return first(x) / 0`): ZeroDivisionError: division by zero"
    ), str(blame)
    assert run.tail().splitlines()[0] == str(blame), "the tail starts with the blame"
    assert blame_in(f"some text\n{blame}\nmore") == (2, str(blame))


def test_the_first_rank_that_raised_is_blamed_not_the_ranks_that_lost_it(tmp_path):
    script = tmp_path / "99_example.py"
    script.write_text(SCRIPT)
    output = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        f'[rank0]:   File "{script}", line 6, in first',
        "[rank0]:     y = x + 1",
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
        "[rank1]: Traceback (most recent call last):",
        f'[rank1]:   File "{script}", line 17, in main',
        f'[rank1]:   File "{script}", line 13, in second',
        "[rank1]:     return first(x) / 0",
        "[rank1]:            ~~~~~~~~~^~~",
        "[rank1]: ZeroDivisionError: division by zero",
        "[launcher] rank 1 exited with code 1: stopping the other ranks",
    ])  # fmt: skip
    assert [error for _, error in tracebacks(output)][1] == "ZeroDivisionError: division by zero"
    blame = blame_output(output, script)
    assert blame.todo == 2 and blame.error == "ZeroDivisionError: division by zero", blame
    assert blame_output(output, ROOT / "solutions" / "00_setup_and_baseline.py") is None, "another folder's file"


def test_an_exception_in_the_tests_process_is_blamed_through_its_chain(tmp_path):
    script = tmp_path / "99_example.py"
    script.write_text(SCRIPT.replace("\nmain()\n", "\n"))
    namespace = {}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    try:
        try:
            namespace["second"](1)
        except ZeroDivisionError as error:
            raise AssertionError("a check's own failure") from error
    except AssertionError as error:
        blame = blame_exception(error, tmp_path)
    assert blame is not None and (blame.todo, blame.line) == (2, 13), blame


def test_make_check_shows_the_crash_on_the_line_of_the_todo_that_raised():
    """Lesson 10, TODO 1 written without bincount's minlength: it raises for a batch in which an expert is chosen by no
    token. `make check`'s TODO 1 line names TODO 1's code, the file and line, and the error."""
    solution = solution_of("10")
    text = solution.read_text()
    mistake = Mutant(1, "no minlength", "torch.bincount(experts.flatten(), minlength=n_experts)",
                     "torch.bincount(experts.flatten())")  # fmt: skip
    todos = make_exercise(text, solution.name)[1]
    learner = make_exercise(apply(mistake, text), solution.name, done={t.number for t in todos})[0]
    statuses, _, output = check("10", learner, "todo1_")
    line = statuses.get(1, output[-2000:])
    assert line.startswith("failing: TODO 1's code raised at "), line
    assert "10_mixture_of_experts.py:" in line and "RuntimeError: The size of tensor a" in line, line
