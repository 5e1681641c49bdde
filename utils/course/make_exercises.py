"""Write exercises/NN_topic.py from solutions/NN_topic.py: the solution is the single source.

In a solution, each TODO is a comment that names and explains it, followed by the solution code
between two marker lines:

    # TODO 1: reduce-scatter phase of the ring. After n - 1 steps, rank r holds the sum of chunk r+1.
    #   (more comment lines may follow)
    # BEGIN SOLUTION
    ...the code the learner writes...
    # END SOLUTION

Hints, given on demand by `make hint LESSON=NN TODO=n` (utils/course/hints.py), follow the TODO comment in three
levels, each a comment block of its own; the exercise leaves them out:

    # TODO 1: ...the goal, in about 35 words at most...
    # HINT 1: the idea, a question to ask yourself
    # HINT 2: the steps
    #   (more lines of a hint are indented like this)
    # HINT 3: nearly the code
    # BEGIN SOLUTION

The exercise's own commands (`torchrun ... solutions/NN_topic.py` in its docstring and messages) name
exercises/NN_topic.py instead. The exercise keeps the TODO comment and replaces the code with
`raise NotImplementedError("TODO 1: reduce-scatter phase of the ring")`, so an untouched exercise
stops at once with a message that names the TODO. Where the exercise should instead run as the
pre-lesson code, put that code, commented out, after a `# EXERCISE` line inside the region:

    # BEGIN SOLUTION
    model = DistributedDataParallel(model)
    # EXERCISE
    # model = model  (the exercise gets these lines without their leading "# ")
    # END SOLUTION

    python -m utils.course.make_exercises           # write every exercise
    python -m utils.course.make_exercises --lesson 03  # one lesson's exercise only
    python -m utils.course.make_exercises --check   # exit 1 if an exercise is stale (what the tests run)
"""

import argparse
import difflib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TODO_HEADER = re.compile(r"^(\s*)# TODO (\d+): (.+)$")
HINT_HEADER = re.compile(r"^\s*# HINT (\d+): (.+)$")
HINT_LEVELS = 3
BEGIN, EXERCISE, END = "# BEGIN SOLUTION", "# EXERCISE", "# END SOLUTION"
GENERATED_NOTE = (
    "# Exercise for lesson {lesson}: complete the numbered TODOs. (This file is generated from\n"
    "# solutions/{name} by `python -m utils.course.make_exercises`;\n"
    "# course maintainers edit the solution.)\n"
)


class MarkerError(ValueError):
    pass


@dataclass
class Todo:
    number: int
    title: str
    line: int  # 1-based line of the TODO header in the solution
    comment: list = field(default_factory=list)  # the comment the exercise shows, without its "# "
    hints: list = field(default_factory=list)  # the hints' texts, level 1 first
    code: list = field(default_factory=list)  # the solution's lines between the markers (not the EXERCISE part)

    @property
    def is_lab(self) -> bool:
        """A debugging lab's TODO ("TODO 4: lab, ..."): its comment describes the bug, at more length."""
        return self.title.startswith("lab")


def _title(text: str) -> str:
    """The TODO's short name: its first sentence, without the trailing full stop."""
    return re.split(r"(?<=[a-z0-9)`])\. ", text.strip(), maxsplit=1)[0].rstrip(".")


