"""Run a course script the way a learner does (`torchrun --nproc_per_node=N script.py ...`) from a test.

Every launch has a timeout: a hung collective fails the test with the script's output instead of
hanging the suite. The script's metrics JSON (--metrics-out) comes back as a dict.

Launches are warm by default: the ranks fork from a process that imported torch once
(utils/course/warm_ranks.py says what that changes), which makes a short launch take a second instead of
ten on 2 cores. Each lesson script's first torchrun launch in a test run (once, not once per pytest-xdist worker) runs
torchrun itself, so every lesson still runs as a learner runs it (the tests' own workers are warm from the first); so
do launches with `cold=True`, `max_restarts`, another environment's python, an environment that an import reads
differently, or COURSE_COLD_RANKS=1.
`make check` (a learner's exercise) and `make mutants` (hundreds of copies of a lesson, each in a session of its
own) make the first launch warm too (COURSE_FIRST_LAUNCH_WARM=1): what they check is the TODOs, which torchrun
does not change.
"""

import atexit
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.harness.blame import blame_output
from utils.course.notebook import kill_tree
from utils.course.warm_ranks import SOCKET_VARIABLE, WarmRanks
from utils.distributed_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_TRACE = "torch/distributed/run.py"  # torchrun's own traceback, printed after its ranks' errors


@dataclass
class Run:
    command: list
    returncode: int
    output: str  # stdout and stderr together, as a learner sees them
    metrics: dict | None

    def tail(self, lines: int = 40, blamed: bool = True) -> str:
        """The blame (which TODO's code raised, where, with what error) when the run crashed in a lesson script's
        TODO, then the output's last lines without torchrun's own traceback (the ranks' errors come before it)."""
        kept = self.output.splitlines()
        launcher = next((i for i, line in enumerate(kept) if line == "Traceback (most recent call last):"
                         and any(LAUNCHER_TRACE in later for later in kept[i : i + 60])), None)  # fmt: skip
        kept = kept[:launcher] if launcher is not None else kept
        text = "\n".join(kept[-lines:]).strip("\n") or f"(nothing printed; exit code {self.returncode})"
        blame = self.blame() if blamed and self.returncode else None
        return f"{blame}\n{text}" if blame else text

    def blame(self):
        """The TODO whose code raised in this run (tests/harness/blame.py), or None: frames in the script and in
        the lesson scripts it was given (a worker's argument)."""
        scripts = [arg for arg in map(str, self.command) if arg.endswith(".py")]
        return next((found for script in scripts if (found := blame_output(self.output, script))), None)

    def check(self) -> "Run":
        """Fail with the command and the output's tail (led by the blame, when a TODO's code raised)."""
        command = " ".join(map(str, self.command))
        assert self.returncode == 0, f"`{command}` exited {self.returncode}. Its last lines:\n{self.tail()}"
        return self


def finished(result: Run, todo: int | str) -> dict:
    """The run's metrics, or a failure naming the TODO whose code raised, else the TODO the run stopped at, else
    `todo` (a TODO's number, or words for a run that checks no one TODO: "the reference run"): what a learner's
    `make check` line shows when a lesson run fails."""
    checking = f"TODO {todo}" if isinstance(todo, int) else todo
    if result.returncode != 0:
        blame = result.blame()
        if blame:
            lines = result.tail(blamed=False)
            raise AssertionError(f"{blame}\n(the run checking {checking} failed there) Its last lines:\n{lines}")
        stopped = re.search(r"TODO (\d+):", result.output)
        name = f"TODO {stopped.group(1)}" if stopped else f"checking {checking}"
        tail = result.tail()
        # make check shows the first line only: put the run's last error on it, so that the line is never empty
        errors = [line.strip() for line in tail.splitlines() if re.search(r"(Error|Exception|error|ERROR)\b.*:", line)]
        last = (errors or [line.strip() for line in tail.splitlines() if line.strip()] or ["nothing printed"])[-1]
        raise AssertionError(f"{name}: the run failed (exit code {result.returncode}): {last[:200]}. "
                             f"Its last lines:\n{tail}")  # fmt: skip
    return result.metrics


def fresh_folder(folder: Path) -> Path:
    """An empty folder for a run's files, also when a test asks again for a run whose first launch failed."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


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
             python=sys.executable, cold: bool | None = None) -> Run:  # fmt: skip
    """Launch `script` with `nproc` processes on this machine; pass --metrics-out if tmp_path is given.
    max_restarts: torchrun restarts the workers that many times after a failure. python: another environment's.
    cold: True starts torchrun itself, False warm ranks where they can, even for the script's first launch."""
    command = [
        str(python), "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={nproc}", *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        str(script), *map(str, args),
    ]  # fmt: skip
    env = env or course_env()
    metrics_path = _metrics_path(command, script, tmp_path, str(nproc))
    if cold is None:  # each lesson script's first launch in a test run: torchrun itself
        cold = (
            os.environ.get("COURSE_FIRST_LAUNCH_WARM") != "1"
            and _run_by_learners(script)
            and _first_torchrun_launch(script)
        )
    if not (cold or max_restarts or str(python) != sys.executable) and (pool := warm_pool(env)):
        return _run_warm(pool, command, script, nproc, timeout, env, metrics_path)
    _first_torchrun_launch(script)  # this one is started by torchrun itself: later launches may be warm
    return _run(command, timeout, env, metrics_path)


