"""How much of its code each TODO comment gives away, and how long it is.

For every TODO of a solution: the identifiers of the code between its markers (keywords, `self` and one-letter
names left out), less those the learner already has (the enclosing function's name, parameters and docstring, and
the lesson's COMMENT_MAY_NAME in tests/mutants/lesson_NN.py: the APIs its notebook introduces); the share of
those that the comment the exercise shows names; and the comment's words. tests/test_todo_comments.py holds
every lesson to MAX_SHARE per TODO and MAX_MEAN_WORDS on average over its TODOs (a lab's comment, which
describes its bug, is not counted in the words).

    python -m tests.harness.todo_comments          # every lesson, a line per TODO
    python -m tests.harness.todo_comments 06       # one lesson
"""

import ast
import importlib
import io
import keyword
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from utils.course.make_exercises import make_exercise

ROOT = Path(__file__).resolve().parents[2]
MAX_SHARE = 0.30
MAX_MEAN_WORDS = 40


@dataclass
class Measure:
    lesson: str
    number: int
    title: str
    words: int
    named: list  # the code's own identifiers the comment names
    counted: list  # every identifier of the code the comment could have named
    is_lab: bool
    hints: int

    @property
    def share(self) -> float:
        return len(self.named) / len(self.counted) if self.counted else 0.0


def code_names(lines: list[str]) -> set[str]:
    """The identifiers in some lines of Python (attribute names included), without keywords."""
    text = "\n".join(line.strip() for line in lines) + "\n"
    names = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NAME:
                names.add(token.string)
    except (tokenize.TokenError, IndentationError):
        names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return {n for n in names if not keyword.iskeyword(n) and n != "self" and len(n) > 1}


def given_names(source: str, line: int) -> set[str]:
    """Names the learner has before reading the comment: the innermost function around `line` (its name,
    parameters, and the identifiers its docstring uses)."""
    given = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= node.end_lineno:
            arguments = node.args
            given |= {node.name} | {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
            given |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a}
            given |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", ast.get_docstring(node) or ""))
    return given


def allowed_names(lesson: str) -> set[str]:
    """The lesson's COMMENT_MAY_NAME: names its comments may use freely (each with the reason, in the file)."""
    module = importlib.import_module(f"tests.mutants.lesson_{lesson}")
    return set(getattr(module, "COMMENT_MAY_NAME", {}))


def measure(lesson: str) -> list[Measure]:
    solution = next((ROOT / "solutions").glob(f"{lesson}_*.py"))
    source = solution.read_text()
    allowed = allowed_names(lesson)
    measures = []
    for todo in make_exercise(source, solution.name)[1]:
        comment = " ".join(todo.comment)
        counted = sorted(code_names(todo.code) - given_names(source, todo.line) - allowed)
        named = [n for n in counted if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", comment)]
        words = len(re.findall(r"\S+", comment))
        measures.append(Measure(lesson, todo.number, todo.title, words, named, counted, todo.is_lab, len(todo.hints)))
    return measures


def mean_words(measures: list[Measure]) -> float:
    counted = [m.words for m in measures if not m.is_lab]
    return sum(counted) / len(counted) if counted else 0.0


def lessons() -> list[str]:
    return sorted(path.name[:2] for path in (ROOT / "solutions").glob("[0-9][0-9]_*.py"))


def main() -> int:
    chosen = sys.argv[1:] or lessons()
    worst = 0
    for lesson in chosen:
        measures = measure(lesson)
        print(f"lesson {lesson}: {mean_words(measures):.0f} words on average (at most {MAX_MEAN_WORDS}, labs apart)")
        for m in measures:
            flag = " <- over" if m.share > MAX_SHARE else ""
            worst = max(worst, m.share > MAX_SHARE or (mean_words(measures) > MAX_MEAN_WORDS))
            print(f"  TODO {m.number} ({'lab, ' if m.is_lab else ''}{m.words} words, {m.hints} hints): "
                  f"names {len(m.named)} of {len(m.counted)} ({m.share:.0%}){flag} {m.named}")  # fmt: skip
    return int(worst)


if __name__ == "__main__":
    sys.exit(main())
