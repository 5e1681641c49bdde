"""`make mutants [LESSON=NN]`: does each TODO's check catch the mistakes learners make? And does partial work
earn partial credit?

    python -m tests.mutants [--lesson 03] [--todo 2] [--quick]     every mutant of tests/mutants/lesson_NN.py
    python -m tests.mutants --partial-credit [--lesson 03]         TODOs 1..k done must show "k of N TODOs done"

For each mutant, the lesson's solution with that one mistake becomes a learner's completed exercise (in a
temporary folder) and `make check`'s machinery runs on it (the lesson's tests with --target-dir, then the
one-line-per-TODO report). The table shows lesson, TODO, the mistake, and the line a learner would see.
Killed: the mutant's TODO is "failing", its line shows the words the entry names (`shows`: what differed or the
likely cause), and no other TODO is failing. A lesson may also list VARIANTS (correct answers
written another way, as Mutants): each must be accepted, its TODO "passing" and no TODO failing. Every TODO's
tests run (the lesson's whole-script checks, which no TODO line reads, do not); --quick runs only the tests named
after the mutant's TODO (faster while writing mutants; it cannot see another TODO being blamed).
"""

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.harness.launch import course_env
from tests.mutants import Mutant
from utils.course.make_exercises import BEGIN, END, TODO_HEADER, make_exercise

ROOT = Path(__file__).resolve().parents[2]
STATUSES = r"passing|not started|failing.*|not checked yet.*|no test selected"
REPORT_LINE = re.compile(rf"^\s+TODO (\d+)\s+(.*?) \.+ ({STATUSES})$")
COUNT_LINE = re.compile(r"^(\d+) of (\d+) TODOs done$")


def lessons() -> list[str]:
    return sorted(p.stem[:2] for p in (ROOT / "solutions").glob("[0-9][0-9]_*.py"))


def solution_of(lesson: str) -> Path:
    return next((ROOT / "solutions").glob(f"{lesson}_*.py"))


def mutants_of(lesson: str, kind: str = "MUTANTS") -> list[Mutant]:
    """The lesson's mistakes (kind "MUTANTS") or its correct variants ("VARIANTS", which a lesson may not list)."""
    try:
        return getattr(importlib.import_module(f"tests.mutants.lesson_{lesson}"), kind, [])
    except ModuleNotFoundError:
        return []


def regions(text: str) -> dict[int, tuple[int, int]]:
    """TODO number -> (start, end) character offsets of its solution region (between the marker lines)."""
    found, number, start, offset = {}, None, None, 0
    for line in text.splitlines(keepends=True):
        header = TODO_HEADER.match(line.rstrip("\n"))
        if header:
            number = int(header.group(2))
        elif line.strip() == BEGIN:
            start = offset + len(line)
        elif line.strip() == END and number is not None and start is not None:
            found[number], start = (start, offset), None
        offset += len(line)
    return found


def apply(mutant: Mutant, text: str) -> str:
    """The solution with the mutant's mistake; refuses a mutant that does not apply where it says."""
    if text.count(mutant.find) != 1:
        raise ValueError(f"TODO {mutant.todo} mutant {mutant.what!r}: its code occurs {text.count(mutant.find)} times")
    at = text.index(mutant.find)
    start, end = regions(text).get(mutant.todo, (0, -1))
    if not start <= at < end:
        raise ValueError(f"TODO {mutant.todo} mutant {mutant.what!r}: its code is outside TODO {mutant.todo}")
    if mutant.find == mutant.replace:
        raise ValueError(f"TODO {mutant.todo} mutant {mutant.what!r}: changes nothing")
    return text.replace(mutant.find, mutant.replace)


def check(lesson: str, script_text: str, tests: str | None = None) -> tuple[dict[int, str], str, str]:
    """Run the lesson's tests on `script_text` as a learner's exercise: ({todo: status}, count line, output)."""
    return check_lessons({lesson: script_text}, tests)[lesson]


def check_lessons(scripts: dict[str, str], tests: str | None = None) -> dict[str, tuple[dict[int, str], str, str]]:
    """Run several lessons' tests, each on its learner's script, in one pytest session (one folder holds all the
    scripts: each has its own lesson's file name): {lesson: ({todo: status}, count line, output)}."""
    # As make check runs them (the Slurm jobs left out), in a folder directly under the course root: the scripts
    # find utils/ one level up, as in solutions/.
    with tempfile.TemporaryDirectory(prefix=".mutant-", dir=ROOT) as folder:
        for lesson, text in scripts.items():
            (Path(folder) / solution_of(lesson).name).write_text(text)
        test_files = sorted(str(path) for lesson in scripts for path in (ROOT / "tests").glob(f"test_{lesson}_*.py"))
        command = [sys.executable, "-m", "pytest", *test_files,
                   "--target-dir", folder, "-qq", "--tb=no", "-rN", "-o", "addopts=", "-p", "no:warnings",
                   "-p", "no:cacheprovider", "-m", "not slurm", *(["-k", tests] if tests else [])]  # fmt: skip
        env = {**os.environ, "COURSE_FIRST_LAUNCH_WARM": "1"}  # the TODOs under test, not torchrun
        output = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    # The report has one section a lesson, from its "Lesson NN: <script>" line to its "k of N TODOs done".
    sections = {part[7:9]: part for part in re.split(r"^(?=Lesson \d\d: )", output, flags=re.M)[1:]}
    results = {}
    for lesson in scripts:
        section = sections.get(lesson, "")
        lines = section.splitlines()
        statuses = {int(m.group(1)): m.group(3) for m in map(REPORT_LINE.match, lines) if m}
        count = next((line for line in lines if COUNT_LINE.match(line)), "(no report)")
        results[lesson] = (statuses, count, output if len(scripts) == 1 or not section else section)
    return results


