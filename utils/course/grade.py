"""`make grade DIR=submissions/`: every participant's exercises checked against the tests, one table for the class.

A submissions folder holds one folder per participant, each with their exercise files named as in exercises/
(submissions/alice/06_3d_parallelism.py; any lessons, any subset). For each participant, the course is copied
into a temporary folder of its own and their files replace the exercises there; each lesson is then checked as
`make check` checks it (its tests on the learner's copy, the Slurm jobs left out), in that copy, under a time
limit. A participant's code runs only inside their copy: a hang is stopped at the limit (the whole process group),
a crash ends their lesson's check, and neither stops the others.

    python -m utils.course.grade submissions/                 # the table, and submissions/grades.csv
    python -m utils.course.grade submissions/ --timeout 300 --csv out.csv

The table has a row per participant and a column per lesson: "k/N" TODOs done, then the failing TODOs
("3/8 x4,5": TODOs 4 and 5 failing; the others not started), "time-out" or "error" when the check did not end.
"""

import argparse
import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a copy of the course leaves out: environments, history, what runs write, caches.
NOT_COPIED = {".git", ".venv", ".venv-floor", "runs", "checkpoints", "metrics", "data", "wandb", "__pycache__",
              ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".cache"}  # fmt: skip
REPORT_LINE = re.compile(
    r"^\s+TODO (\d+)\s+.*? \.+ (passing|not started|not checked yet.*|failing.*|no test selected)$"
)
COUNT_LINE = re.compile(r"^(\d+) of (\d+) TODOs done$")


@dataclass
class Result:
    participant: str
    lesson: str
    done: int = 0
    total: int = 0
    failing: list = field(default_factory=list)
    not_started: list = field(default_factory=list)
    problem: str = ""  # "time-out" or "error: ..." when the check did not report

    def cell(self) -> str:
        if self.problem:
            return self.problem.split(":")[0]
        return f"{self.done}/{self.total}" + (f" x{','.join(map(str, self.failing))}" if self.failing else "")


def exercise_names(root: Path = ROOT) -> dict[str, str]:
    """File name -> lesson number, for every exercise."""
    return {path.name: path.name[:2] for path in sorted((root / "exercises").glob("[0-9][0-9]_*.py"))}


def copy_course(destination: Path, root: Path = ROOT, leave_out: Path | None = None) -> Path:
    """A copy of the course to run one participant's code in (the submissions folder itself left out)."""

    def ignore(folder, names):
        skipped = {n for n in names if n in NOT_COPIED or n.startswith(".mutant-")}
        if leave_out is not None:
            skipped |= {n for n in names if (Path(folder) / n).resolve() == leave_out.resolve()}
        return skipped

    shutil.copytree(root, destination, ignore=ignore, symlinks=True)
    return destination


def check_lesson(copy: Path, participant: str, lesson: str, timeout: float) -> Result:
    """Run one lesson's tests on the participant's exercise in their copy, as `make check` does."""
    result = Result(participant, lesson)
    command = [sys.executable, "-m", "pytest", *sorted(str(p) for p in (copy / "tests").glob(f"test_{lesson}_*.py")),
               "--target", "exercises", "-qq", "--tb=no", "-rN", "-o", "addopts=", "-p", "no:warnings",
               "-p", "no:cacheprovider", "-m", "not slurm"]  # fmt: skip
    env = {**os.environ, "COURSE_FIRST_LAUNCH_WARM": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1"}
    # A session of its own: at the time limit the whole process group goes (pytest, torchrun, every rank).
    process = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        result.problem = f"time-out: stopped after {timeout:.0f} s"
        return result
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    for line in output.splitlines():
        if match := REPORT_LINE.match(line):
            number, status = int(match.group(1)), match.group(2)
            if status.startswith("failing"):
                result.failing.append(number)
            elif status == "not started":
                result.not_started.append(number)
        elif match := COUNT_LINE.match(line):
            result.done, result.total = int(match.group(1)), int(match.group(2))
    if not result.total:
        last = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["no output"]
        result.problem = f"error: the check gave no report ({last[0][:120]})"
    return result


def grade_participant(folder: Path, submissions: Path, timeout: float, root: Path = ROOT) -> list[Result]:
    names = exercise_names(root)
    files = sorted(p for p in folder.glob("*.py") if p.name in names)
    if not files:
        return []
    with tempfile.TemporaryDirectory(prefix=f"grade-{folder.name}-") as temporary:
        copy = copy_course(Path(temporary) / "course", root, leave_out=submissions)
        for path in files:
            shutil.copyfile(path, copy / "exercises" / path.name)
        return [check_lesson(copy, folder.name, names[path.name], timeout) for path in files]


def table(results: list[Result]) -> str:
    lessons = sorted({r.lesson for r in results})
    participants = sorted({r.participant for r in results})
    cells = {(r.participant, r.lesson): r.cell() for r in results}
    widths = [max(len("participant"), *(len(p) for p in participants))] + [
        max(len(lesson), *(len(cells.get((p, lesson), "-")) for p in participants)) for lesson in lessons
    ]
    rows = [["participant", *lessons]] + [
        [p, *(cells.get((p, lesson), "-") for lesson in lessons)] for p in participants
    ]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows)


def write_csv(results: list[Result], path: Path):
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["participant", "lesson", "todos_done", "todos", "failing", "not_started", "problem"])
        for r in sorted(results, key=lambda r: (r.participant, r.lesson)):
            writer.writerow([r.participant, r.lesson, r.done, r.total, " ".join(map(str, r.failing)),
                             " ".join(map(str, r.not_started)), r.problem])  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submissions", type=Path, help="a folder with one folder per participant")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one participant's lesson")
    parser.add_argument("--csv", type=Path, help="where the CSV goes (default: SUBMISSIONS/grades.csv)")
    args = parser.parse_args(argv)
    if not args.submissions.is_dir():
        print(f"grade: {args.submissions} is not a folder; give the folder that holds one folder per participant")
        return 2
    participants = sorted(p for p in args.submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not participants:
        print(
            f"grade: {args.submissions} holds no participant's folder (e.g. {args.submissions}/alice/01_collectives.py)"
        )
        return 2
    results = []
    for folder in participants:
        print(f"grading {folder.name} ...", flush=True)
        mine = grade_participant(folder, args.submissions, args.timeout)
        if not mine:
            print(f"  {folder.name}: no file named as an exercise (e.g. 01_collectives.py): nothing to grade")
        results += mine
    print()
    print(table(results) if results else "nothing graded")
    path = args.csv or args.submissions / "grades.csv"
    write_csv(results, path)
    print(f"\nk/N: TODOs done of the lesson's; xA,B: TODOs failing (the others not started). CSV: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
