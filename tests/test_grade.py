"""`make grade DIR=...` on a class of three: one complete, one partial, one whose code hangs (utils/course/grade.py)."""

import csv
import subprocess
import sys

import psutil

from utils.course import grade
from utils.course.make_exercises import make_exercise

ROOT = grade.ROOT
LESSON_00 = "00_setup_and_baseline.py"
HANG = "from pathlib import Path\nPath('written_by_carol.txt').write_text('here')\nimport time\ntime.sleep(10**6)\n"


def test_a_class_of_three_in_one_table(tmp_path):
    submissions = tmp_path / "submissions"
    solution = (ROOT / "solutions" / LESSON_00).read_text()
    for name, files in {
        "alice": {LESSON_00: solution},  # every TODO done
        "bob": {LESSON_00: make_exercise(solution, LESSON_00, done={1})[0], "notes.txt": "not an exercise"},
        "carol": {LESSON_00: HANG, "01_collectives.py": (ROOT / "exercises" / "01_collectives.py").read_text()},
    }.items():
        (submissions / name).mkdir(parents=True)
        for file, text in files.items():
            (submissions / name / file).write_text(text)
    output = subprocess.run([sys.executable, "-m", "utils.course.grade", str(submissions), "--timeout", "45"],
                            cwd=ROOT, capture_output=True, text=True, timeout=400).stdout  # fmt: skip
    rows = {row["participant"] + "/" + row["lesson"]: row for row in csv.DictReader(open(submissions / "grades.csv"))}
    assert set(rows) == {"alice/00", "bob/00", "carol/00", "carol/01"}, output
    assert (rows["alice/00"]["todos_done"], rows["alice/00"]["todos"], rows["alice/00"]["problem"]) == ("3", "3", "")
    assert (rows["bob/00"]["todos_done"], rows["bob/00"]["not_started"]) == ("1", "2 3"), output
    assert rows["carol/00"]["problem"].startswith("time-out"), output
    assert (rows["carol/01"]["todos_done"], rows["carol/01"]["todos"]) == ("0", "8"), output  # after carol's hang
    table = output[output.index("participant") :].splitlines()
    assert table[1].split() == ["alice", "3/3", "-"] and table[2].split() == ["bob", "1/3", "-"], output
    assert table[3].split() == ["carol", "time-out", "0/8"], output
    # Carol's code ran in her copy only, and nothing of hers is left running.
    assert not (ROOT / "written_by_carol.txt").exists() and not list(submissions.rglob("written_by_carol.txt"))
    assert "grade-carol" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    # Her check's ranks were forked by warm ranks (a session of their own, not her process group): they stop too.
    assert not [p.pid for p in psutil.process_iter() if "grade-carol" in cwd_of(p)], "carol's ranks still run"


def cwd_of(process) -> str:
    try:
        return process.cwd()
    except (psutil.Error, OSError):
        return ""


def test_a_folder_without_participants_is_refused_in_one_line(tmp_path):
    assert grade.main([str(tmp_path / "missing")]) == 2
    assert grade.main([str(tmp_path)]) == 2
