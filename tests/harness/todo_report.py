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

import pytest

from tests.harness.blame import blame_exception, blame_in, blame_lab
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
    return first if len(first) <= 320 else first[:317] + "..."


def hint_note(lesson: str, todo) -> str:
    """Which of a failing TODO's hints the learner has read, and how to ask for the next."""
    if not todo.hints:
        return ""
    level = seen(lesson, todo.number)
    if level >= HINT_LEVELS:
        return f" (hints: all {HINT_LEVELS} read)"
    ask = f"make hint LESSON={lesson} TODO={todo.number}"
    return f" (hints read: {level} of {HINT_LEVELS}; `{ask}` for the {'first' if level == 0 else 'next'})"


def check_words(test_name: str) -> str:
    """A whole-script check's name in words: test_shared_options_change_the_run -> shared options change the run."""
    return re.sub(r"\[.*\]$", "", test_name).removeprefix("test_").replace("_", " ")


WAITS = re.compile(r"needs TODOs? ([\d, ]+) first|waits for TODO (\d+)")


def waits_for(line: str) -> str | None:
    """'TODO 5' (or 'TODOs 1, 3') when a skip reason or failure line says the check waits for earlier TODOs."""
    match = WAITS.search(line)
    if not match:
        return None
    numbers = [n.strip() for n in (match.group(1) or match.group(2)).split(",") if n.strip()]
    return ("TODO " if len(numbers) == 1 else "TODOs ") + ", ".join(numbers)


class TodoReport:
    """A pytest plugin: collect each test's outcome by lesson and TODO; print the learner's summary.

    A failure whose code raised inside another TODO's lines (tests/harness/blame.py) is that TODO's: it shows there,
    with the file, the line and the error, and the check that ran it waits for that TODO."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or ROOT / "exercises"  # where the learner's scripts are
        # lesson -> todo (or None: the whole-script checks) -> [(test name, outcome, one line)]
        self.outcomes = defaultdict(lambda: defaultdict(list))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """An exception raised in this process by a learner's function: remember which TODO's code raised it."""
        outcome = yield
        report = outcome.get_result()
        if call.excinfo is not None and report.failed:
            blame = blame_exception(call.excinfo.value, self.folder)
            if blame:
                report.user_properties.append(("blame", str(blame)))

    def pytest_runtest_logreport(self, report):
        if not (report.when == "call" or report.outcome != "passed"):  # setup errors count as failures too
            return
        lesson = re.match(r"tests/test_(\d\d)_", report.nodeid)
        if not lesson:
            return
        name = report.nodeid.split("::")[-1]
        by_todo, todos = self.outcomes[lesson.group(1)], todos_of(name)
        if report.outcome == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            for todo in todos or [None]:
                by_todo[todo].append((name, "skipped", reason))
            return
        line = one_line(report) if report.failed else ""
        texts = (dict(report.user_properties).get("blame", ""), str(report.longrepr))
        blamed, blame = next(filter(None, (blame_in(text, lesson.group(1)) for text in texts)), (None, None))
        in_lab = blame_lab(texts[1], lesson.group(1), self.folder) if blamed is None and report.failed else None
        if in_lab and in_lab.todo not in todos:  # a lab's function ran into another TODO's code, which raised
            blamed, blame = in_lab.todo, str(in_lab)
        if blamed is not None:  # the code that raised is TODO `blamed`'s: its failure, and this check waits for it
            by_todo[blamed].append((name, "failed", blame))
            for todo in [t for t in todos if t != blamed] or ([None] if not todos else []):
                by_todo[todo].append((name, "failed", f"waits for TODO {blamed}"))
            return
        for todo in todos or [None]:
            by_todo[todo].append((name, report.outcome, line))

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
                failures = [line for _, outcome, line in results if outcome == "failed"]
                # A failure of this TODO's own code comes before its checks that wait for another TODO.
                failures.sort(key=lambda line: line.startswith("waits for"))
                untouched = todo.number in waiting
                passed = [name for name, outcome, _ in results if outcome == "passed"]
                if passed and not failures:
                    status, done = "passing", done + 1
                elif untouched:
                    status = "not started"
                elif failures and all(line.startswith("waits for") for line in failures):
                    status = f"not checked yet ({failures[0]})"
                elif failures:
                    status = f"failing: {failures[0]}" + hint_note(lesson, todo)
                elif results:  # every test of this TODO skipped: it needs the TODOs before it
                    named = next(filter(None, (waits_for(line) for _, _, line in results)), None)
                    status = (
                        f"not checked yet (waits for {named})"
                        if named
                        else "not checked yet (needs the TODOs before it)"
                    )
                else:
                    status = "no test selected"
                write(f"  TODO {todo.number:<2} {(todo.title + ' ').ljust(width, '.')} {status}")
            self.write_other_checks(write, by_todo.get(None, []), waiting)
            write(f"{done} of {len(todos)} TODOs done")

    @staticmethod
    def write_other_checks(write, others, waiting):
        """The checks of the whole script (named after no TODO): how many pass, which wait for which TODO, and
        the first failing ones with their line."""
        if not others:
            return
        if waiting and all(outcome == "skipped" for _, outcome, _ in others):
            write(f"  other checks (the whole script): run once every TODO is started (TODO {min(waiting)} is not)")
            return
        passing = [name for name, outcome, _ in others if outcome == "passed"]
        pending = defaultdict(list)  # "TODO 5" -> the checks waiting for it
        failed, skipped = [], []
        for name, outcome, line in others:
            if outcome in ("skipped", "failed") and (todos := waits_for(line)):
                pending[todos].append(check_words(name))
            elif outcome == "failed":
                failed.append((name, line))
            elif outcome == "skipped":
                skipped.append(name)
        parts = [f"{len(passing)} of {len(others)} passing"]
        parts += [f"{len(names)} waiting for {todos}" for todos, names in pending.items()]
        parts += [f"{len(failed)} failing"] if failed else []
        parts += [f"{len(skipped)} skipped here ({'; '.join(map(check_words, skipped))})"] if skipped else []
        write(f"  other checks (the whole script's runs, options and refusals): {', '.join(parts)}")
        for todos, names in pending.items():
            write(f"    waiting for {todos}: {'; '.join(names)}")
        for name, line in failed[:5]:
            write(f"    {check_words(name)}: {line}")