def make_exercise(solution_text: str, name: str, done=frozenset()) -> tuple[str, list[Todo]]:
    """Return the exercise text for a solution and the TODOs it found, checking the markers.

    `done`: TODO numbers to keep solved (their solution code, without markers), as a learner who finished
    them would have the file; `make mutants` uses it for partial credit and for mutated solutions.
    """
    lines = solution_text.splitlines()
    out, todos = [], []
    header = None  # the most recent TODO header not yet followed by its region
    i = 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        match = TODO_HEADER.match(line)
        if match:
            if header is not None:
                raise MarkerError(f"{name}:{header.line}: TODO {header.number} has no {BEGIN} region")
            header = Todo(int(match.group(2)), _title(match.group(3)), i + 1, comment=[match.group(3).strip()])
            out.append(line)
            hint = None  # the hint being read: its comment lines are kept out of the exercise
        elif header is not None and (hint_match := HINT_HEADER.match(line)):
            if int(hint_match.group(1)) != len(header.hints) + 1:
                raise MarkerError(f"{name}:{i + 1}: TODO {header.number}'s hints must be numbered 1, 2, 3 in order")
            header.hints.append(hint_match.group(2).strip())
            hint = header.hints
        elif header is not None and hint is not None and stripped.startswith("#") and stripped != BEGIN:
            hint[-1] += " " + stripped.lstrip("#").strip()
        elif stripped == BEGIN:
            if header is None:
                raise MarkerError(f"{name}:{i + 1}: {BEGIN} without a '# TODO n: ...' comment above it")
            indent = line[: len(line) - len(line.lstrip())]
            region, exercise_lines, in_exercise = [], [], False
            i += 1
            while i < len(lines) and lines[i].strip() != END:
                if lines[i].strip() == EXERCISE:
                    in_exercise = True
                elif lines[i].strip() in (BEGIN,) or TODO_HEADER.match(lines[i]):
                    raise MarkerError(f"{name}:{i + 1}: TODO {header.number}'s region is not closed by {END}")
                elif in_exercise:
                    exercise_lines.append(re.sub(r"^(\s*)# ?", r"\1", lines[i], count=1))
                else:
                    region.append(lines[i])
                i += 1
            header.code = region
            if i == len(lines):
                raise MarkerError(f"{name}:{header.line}: TODO {header.number}'s region has no {END}")
            if header.number in done:
                out.extend(region)
            elif in_exercise:
                out.extend(exercise_lines)
            else:
                out.append(f'{indent}raise NotImplementedError("TODO {header.number}: {header.title}")')
            if header.hints and len(header.hints) != HINT_LEVELS:
                raise MarkerError(f"{name}:{header.line}: TODO {header.number} has {len(header.hints)} hints, not 3")
            todos.append(header)
            header = None
        elif stripped in (EXERCISE, END):
            raise MarkerError(f"{name}:{i + 1}: {stripped} outside a solution region")
        else:
            if header is not None and not stripped.startswith("#"):
                raise MarkerError(f"{name}:{header.line}: TODO {header.number} is not followed by {BEGIN}")
            if header is not None:
                header.comment.append(stripped.lstrip("#").strip())
            out.append(line)
        i += 1
    if header is not None:
        raise MarkerError(f"{name}:{header.line}: TODO {header.number} has no {BEGIN} region")
    numbers = [t.number for t in todos]
    if numbers != list(range(1, len(numbers) + 1)):
        raise MarkerError(f"{name}: TODOs must be numbered 1, 2, 3, ... in order; found {numbers}")
    # The commands the exercise's docstring and messages give run the exercise, the file the learner edits.
    body = "\n".join(out).replace(f"solutions/{name}", f"exercises/{name}")
    return GENERATED_NOTE.format(lesson=name[:2], name=name) + body + "\n", todos


def handed_out(name: str, folder: Path) -> Path:
    """The exercise `name` (e.g. "07_communication_efficient.py") as handed out, generated afresh from its solution
    and written into `folder` (made if missing), whatever a learner did to theirs: its path."""
    folder.mkdir(parents=True, exist_ok=True)
    exercise = folder / name
    exercise.write_text(make_exercise((ROOT / "solutions" / name).read_text(), name)[0])
    return exercise


def expected_exercises(root: Path = ROOT, lesson: str = "[0-9][0-9]") -> dict[Path, str]:
    """Map each exercise path (of one lesson, e.g. lesson="03", or all) to the text its solution generates."""
    return {
        root / "exercises" / solution.name: make_exercise(solution.read_text(), solution.name)[0]
        for solution in sorted((root / "solutions").glob(f"{lesson}_*.py"))
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that exercises/ is up to date")
    parser.add_argument("--lesson", default="[0-9][0-9]", help="only this lesson's exercise, e.g. 03")
    args = parser.parse_args()
    try:
        expected = expected_exercises(lesson=args.lesson)
    except MarkerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    stale = []
    for path, text in expected.items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if args.check:
            stale.append(path)
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(path), "generated", lineterm="")
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(
            f"error: {names} differ from what solutions/ generates. Maintainers: run "
            "`python -m utils.course.make_exercises`. (A learner's completed exercise differs on purpose.)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
