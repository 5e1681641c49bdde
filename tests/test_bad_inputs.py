"""Bad input never hangs and never ends in a bare traceback: every lesson script stops within a minute,
with a non-zero exit code and one line that names the cause (and the fix).

The shared command line (utils.training.parse_args) is checked in-process below; each lesson script is
then launched with a few bad inputs to prove it goes through those checks, and that its data loop refuses
sizes that would leave a rank without a batch (which used to loop forever). All launches of the table run
side by side, once, and the tests read their results.
"""

import argparse
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.launch import ROOT, python
from utils.training import base_parser, parse_args

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))
LIMIT_S = 60


def uses_shared_command_line(script) -> bool:
    return "base_parser(" in script.read_text()


# (name, arguments, text the one-line message must contain) for the scripts on the shared command line
TRAINING_SCRIPT_ROWS = [
    ("zero-steps", ["--steps", "0"], "argument --steps: must be at least 1"),
    ("batch-larger-than-the-data", ["--steps", "1", "--batch-size", "100000"], "--batch-size 100000 is too large"),
    ("sequence-longer-than-the-data", ["--steps", "1", "--seq-len", "10000000"], "--seq-len"),
]
OTHER_SCRIPT_ROWS = [("zero-steps", ["--steps", "0"], "argument --steps")]


def table():
    for script in SOLUTIONS:
        for name, args, expected in TRAINING_SCRIPT_ROWS if uses_shared_command_line(script) else OTHER_SCRIPT_ROWS:
            yield pytest.param(script, args, expected, id=f"{script.stem}-{name}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every row of the table, launched once, four at a time: {(script, args): Run}."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    rows = [param.values for param in table()]

    def launch(row):
        script, args, _ = row
        return (script, tuple(args)), python(script, [*args, "--log-dir", tmp / "runs"], timeout=LIMIT_S)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(launch, rows))


@pytest.mark.parametrize("script, args, expected", list(table()))
def test_lesson_script_refuses_bad_input_with_one_line(launched, script, args, expected):
    run = launched[(script, tuple(args))]  # a hang would already have failed: the launch has a timeout
    assert run.returncode != 0, f"{script.name} {' '.join(args)} should fail, but exited 0:\n{run.tail()}"
    assert "Traceback" not in run.output, f"{script.name} {' '.join(args)} ended in a traceback:\n{run.tail()}"
    assert expected in run.output, (
        f"{script.name} {' '.join(args)}: the message should name {expected!r}:\n{run.tail()}"
    )


# The shared command line, in-process: each mistake is one line that names the option and a valid value.
SHARED_ROWS = {
    "steps-zero": (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    "batch-negative": (["--batch-size", "-4"], "argument --batch-size: must be at least 1, got -4"),
    "batch-not-a-number": (["--batch-size", "four"], "argument --batch-size: expected a whole number >= 1"),
    "lr-negative": (["--lr", "-1"], "argument --lr: must be 0 or more"),
    "lr-nan": (["--lr", "nan"], "argument --lr: must be 0 or more"),
    "heads-do-not-divide-width": (["--dim", "64", "--n-heads", "3"], "choose --n-heads from 1, 2, 4, 8"),
    "metrics-in-proc": (["--metrics-out", "/proc/course/metrics.json"], "argument --metrics-out: cannot write"),
    "log-dir-is-a-file": (["--log-dir", "/etc/hostname"], "argument --log-dir: cannot write /etc/hostname"),
    "checkpoint-is-a-folder": (["--checkpoint", "/tmp"], "argument --checkpoint: cannot write /tmp"),
    "unknown-dataset": (["--dataset", "imagenet"], "argument --dataset: invalid choice"),
}


@pytest.mark.parametrize("name", SHARED_ROWS)
def test_shared_command_line_names_the_option(name, capsys):
    args, expected = SHARED_ROWS[name]
    with pytest.raises(SystemExit) as stopped:
        parse_args(base_parser("test"), args)
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert len(message.strip().splitlines()) == 1, f"one line, not a usage block:\n{message}"
    assert expected in message, message


def test_shared_command_line_accepts_good_values(tmp_path):
    args = parse_args(base_parser("test"), ["--steps", "3", "--metrics-out", str(tmp_path / "new" / "m.json")])
    assert isinstance(args, argparse.Namespace) and args.steps == 3
    assert re.fullmatch(r"\d+", str(args.batch_size))