def python(script, args=(), *, tmp_path=None, timeout: float = 120, env=None, cold: bool = False) -> Run:
    """Run `script` as a plain `python script.py` (a world of one, no torchrun)."""
    command = [sys.executable, str(script), *map(str, args)]
    env = env or course_env()
    metrics_path = _metrics_path(command, script, tmp_path, "python")
    if not cold and (pool := warm_pool(env)):
        return _run_warm(pool, command, script, None, timeout, env, metrics_path)
    return _run(command, timeout, env, metrics_path)


def srun_like_env(rank: int, ntasks: int, port: int, env: dict | None = None) -> dict:
    """What srun gives each task when there is no torchrun: SLURM_* variables, no RANK/WORLD_SIZE/LOCAL_RANK."""
    env = {k: v for k, v in (env or course_env()).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    return env


def srun_tasks(script, ntasks: int, args=(), *, env=None, timeout: float = 90) -> list[Run]:
    """`script` as srun starts it without torchrun: each task its own process, none stopped when another exits."""
    port = free_port()
    command = [sys.executable, str(script), *map(str, args)]
    tasks = [
        subprocess.Popen(
            command,
            env=srun_like_env(rank, ntasks, port, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(ntasks)
    ]
    outputs = [task.communicate(timeout=timeout)[0] for task in tasks]
    return [Run(command, task.returncode, output, None) for task, output in zip(tasks, outputs)]


_pool = None
_started_by_torchrun = set()  # the scripts this process has launched with torchrun itself (or seen launched)


# The scripts a learner launches with torchrun: the lessons (solutions/, exercises/) and the labs and benchmarks their
# notebooks start (utils/lesson_NN/). The tests' own workers (tests/workers/) and a test's copy of an exercise in a
# temporary folder are instruments: torchrun's start-up (its agent and cold ranks, ~10 s of CPU) adds nothing there.
LEARNERS_SCRIPTS = ("solutions", "exercises", "utils")


def _run_by_learners(script) -> bool:
    path = Path(script).resolve()
    return path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in LEARNERS_SCRIPTS


def _first_torchrun_launch(script) -> bool:
    """True once per test run for each script, False after: the first caller claims it. pytest-xdist's workers
    share one run id (PYTEST_XDIST_TESTRUNUID), so the claim is a file created atomically in a folder of that run;
    a session without workers remembers it in-process."""
    path = Path(script).resolve()
    if path in _started_by_torchrun:
        return False
    _started_by_torchrun.add(path)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        return True
    claims = Path(tempfile.gettempdir()) / f"course-torchrun-launches-{run_id}"
    claims.mkdir(exist_ok=True)
    try:
        os.close(os.open(claims / hashlib.sha1(str(path).encode()).hexdigest(), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another worker of this run started it with torchrun
    return True


def warm_pool(env: dict):
    """The session's warm-ranks pool if a launch with `env` can use it: the one this session's conftest
    started, else one started now (and stopped when the session ends)."""
    global _pool
    if os.environ.get("COURSE_COLD_RANKS") == "1":
        return None
    if _pool is None:
        _pool = WarmRanks.from_environment()
    if _pool is None:
        _pool = WarmRanks.start(course_env())
        os.environ[SOCKET_VARIABLE] = _pool.path
        atexit.register(_pool.stop)
    return _pool if _pool.can_launch(env) else None


def _run_warm(pool, command, script, nproc, timeout, env, metrics_path) -> Run:
    """_run's result for a launch on warm ranks: the same output, exit code and timeout message."""
    args = command[command.index(str(script)) + 1 :]
    try:
        code, output, _ = pool.run(script, args, nproc=nproc, env=env, cwd=ROOT, timeout=timeout)
    except TimeoutError as stopped:
        tail = "\n".join(str(stopped).splitlines()[-40:])
        command_line = " ".join(command)
        raise AssertionError(f"`{command_line}` did not finish within {timeout} s. Its last lines:\n{tail}") from None
    return Run(command, code, output, _metrics(metrics_path, code))


def _metrics(metrics_path, returncode: int) -> dict | None:
    if metrics_path is not None and returncode == 0 and metrics_path.exists():
        return json.loads(metrics_path.read_text())
    return None


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
    return Run(command, process.returncode, output, _metrics(metrics_path, process.returncode))
