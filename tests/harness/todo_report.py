"""`make check LESSON=NN`: what a learner reads after checking an exercise, one line per TODO.

    TODO 1  ring reduce-scatter phase ......... passing
    TODO 2  ring all-gather phase ............. not started
    TODO 3  all-reduce from two collectives ... failing: tensor of shape [7]: differs from the library by 2.0
    2 of 3 TODOs done

A test belongs to the TODOs its name gives (`test_todo3_...`, `test_todos_1_2_...`); other tests are
"other checks". A TODO is "not started" when the learner's exercise still has the generated text between
its comment and the next TODO's, "passing" when all its tests pass, else "failing" with the first
failure's message (the tests' messages start by naming the TODO and say what to fix).
"""

import re
from collections import defaultdict
from pathlib import Path

from utils.course.hints import seen
from utils.course.make_exercises import HINT_LEVELS, TODO_HEADER, make_exercise

ROOT = Path(__file__).resolve().parents[2]
TEST_TODOS = re.compile(r"^test_todos?_?((?:\d+_)+)")


def todos_of(test_name: str) -> list[int]:
    match = TEST_TODOS.match(test_name)
    return [int(n) for n in match.group(1).strip("_").split("_")] if match else []


def sections(text: str) -> dict[int, list[str]]:
    """TODO number -> the lines the learner edits for it: from its header to the next TODO header or to the
    end of the block that holds it (the first line indented less than the header)."""
    result, current, indent = {}, None, 0
    for line in text.splitlines():
        match = TODO_HEADER.match(line)
        if match:
            current, indent = int(match.group(2)), len(match.group(1))
            result[current] = []
        elif current is not None and line.strip() and len(line) - len(line.lstrip()) < indent:
            current = None
        if current is not None:
            result[current].append(line.rstrip())
    return result


def not_started(lesson: str, folder: Path) -> set[int]:
    """The TODOs of `lesson` whose lines in the learner's copy (in `folder`) are still as generated."""
    if (lesson, folder) not in _not_started:
        solution = next((ROOT / "solutions").glob(f"{lesson}_*.py"))
        exercise = folder / solution.name
        pristine = sections(make_exercise(solution.read_text(), solution.name)[0])
        mine = sections(exercise.read_text()) if exercise.exists() else {}
        _not_started[lesson, folder] = {n for n, lines in pristine.items() if mine.get(n) == lines}
    return _not_started[lesson, folder]


_not_started: dict[tuple[str, Path], set[int]] = {}


def one_line(report) -> str:
    """The failure's own message, first line, without pytest's assertion rewriting or the exception name."""
    blocked = re.search(r"TODO \d+: needs (TODO \d+) first", str(report.longrepr))
    if blocked:  # a check that builds on an earlier TODO which is wrong: that TODO's line says why
        return f"waits for {blocked.group(1)}"
    stopped = re.search(r"ERROR: (TODO \d+: .+?) is not done yet", str(report.longrepr))
    if stopped:  # the script stopped at an unfinished TODO before it could be checked
        return f"the script stopped at {stopped.group(1)} (not done yet)"
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    first = re.sub(r"^(AssertionError|Failed|RuntimeError|[A-Za-z]+Error):\s*", "", first)
    first = re.sub(r"^TODO \d+(?: \([^)]*\))?[:,]\s*", "", first)
    return first if len(first) <= 200 else first[:197] + "..."


def hint_note(lesson: str, todo) -> str:
    """Which of a failing TODO's hints the learner has read, and how to ask for the next."""
    if not todo.hints:
        return ""
    level = seen(lesson, todo.number)
    if level >= HINT_LEVELS:
        return f" (hints: all {HINT_LEVELS} read)"
    ask = f"make hint LESSON={lesson} TODO={todo.number}"
    return f" (hints read: {level} of {HINT_LEVELS}; `{ask}` for the {'first' if level == 0 else 'next'})"


class TodoReport:
    """A pytest plugin: collect each test's outcome by lesson and TODO; print the learner's summary."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or ROOT / "exercises"  # where the learner's scripts are
        self.outcomes = defaultdict(lambda: defaultdict(list))  # lesson -> todo (or None) -> [(name, report)]

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # setup errors count as failures too
            lesson = re.match(r"tests/test_(\d\d)_", report.nodeid)
            if not lesson:
                return
            name = report.nodeid.split("::")[-1]
            for todo in todos_of(name) or [None]:
                self.outcomes[lesson.group(1)][todo].append((name, report))

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        for lesson, by_todo in sorted(self.outcomes.items()):
            solution = next((ROOT / "solutions").glob(f"{lesson}_*.py"))
            exercise = self.folder / solution.name
            todos = make_exercise(solution.read_text(), solution.name)[1]
            waiting = not_started(lesson, self.folder)
            write("")
            write(f"Lesson {lesson}: {exercise.relative_to(ROOT) if exercise.is_relative_to(ROOT) else exercise}")
            done = 0
            width = max(len(t.title) for t in todos) + 3
            for todo in todos:
                results = by_todo.get(todo.number, [])
                failures = [r for _, r in results if r.outcome == "failed"]
                untouched = todo.number in waiting
                passed = [r for _, r in results if r.outcome == "passed"]
                if passed and not failures:
                    status, done = "passing", done + 1
                elif untouched:
                    status = "not started"
                elif failures and all(one_line(r).startswith("waits for") for r in failures):
                    status = f"not checked yet ({one_line(failures[0])})"
                elif failures:
                    status = f"failing: {one_line(failures[0])}" + hint_note(lesson, todo)
                elif results:  # every test of this TODO skipped: it needs the TODOs before it
                    status = "not checked yet (needs the TODOs before it)"
                else:
                    status = "no test selected"
                write(f"  TODO {todo.number:<2} {(todo.title + ' ').ljust(width, '.')} {status}")
            others = [(n, r) for n, r in by_todo.get(None, []) if r.outcome != "skipped"]
            failed = [(n, r) for n, r in others if r.outcome == "failed"]
            if others:
                write(f"  other checks: {len(others) - len(failed)} of {len(others)} passing")
                for name, report in failed[:5]:
                    write(f"    {name}: {one_line(report)}")
            elif by_todo.get(None) and waiting:
                write(f"  other checks (the whole script): run once every TODO is started (TODO {min(waiting)} is not)")
            write(f"{done} of {len(todos)} TODOs done")
