"""Which TODO's code raised? A crash blamed where it happened, not on the check that was running.

A learner's mistake in TODO 1 may pass TODO 1's own cases and crash only when the whole script runs, under TODO 5's
check. The traceback says where: its innermost frame in a lesson script that lies inside a TODO's lines (from its
`# TODO n:` comment to the next TODO or the end of the block that holds it, as tests/harness/todo_report.py reads
a learner's copy). The blame is one line, which `make check` shows as that TODO's failure:

    TODO 1's code raised at exercises/10_mixture_of_experts.py:83: RuntimeError: The size of tensor a (7) must ...

Two sources: the output of a launched run (each rank's traceback, `[rank1]:`-prefixed under torchrun) and an
exception raised in the test's own process by a learner's function.
"""

import linecache
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from utils.course.make_exercises import TODO_HEADER

ROOT = Path(__file__).resolve().parents[2]
LESSON_FILE = re.compile(r"^\d\d_\w+\.py$")
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
RANK_PREFIX = re.compile(r"^\[(?:rank ?)?(\d+)\]: ?|^\[default(\d+)\]:")
BLAME_LINE = re.compile(r"TODO (\d+)'s code raised at (\S+?):(\d+)(?: \(`.*?`\))?: (.+)")
# A live lab rank's error (utils/course/lab.py's where_raised): "raised ValueError at exercises/07_...py:460 ..."
LAB_LINE = re.compile(r"raised (\w+) at (\S+?\.py):(\d+)(?: \(`.*?`\))?: (.+)")
# A rank that failed because another one died: not where the mistake is (the first error printed is the cause).
SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "DistBackendError")


@dataclass(frozen=True)
class Blame:
    todo: int
    path: Path
    line: int
    error: str  # "RuntimeError: The size of tensor a (7) must match ..."
    code: str = ""  # the learner's line that raised, as written: which call it was, without opening the file

    def __str__(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        code = self.code if len(self.code) <= 60 else self.code[:57] + "..."
        room = 240 - len(code)  # the whole line stays short enough for make check's one line per TODO
        error = self.error if len(self.error) <= room else self.error[: room - 3] + "..."
        at = f"{shown}:{self.line}" + (f" (`{code}`)" if code else "")
        return f"TODO {self.todo}'s code raised at {at}: {error}"


def todo_lines(text: str) -> dict[int, range]:
    """TODO number -> its line numbers (1-based) in a lesson script: its comment to the next TODO's, or to the end
    of the block that holds it (the first line indented less than the comment)."""
    found, current, indent, start = {}, None, 0, 0
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        header = TODO_HEADER.match(line)
        ends_block = current is not None and line.strip() and len(line) - len(line.lstrip()) < indent
        if current is not None and (header or ends_block):
            end = number
            while end - 1 > start and not lines[end - 2].strip():  # the blank lines after it are not its own
                end -= 1
            found[current], current = range(start, end), None
        if header:
            current, indent, start = int(header.group(2)), len(header.group(1)), number
    if current is not None:
        found[current] = range(start, len(lines) + 1)
    return found


_lines_cache: dict[tuple[Path, float], dict[int, range]] = {}


def todo_at(path: Path, line: int) -> int | None:
    """The TODO whose lines hold `line` of the lesson script at `path`, or None."""
    try:
        key = (path, path.stat().st_mtime)
    except OSError:
        return None
    if key not in _lines_cache:
        _lines_cache[key] = todo_lines(path.read_text())
    return next((todo for todo, lines in _lines_cache[key].items() if line in lines), None)


def _blame_frames(frames: list[tuple[str, int]], error: str, folders: set[Path]) -> Blame | None:
    """The innermost frame in a lesson script (in one of `folders`) that lies in a TODO's lines."""
    for filename, line in reversed(frames):
        path = Path(filename).resolve()
        if LESSON_FILE.match(path.name) and path.parent in folders:
            todo = todo_at(path, line)
            if todo is not None:
                return Blame(todo, path, line, error, linecache.getline(str(path), line).strip())
    return None


def tracebacks(output: str) -> list[tuple[list[tuple[str, int]], str]]:
    """Each traceback in a run's output, per rank: ([(file, line), ...], "ExceptionType: message")."""
    per_rank: dict[str, list[str]] = {}
    for raw in output.splitlines():
        prefix = RANK_PREFIX.match(raw)
        rank = (prefix.group(1) or prefix.group(2)) if prefix else "-"
        per_rank.setdefault(rank, []).append(raw[prefix.end() :] if prefix else raw)
    found = []
    for lines in per_rank.values():
        frames, inside = [], False
        for line in lines:
            if line.startswith("Traceback (most recent call last):"):
                frames, inside = [], True
            elif inside and (frame := FRAME.match(line)):
                frames.append((frame.group(1), int(frame.group(2))))
            elif inside and line and not line[0].isspace() and frames:  # the exception's own line ends it
                found.append((frames, line.strip()))
                inside = False
    return found


def blame_output(output: str, script) -> Blame | None:
    """The TODO whose code raised in a run of `script` (its folder's lesson scripts count too: lesson 06 runs
    lessons 04 and 05's), from the first traceback that is not a rank losing its peers."""
    folders = {Path(script).resolve().parent}
    blames = [(b, error) for frames, error in tracebacks(output) if (b := _blame_frames(frames, error, folders))]
    first = [b for b, error in blames if not any(sign in error for sign in SECONDARY)]
    return (first or [b for b, _ in blames] or [None])[0]


def blame_exception(error: BaseException, folder: Path | None = None) -> Blame | None:
    """The TODO whose code raised `error` in this process (a learner's function called by a test), looking through
    the exceptions it was raised from or while handling (a check may turn the learner's error into its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = [(frame.filename, frame.lineno) for frame in traceback.extract_tb(error.__traceback__)]
        folders = {Path(folder).resolve()} if folder else {Path(name).resolve().parent for name, _ in frames}
        text = (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0]
        found = _blame_frames(frames, text, folders)
        if found:
            return found
        error = error.__cause__ or error.__context__
    return None


def blame_in(text: str, lesson: str | None = None) -> tuple[int, str] | None:
    """(TODO, its one-line blame) where a failure's text carries a blame line (for `lesson`'s own script only, when
    given: lesson 06 runs lesson 04's and 05's scripts too, whose TODOs are theirs)."""
    for match in BLAME_LINE.finditer(text):
        if lesson is None or Path(match.group(2)).name.startswith(f"{lesson}_"):
            return int(match.group(1)), match.group(0)
    return None


def blame_lab(text: str, lesson: str, folder: Path) -> Blame | None:
    """The TODO whose lines raised in a live lab's failure text (a rank's error names the lesson script's line), or
    None: a lab calls one TODO's function, which may call another TODO's code. Only the learner's script in `folder`
    counts (a lab also runs the solution's code, whose TODOs are not the learner's)."""
    for match in LAB_LINE.finditer(text):
        path = (ROOT / match.group(2)).resolve()  # a path relative to the course root, or an absolute one
        if path.name.startswith(f"{lesson}_"):
            error = f"{match.group(1)}: {match.group(4).split('. Hint: ')[0]}"
            if blame := _blame_frames([(str(path), int(match.group(3)))], error, {Path(folder).resolve()}):
                return blame
    return None


def describe(error: BaseException, what: str = "") -> str:
    """One line for a worker's report: the blame when a TODO's code raised `error` ("TODO 3's code raised at ..."),
    else `what` raised it, its type and message, and the innermost frame."""
    blame = blame_exception(error)
    if blame:
        return str(blame)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{what + ' raised ' if what else ''}{type(error).__name__}: {message}{where}"
