"""A crash is blamed on the TODO whose code raised (tests/harness/blame.py), in a launched run and in the test's own
process, and `make check` shows it on that TODO's line with the file, the line and the error."""

import textwrap

from tests.harness.blame import blame_exception, blame_in, blame_lab, blame_output, todo_lines, tracebacks
from tests.harness.launch import ROOT, python
from tests.mutants import Mutant
from tests.mutants.__main__ import apply, check, solution_of
from utils.course.lab import describe_error, describe_lab_error
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


def test_a_lab_ranks_error_names_the_line_of_the_lesson_script_that_raised(tmp_path):
    """A live lab reports a rank's error in one line (utils/course/lab.py): the innermost line of a lesson script
    in the traceback, even when the error itself is raised deeper (in torch), with its code; none for a wait."""
    script = tmp_path / "99_example.py"
    script.write_text(SCRIPT.replace("\nmain()\n", "\n"))
    namespace = {}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    try:
        namespace["second"](1)
    except ZeroDivisionError as error:
        raised = error
    expected = f"raised ZeroDivisionError at {script}:13 (`return first(x) / 0`): division by zero"
    assert describe_lab_error(raised, "stuck") == expected == describe_error(raised)
    deeper = tmp_path / "98_example.py"
    deeper.write_text("import json\n\n\ndef parse(text):\n    return json.loads(text)  # raised inside json\n")
    exec(compile(deeper.read_text(), str(deeper), "exec"), namespace)
    try:
        namespace["parse"]("{")
    except ValueError as error:
        assert describe_lab_error(error, "stuck").startswith(f"raised JSONDecodeError at {deeper}:5 (`return json")
    try:
        int("not a number")  # raised here, in no lesson script: no line to name
    except ValueError as error:
        assert describe_lab_error(error, "stuck") == f"raised ValueError: {error}"
    assert describe_lab_error(TimeoutError("Timed out waiting 5000ms for recv"), "stuck") == "stuck"


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


def test_a_lab_rank_that_raised_in_another_todos_lines_is_blamed_on_that_todo(tmp_path):
    """A live lab's failure names the line that raised (utils/course/lab.py's where_raised); when that line is another
    TODO's, `make check` shows the crash on that TODO's line and the lab's TODO waits for it, as for any check."""
    script = tmp_path / "99_example.py"
    script.write_text(SCRIPT)
    text = (
        f"TODO 6: rank 1: f raised ZeroDivisionError at {script}:13 (`return first(x) / 0`): division by zero. Hint: h"
    )
    blame = blame_lab(text, "99", tmp_path)
    assert blame is not None and (blame.todo, blame.line, blame.error) == (2, 13, "ZeroDivisionError: division by zero")
    assert blame_lab(text.replace(":13 ", ":17 "), "99", tmp_path) is None  # line 17 is in no TODO: the lab's own
    assert blame_lab(text, "98", tmp_path) is None  # another lesson's script
    assert blame_lab(text, "99", ROOT / "exercises") is None  # not the learner's script: the solution's, say


def test_make_check_blames_a_lab_crash_on_the_todo_whose_code_raised():
    """Lesson 07: the lab's function (TODO 6) calls TODO 3's quantize, written for 2-D tensors only. TODO 3's line
    names its code, the file, the line and the error; TODO 6 waits for it."""
    solution = solution_of("07")
    text = solution.read_text()
    broken_quantize = Mutant(
        3, "a maximum over dim 1", "    top = x.abs().max()\n", "    top = x.abs().max(dim=1).values\n"
    )
    calls_quantize = Mutant(6, "positions from quantize", "    return torch.randperm(numel, generator=generator)[:k]\n",
                            "    codes, _ = quantize(torch.rand(numel, generator=generator), 8, generator)\n"
                            "    return codes.float().abs().topk(k).indices\n")  # fmt: skip
    todos = make_exercise(text, solution.name)[1]
    learner = make_exercise(apply(calls_quantize, apply(broken_quantize, text)), solution.name,
                            done={t.number for t in todos})[0]  # fmt: skip
    statuses, _, output = check("07", learner, "todo6_")
    assert statuses.get(3, output[-2000:]).startswith("failing: TODO 3's code raised at "), output[-2000:]
    assert "07_communication_efficient.py:" in statuses[3] and "IndexError: Dimension out of range" in statuses[3]
    assert statuses.get(6) == "not checked yet (waits for TODO 3)", output[-2000:]
