"""Run a course script the way a learner does (`torchrun --nproc_per_node=N script.py ...`) from a test.

Every launch has a timeout: a hung collective fails the test with the script's output instead of
hanging the suite. The script's metrics JSON (--metrics-out) comes back as a dict.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from utils.notebook import kill_tree

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    command: list
    returncode: int
    output: str  # stdout and stderr together, as a learner sees them
    metrics: dict | None

    def tail(self, lines: int = 40) -> str:
        """The output's last lines, without torchrun's own traceback (the ranks' errors come before it)."""
        kept = self.output.splitlines()
        if "Traceback (most recent call last):" in kept:  # unprefixed: the launcher's, not a rank's
            kept = kept[: kept.index("Traceback (most recent call last):")]
        return "\n".join(kept[-lines:])

    def check(self) -> "Run":
        """Fail with the command and the output's tail unless the run succeeded."""
        assert self.returncode == 0, (
            f"`{' '.join(map(str, self.command))}` exited {self.returncode}. Its last lines:\n{self.tail()}"
        )
        return self


def finished(result: Run, todo: int) -> dict:
    """The run's metrics, or a failure naming the TODO the run stopped at (else `todo`): what a learner's
    `make check` line shows when a lesson run fails."""
    stopped = re.search(r"TODO (\d+):", result.output)
    name = f"TODO {stopped.group(1)}" if stopped else f"checking TODO {todo}"
    assert result.returncode == 0, f"{name}: the run failed. Its last lines:\n{result.tail()}"
    return result.metrics


def course_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",  # one thread per process: 2 cores shared by up to 8 ranks
        PYTHONUNBUFFERED="1",
        COURSE_TIMEOUT_S=env.get("COURSE_TIMEOUT_S", "60"),
        WANDB_MODE="offline",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(script, nproc: int, args=(), *, tmp_path=None, timeout: float = 180, env=None, max_restarts: int = 0,
             python=sys.executable) -> Run:  # fmt: skip
    """Launch `script` with `nproc` processes on this machine; pass --metrics-out if tmp_path is given.
    max_restarts: torchrun restarts the workers that many times after a failure. python: another environment's."""
    command = [
        str(python), "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={nproc}", *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        str(script), *map(str, args),
    ]  # fmt: skip
    return _run(command, timeout, env or course_env(), _metrics_path(command, script, tmp_path, str(nproc)))


def python(script, args=(), *, tmp_path=None, timeout: float = 120, env=None) -> Run:
    """Run `script` as a plain `python script.py` (a world of one, no torchrun)."""
    command = [sys.executable, str(script), *map(str, args)]
    return _run(command, timeout, env or course_env(), _metrics_path(command, script, tmp_path, "python"))


def _metrics_path(command: list, script, tmp_path, tag: str) -> Path | None:
    """Add `--metrics-out` to `command` (a fresh file in tmp_path) when tmp_path is given."""
    if tmp_path is None:
        return None
    path = Path(tmp_path) / f"metrics-{Path(script).stem}-{tag}.json"
    path.unlink(missing_ok=True)  # a stale file from an earlier run must not pass for this run's
    command += ["--metrics-out", str(path)]
    return path


def _run(command, timeout, env, metrics_path) -> Run:
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        try:  # a rank that escaped the kill may still hold the pipe open: don't wait for it forever
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            output = "(no output: the processes did not exit after being killed)"
        tail = "\n".join(output.splitlines()[-40:])
        raise AssertionError(
            f"`{' '.join(command)}` did not finish within {timeout} s. Its last lines:\n{tail}"
        ) from None
    metrics = None
    if metrics_path is not None and process.returncode == 0 and metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
    return Run(command, process.returncode, output, metrics)
