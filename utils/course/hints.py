"""`make hint LESSON=06 TODO=5`: the next hint for one TODO, asked for one level at a time.

Each TODO has three hints, written beside it in its solution (utils/course/make_exercises.py keeps them out of
the exercise): the first gives the idea and a question to ask yourself, the second the steps, the third nearly
the code. Asking again shows the next level; the levels seen are kept in runs/hints_seen.json, so that `make check`
can say which one you have read.

    python -m utils.course.hints 06 5            # the next hint of lesson 06's TODO 5
    python -m utils.course.hints 06 5 --level 1  # that level again
    python -m utils.course.hints --reset         # forget which hints were seen
"""

import argparse
import json
import sys
import textwrap
from pathlib import Path

from utils.course.make_exercises import HINT_LEVELS, make_exercise

ROOT = Path(__file__).resolve().parents[2]
SEEN = ROOT / "runs" / "hints_seen.json"


def todos(lesson: str, root: Path = ROOT) -> dict:
    """TODO number -> its Todo (title, hints) for a lesson, read from the text of its solution."""
    solutions = sorted((root / "solutions").glob(f"{lesson}_*.py"))
    if not solutions:
        known = ", ".join(sorted(p.name[:2] for p in (root / "solutions").glob("[0-9][0-9]_*.py")))
        raise SystemExit(f"no lesson {lesson!r}: the lessons are {known}")
    return {todo.number: todo for todo in make_exercise(solutions[0].read_text(), solutions[0].name)[1]}


def seen(lesson: str, number: int, path: Path = SEEN) -> int:
    """How many of a TODO's hints were shown (0 to 3)."""
    record = json.loads(path.read_text()) if path.exists() else {}
    return record.get(f"{lesson}/{number}", 0)


def mark_seen(lesson: str, number: int, level: int, path: Path = SEEN):
    record = json.loads(path.read_text()) if path.exists() else {}
    record[f"{lesson}/{number}"] = max(level, record.get(f"{lesson}/{number}", 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def hint_text(lesson: str, number: int, level: int | None = None, root: Path = ROOT, path: Path = SEEN) -> str:
    """The hint to show (the next one unless `level` is given), recording that it was seen."""
    known = todos(lesson, root)
    if number not in known:
        raise SystemExit(f"lesson {lesson} has TODOs 1 to {max(known)}; there is no TODO {number}")
    todo = known[number]
    if not todo.hints:
        return f"Lesson {lesson}, TODO {number} ({todo.title}) has no hints: its comment and the notebook say it all."
    level = level or min(seen(lesson, number, path) + 1, HINT_LEVELS)
    if not 1 <= level <= HINT_LEVELS:
        raise SystemExit(f"a hint's level is 1, 2 or 3, not {level}")
    mark_seen(lesson, number, level, path)
    names = {1: "the idea", 2: "the steps", 3: "nearly the code"}
    more = (
        f"Stuck still? `make hint LESSON={lesson} TODO={number}` again gives hint {level + 1} ({names[level + 1]})."
        if level < HINT_LEVELS
        else "That was the last hint. The notebook's section on this TODO, and `make check`, say the rest."
    )
    return f"Lesson {lesson}, TODO {number} ({todo.title}), hint {level} of {HINT_LEVELS}, {names[level]}:\n\n" + (
        textwrap.fill(todo.hints[level - 1], width=100, initial_indent="    ", subsequent_indent="    ") + f"\n\n{more}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lesson", nargs="?", help="the lesson's number, e.g. 06")
    parser.add_argument("todo", nargs="?", type=int, help="the TODO's number")
    parser.add_argument("--level", type=int, help="show this level (1 to 3) instead of the next")
    parser.add_argument("--reset", action="store_true", help="forget which hints were seen")
    args = parser.parse_args()
    if args.reset:
        SEEN.unlink(missing_ok=True)
        print("hints: none seen")
        return 0
    if args.lesson is None or args.todo is None:
        print("name the TODO: make hint LESSON=06 TODO=5", file=sys.stderr)
        return 2
    print(hint_text(args.lesson.zfill(2), args.todo, args.level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