def run_mutants(selected: list[str], todo: int | None, quick: bool) -> int:
    rows, survivors = [], 0
    for lesson in selected:
        solution = solution_of(lesson)
        text = solution.read_text()
        _, todos = make_exercise(text, solution.name)
        # A mutant must be killed (its TODO failing, no other blamed); a correct variant accepted (its TODO passing).
        checks = [(m, False) for m in mutants_of(lesson)] + [(v, True) for v in mutants_of(lesson, "VARIANTS")]
        for mutant, variant in checks:
            if todo is not None and mutant.todo != todo:
                continue
            started = time.monotonic()
            try:
                mutated = apply(mutant, text)
                learner = make_exercise(mutated, solution.name, done={t.number for t in todos})[0]
                # The verdict reads the TODOs' lines only: whole-script checks (not named after a TODO) need not run.
                statuses, _, output = check(lesson, learner, f"todo{mutant.todo}_ or todos_" if quick else "todo")
                own = statuses.get(mutant.todo, "no report:\n" + output[-1500:])
                blamed = [n for n, s in statuses.items() if n != mutant.todo and s.startswith("failing")]
                missing = [word for word in mutant.shows if word.lower() not in own.lower()]
                ok = (own == "passing" if variant else own.startswith("failing") and not missing) and not blamed
                seen = f"TODO {mutant.todo} {own}" + (f"; also blamed: TODO {blamed}" if blamed else "")
                seen += f"; the line lacks {missing}" if missing and not variant else ""
            except ValueError as error:
                ok, seen = False, f"does not apply: {error}"
            survivors += not ok
            verdict = ("accepted" if ok else "REJECTED") if variant else ("killed" if ok else "SURVIVED")
            rows.append((lesson, mutant.todo, mutant.what, verdict, variant, seen))
            print(f"{lesson}  TODO {mutant.todo:<2} {verdict:8s} {'(a correct variant) ' if variant else ''}"
                  f"{mutant.what}  ({time.monotonic() - started:.0f} s)\n      a learner sees: {seen[:300]}",
                  flush=True)  # fmt: skip
    mutants, variants = ([row for row in rows if row[4] == kind] for kind in (False, True))
    print(f"\n{sum(row[3] == 'killed' for row in mutants)} of {len(mutants)} mutants killed"
          + (f", {sum(row[3] == 'accepted' for row in variants)} of {len(variants)} correct variants accepted"
             if variants else ""))  # fmt: skip
    return 1 if survivors or not rows else 0


def run_partial_credit(selected: list[str]) -> int:
    """Complete each lesson's TODOs one at a time, in order: the count must rise by one each time."""
    failed = 0
    for lesson in selected:
        solution = solution_of(lesson)
        _, todos = make_exercise(solution.read_text(), solution.name)
        for k in range(len(todos) + 1):
            learner = make_exercise(solution.read_text(), solution.name, done={t.number for t in todos[:k]})[0]
            statuses, count, _ = check(lesson, learner)
            expected = f"{k} of {len(todos)} TODOs done"
            ok = count == expected
            failed += not ok
            print(f"{lesson}  TODOs 1-{k} done: {'ok' if ok else 'WRONG'}  report says {count!r}"
                  + ("" if ok else f"  {statuses}"), flush=True)  # fmt: skip
    return 1 if failed else 0


def share_warm_ranks():
    """One warm-ranks pool for every check this command runs (each check is a pytest session of its own, which
    would otherwise start one): its launches fork from a process that imported torch once."""
    from tests.harness.launch import warm_pool

    warm_pool(course_env())  # started, and its socket put in os.environ, which the checks inherit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", default=None, help="one lesson, e.g. 03 (default: all)")
    parser.add_argument("--todo", type=int, default=None, help="only this TODO's mutants")
    parser.add_argument("--quick", action="store_true", help="run only the mutant's own TODO's tests")
    parser.add_argument("--partial-credit", action="store_true", help="check partial credit instead of mutants")
    args = parser.parse_args()
    selected = [args.lesson] if args.lesson else lessons()
    share_warm_ranks()
    if args.partial_credit:
        return run_partial_credit(selected)
    return run_mutants(selected, args.todo, args.quick)


if __name__ == "__main__":
    sys.exit(main())
