"""Run the lesson scripts from a notebook cell, the way you would in a terminal, or type on live ranks.

    from utils.course.notebook import torchrun
    metrics = torchrun("solutions/01_collectives.py", nproc=4, args=["--steps", "5"])

is `torchrun --nproc_per_node=4 solutions/01_collectives.py --steps 5 --metrics-out ...`, printing
what rank 0 prints and returning the script's metrics file as a dict.

    from utils.course.notebook import start_ranks
    ranks = start_ranks(4)        # 4 processes (ipyparallel engines), each rank r of one process group
    %%px                          # a cell that every rank runs; `rank`, `world_size`, `device`, `dist` exist
    x = torch.ones(2, device=device) * rank; dist.all_reduce(x); print(x)
    ranks.stop()                  # leave the group, stop the processes

After a crashed kernel, stop leftover ranks from a terminal with `python -m utils.course.notebook stop-ranks`.
"""

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def kill_tree(pid: int):
    """Kill torchrun and every rank it started (the ranks run in sessions of their own)."""
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def torchrun(script, nproc: int = 2, args=(), *, show: bool = True, timeout: float = 300, cold: bool = False) -> dict:
    """Launch `script` (a path relative to the course root) with `nproc` processes; return its metrics.
    cold=True: torchrun itself even under the test suite, whose warm ranks are forked from one process and share its
    memory (a measurement of a rank's memory must see the processes that a learner's torchrun starts)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics_path = Path(tmp) / "metrics.json"
        command = [
            sys.executable, "-m", "torch.distributed.run",  # torchrun, from this notebook's environment
            "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / script), *map(str, args), "--metrics-out", str(metrics_path),
        ]  # fmt: skip
        # One thread per process: the ranks share the machine's cores (and torchrun stays quiet).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
        returncode, stdout, stderr = _launch(command, nproc, env, timeout, script, cold)
        if show:
            print(stdout, end="")
        if returncode != 0:
            tail = "\n".join(stderr.splitlines()[-15:])
            raise RuntimeError(f"{script} failed (exit code {returncode}):\n{tail}")
        return json.loads(metrics_path.read_text())


def _launch(command: list, nproc: int, env: dict, timeout: float, script, cold: bool) -> tuple[int, str, str]:
    """Run torchrun's command; under `make test` on the test session's warm ranks instead (utils/course/warm_ranks.py),
    which print the same and start in a fraction of the time, unless `cold`."""
    from utils.course.warm_ranks import WarmRanks

    pool = None if cold else WarmRanks.from_environment()
    if pool is not None and pool.can_launch(env):
        at = command.index(str(ROOT / script))
        script_and_args = command[at], command[at + 1 :]
        try:
            return pool.run(*script_and_args, nproc=nproc, env=env, cwd=ROOT, timeout=timeout, merge=False)
        except TimeoutError:
            raise RuntimeError(f"{script} did not finish within {timeout} s: stopped it and its ranks") from None
    process = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        raise RuntimeError(f"{script} did not finish within {timeout} s: stopped it and its ranks") from None
    return process.returncode, stdout, stderr


def stacks_of_a_hang(script, nproc: int, args=(), *, waits_in: str, timeout: float = 60) -> str:
    """Start `script` with torchrun as a job that hangs, and return what `python -m utils.stacks --pid` shows once
    every rank waits where `waits_in` says (a function name in the tool's summary); the job is stopped then.
    Give the job a collective timeout longer than `timeout`, so that it is still hanging when its stacks are read."""
    # Paths relative to the course root, the job's folder: the stacks' header reads as the command would be typed.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *map(str, args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while True:  # until every rank has started and reached the call it hangs in
            done = subprocess.run([sys.executable, "-m", "utils.stacks", "--pid", str(job.pid)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            summary = done.stdout.rpartition("summary: ")[2]
            if summary.startswith(f"all {nproc} ranks found wait in") and waits_in in summary:
                return done.stdout
            if done.returncode != 0 and "no torchrun" not in done.stderr:  # not only "not started yet"
                raise RuntimeError(done.stderr.strip())  # the tool's one line: py-spy missing, permission denied
            if job.poll() is not None:
                raise RuntimeError(f"{script} ended (exit code {job.returncode}) before its ranks waited in {waits_in}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{script}: not every rank waited in {waits_in} within {timeout} s. The stacks:\n"
                                   f"{done.stdout or done.stderr}")  # fmt: skip
            time.sleep(0.5)
    finally:
        kill_tree(job.pid)


# --------------------------------------------------------------------------------------------------
# Live ranks in a notebook: ipyparallel engines, each one rank of a process group
# --------------------------------------------------------------------------------------------------

CLUSTER_PREFIX = "course-ranks-"  # the clusters start_ranks() makes; `stop-ranks` stops only these
# The ranks' own IPython profile, apart from ~/.ipython: JupyterLab's ipyparallel extension watches the clusters of
# the usual profiles and, when their engines stop, prints each engine's whole log (its "received signal 15", its
# tracebacks) into the terminal that runs the lab. Out of its sight, the ranks stop quietly; while they run, their
# logs are files under runs/live_ranks/log/ (removed when they stop).
PROFILE_DIR = ROOT / "runs" / "live_ranks"

JOIN_TIMEOUT_S = 60  # how long the live ranks wait for each other to join (their collectives: timeout_s)
ANSWER_TIMEOUT_S = 30  # how long new ranks may take to run their first command (a second or two, but for a fault)
STARTS = 3  # how many times start_ranks() starts them before it gives up (see Ranks._answer)

# Run on every engine, with {placeholders} filled per rank: join the group the way a script does.
_JOIN = """
import os, sys
course_root = {root!r}
if {root!r} not in sys.path:
    sys.path.insert(0, {root!r})
os.environ.update({env!r})
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG, read again for the group made now
from utils.distributed_utils import setup
# Joining waits at least a minute (engines start their joins one after another, on a busy machine seconds apart);
# the group's collectives, DETAIL's checks among them, wait timeout_s, which may be shorter (a lab's hang in 5 s).
local_rank, rank, device, world_size = setup(seed={seed}, timeout_s={timeout_s}, join_timeout_s={join_timeout_s})
"""

_LEAVE = """
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()  # no barrier: the group may be broken (a timed-out collective)
"""

_LEAVE_CLEANLY = """
import torch.distributed as dist
if dist.is_initialized():
    try:
        dist.barrier()  # gloo: every rank gets here before any tears down
    finally:
        dist.destroy_process_group()
"""


_LAB = """
from utils.course.lab import run_case
from utils.course.lessons import load_script
_lab_outcome = run_case(load_script({path!r}, "lab_lesson"), {case!r})
"""


def _interactive_shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


class Ranks:
    """`world_size` live processes (ipyparallel engines); engine i is rank i of one process group.

    %%px cells run on every rank (%%px --targets 0,1 on some). In each rank's namespace: rank,
    local_rank, world_size, device, torch and dist. Results come back in rank order with pull().
    """

    def __init__(self, world_size: int, timeout_s: float | None, debug: str | None, seed: int, backend: str | None):
        import ipyparallel as ipp  # only the notebooks need it

        if backend not in (None, "gloo"):
            raise ValueError(
                f"backend {backend!r}: None (NCCL on GPUs, else gloo) or 'gloo' (the CPU, even on a GPU node)"
            )
        self.backend = backend
        gpus = 0 if backend == "gloo" else _visible_gpus()
        if gpus and world_size > gpus:
            from utils.distributed_utils import CourseError

            raise CourseError(
                f"{world_size} ranks but {gpus} visible GPU(s): NCCL needs one GPU per rank; "
                f"start at most {gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to use the CPU and gloo"
            )
        self.world_size, self.seed = world_size, seed
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, STARTS + 1):
            self._start_engines(ipp, world_size)
            if self._answer(ANSWER_TIMEOUT_S):
                break
            self.client.close(linger=0)
            self.kill()  # a controller without its queue (see _answer): start afresh, on new ports
            if attempt == STARTS:
                from utils.distributed_utils import CourseError

                raise CourseError(
                    f"the {world_size} live ranks did not answer within {ANSWER_TIMEOUT_S} s, {STARTS} times (their "
                    f"logs: {PROFILE_DIR / 'log'}); run the cell again, or restart the kernel"
                )
        self.restart(timeout_s=timeout_s, debug=debug)
        shell = _interactive_shell()
        if shell is not None:  # %%px and %px now run on these ranks
            _kill_ranks_on_sigterm()
            self.view.activate()
            # One block of output per cell, in rank order, and no progress widget (reproducible outputs).
            shell.run_line_magic("pxconfig", "--no-stream --progress-after -1")

    def _start_engines(self, ipp, world_size: int):
        """Start a controller and `world_size` engines, connect to them, and note their processes."""
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        self.cluster = ipp.Cluster(
            # The id names this process (the notebook's kernel): `stop-ranks` stops only ranks whose kernel is gone.
            n=world_size,
            cluster_id=f"{CLUSTER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}",
            profile_dir=str(PROFILE_DIR),
            log_level=logging.ERROR,
            # The controller finishes an engine's registration at its next heartbeat (every 3 s by default): a
            # beat each second starts the ranks seconds sooner; a rank is declared dead after 10 missed beats.
            controller_args=["--HeartMonitor.period=1000"],
            shutdown_atexit=False,  # too slow for a kernel restart: _kill_live_ranks instead
        )
        self.cluster.start_cluster_sync()
        self.client = self.cluster.connect_client_sync()
        self.client.wait_for_engines(world_size, timeout=120, interactive=False)
        # Engine ids follow the order in which engines registered, not the order they were launched:
        # give each engine its rank explicitly, rank = its position among the ids (0..n-1 on a fresh cluster).
        self.engine_ids = sorted(self.client.ids)[:world_size]
        self.view = self.client[self.engine_ids]
        self.view.block = True
        self.processes = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        _LIVE.add(self)  # killed at once if the kernel exits before stop(): see _kill_live_ranks

    def _answer(self, timeout_s: float) -> bool:
        """Whether every engine runs a command within `timeout_s`. ipyparallel picks its controller's ports first and
        binds them later: when another process takes one in between, the queue that carries commands to the engines
        never starts (its log says "Address already in use"), the engines still register, and every command then
        waits forever. Seen on a busy machine, where ports come and go by the hundred."""
        try:
            self.view.execute("pass", block=False).get(timeout=timeout_s)
        except TimeoutError:  # ipyparallel's is one
            return False
        return True

    def restart(self, timeout_s: float | None = None, debug: str | None = None):
        """(Re-)create the process group on every rank, on a fresh port: after a collective timed out,
        the group is unusable on every rank until it is destroyed and made again.

        timeout_s: how long a collective waits for the others (default: the course's, COURSE_TIMEOUT_S);
        debug: "DETAIL" sets TORCH_DISTRIBUTED_DEBUG=DETAIL (collectives checked for matching shapes), "OFF" unsets."""
        from utils.distributed_utils import DEFAULT_TIMEOUT_S, free_port

        if timeout_s is not None:
            self.timeout_s = float(timeout_s)
        elif not hasattr(self, "timeout_s"):
            self.timeout_s = float(os.environ.get("COURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        if debug is not None:
            self.debug = debug
        elif not hasattr(self, "debug"):
            self.debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
        self.view.execute(_LEAVE, block=False).get(timeout=ANSWER_TIMEOUT_S)  # leaving takes no collective
        port = free_port()
        pending = []
        for rank, engine in enumerate(self.engine_ids):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),  # one machine: local rank = rank
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TORCH_DISTRIBUTED_DEBUG": self.debug,
            }
            if self.backend == "gloo":  # set before the rank first imports torch: setup() then sees no GPU
                env["CUDA_VISIBLE_DEVICES"] = ""
            code = _JOIN.format(root=str(ROOT), env=env, seed=self.seed, timeout_s=self.timeout_s,
                                join_timeout_s=JOIN_TIMEOUT_S)  # fmt: skip
            pending.append(self.client[engine].execute(code, block=False))
        for result in pending:
            result.get(timeout=max(self.timeout_s, JOIN_TIMEOUT_S) + 60)  # the join, then a minute to spare

    def pull(self, name: str) -> list:
        """The value of `name` on every rank, in rank order (tensors come back as they are, on the CPU)."""
        self.view.execute(f"_pulled = {name}.detach().cpu() if isinstance({name}, torch.Tensor) else {name}")
        return self.view.pull("_pulled", block=True)

    def pull_expression(self, expression: str) -> list:
        """The value of a Python expression evaluated on every rank, in rank order."""
        self.view.execute(f"_pulled = {expression}")
        return self.view.pull("_pulled", block=True)

    def run_lab(self, case: str, script: str) -> tuple[bool, list[str]]:
        """Run debugging-lab case `case` (utils/course/lab.py) with the functions of `script` (e.g.
        "exercises/01_collectives.py", loaded afresh: your latest edit counts) on every rank. Returns
        (passed, one line per rank). Each case leaves the ranks a fresh process group, as the check does: a
        timed-out collective leaves a group unusable, and send/recv between some ranks leaves DETAIL's
        count of collectives different on the others."""
        from utils.course.lab import verdict

        code = _LAB.format(path=str(ROOT / script), case=case)
        self.view.execute(code, block=True)
        passed, lines = verdict(case, self.view.pull("_lab_outcome", block=True))
        self.restart()
        return passed, lines

    @property
    def pids(self) -> list[int]:
        """The process ids of the ranks, in rank order."""
        return [self.client[engine].apply_sync(os.getpid) for engine in self.engine_ids]

    def kill(self):
        """Kill the ranks, their controller and their nannies at once, and forget the cluster (`stop-ranks` then finds
        nothing left of it): for a kernel that exits with its ranks up, which has no time for stop()."""
        _LIVE.discard(self)
        for process in self.processes:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for leftover in (self.cluster.cluster_file, PROFILE_DIR / "log" / f"engines{self.cluster.cluster_id}.json"):
            Path(leftover).unlink(missing_ok=True)

    def stop(self, timeout: float = 30):
        """Leave the process group on every rank, stop the engines and their controller; no process is left."""
        _LIVE.discard(self)
        try:
            self.view.execute(_LEAVE_CLEANLY, block=False).get(timeout=timeout)
        except Exception:  # a broken or stuck group: the processes are stopped below all the same
            pass
        try:
            self.client.close()
        finally:
            try:
                self.cluster.stop_cluster_sync()
            finally:
                # What is left are the engines' nannies (watchers that forward signals), which would take
                # seconds to notice that their engine is gone: their work is over, so they are stopped now.
                alive = [p for p in self.processes if p.is_running()]
                for process in alive:
                    with contextlib.suppress(psutil.Error):
                        process.terminate()
                _, still_alive = psutil.wait_procs(alive, timeout=timeout)
                for process in still_alive:
                    kill_tree(process.pid)
                # The controller, stopped by a signal, leaves its list of engines behind: nothing reads it again.
                (PROFILE_DIR / "log" / f"engines{self.cluster.cluster_id}.json").unlink(missing_ok=True)


# The ranks not stopped yet. A kernel restart or shutdown gives the kernel 2.5 s to exit, then terminates it (SIGTERM,
# which skips atexit) and kills it: too short for ipyparallel's own stop at exit on a busy machine, which left ranks
# running. At exit, or on SIGTERM, the ranks are killed at once instead.
_LIVE: set = set()


def _kill_live_ranks():
    for ranks in list(_LIVE):
        ranks.kill()


atexit.register(_kill_live_ranks)


def _kill_ranks_on_sigterm():
    """In a notebook's kernel: on SIGTERM, kill the live ranks, then end as SIGTERM would have ended it (only where
    nothing handles SIGTERM already; a cell runs in the main thread, where handlers are set)."""
    if (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        or threading.current_thread() is not threading.main_thread()
    ):
        return

    def terminated(signum, frame):
        _kill_live_ranks()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminated)


def _visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_ranks(
    world_size: int = 4, timeout_s: float | None = None, debug: str | None = None, seed: int = 0, backend=None
):
    """Start `world_size` ranks that %%px cells run on; each has joined the process group (gloo on CPU,
    NCCL with one GPU per rank where GPUs exist; backend="gloo": gloo and the CPU even where GPUs exist).
    Stop them with .stop()."""
    return Ranks(world_size, timeout_s=timeout_s, debug=debug, seed=seed, backend=backend)


def explain(error) -> list[str]:
    """One line per failed rank of an ipyparallel CompositeError, in rank order, as the course's scripts say it."""
    from utils.distributed_utils import _lost_peer

    lines = []
    for name, value, _, info in sorted(error.elist, key=lambda item: item[3].get("engine_id", -1)):
        rank = info.get("engine_id", "?")
        gist = value.strip().splitlines()[0] if value.strip() else name
        gist = re.sub(r"^\[[^\]]*\]\s*", "", gist)  # drop gloo's [/path/file.cc:NN] prefix
        timed_out = re.search(r"Timed out waiting (\d+)ms", gist)
        if timed_out:
            lines.append(
                f"rank {rank}: the collective timed out after {int(timed_out.group(1)) / 1000:g} s. Another rank "
                "crashed, is stuck, or skipped this collective"
            )
        elif _lost_peer(RuntimeError(value)):
            lines.append(f"rank {rank}: the collective failed: a peer closed the connection (the group is broken)")
        else:
            lines.append(f"rank {rank}: {name}: {gist}")
    return lines


def stop_leftover_ranks(even_in_use: bool = False) -> int:
    """Stop the ranks that start_ranks() made in a kernel that no longer runs (a crashed or killed kernel);
    with even_in_use, those of running kernels too. Returns how many sets of ranks were stopped."""
    from ipyparallel.cluster.cluster import ClusterManager

    # CRITICAL: a killed kernel's ranks may be partly gone already, which ipyparallel reports as an error per engine
    # ("Engine 0 not running") while stopping the rest all the same; the line printed below says what was done.
    quiet = logging.getLogger("course.live_ranks")
    quiet.setLevel(logging.CRITICAL)
    manager = ClusterManager(log=quiet)
    stopped = 0
    for cluster in manager.load_clusters(profile_dirs=[str(PROFILE_DIR)]).values():
        if not cluster.cluster_id.startswith(CLUSTER_PREFIX):
            continue  # not the course's
        owner = cluster.cluster_id[len(CLUSTER_PREFIX) :].split("-")[0]
        if owner.isdigit() and psutil.pid_exists(int(owner)) and not even_in_use:
            print(f"ranks {cluster.cluster_id} belong to the running process {owner}: left alone (--all stops them)")
            continue
        cluster.stop_cluster_sync()
        stopped += 1
    return stopped


if __name__ == "__main__":
    if sys.argv[1:] not in (["stop-ranks"], ["stop-ranks", "--all"]):
        sys.exit("usage: python -m utils.course.notebook stop-ranks [--all]   (stop the ranks a crashed notebook left)")
    count = stop_leftover_ranks(even_in_use=sys.argv[2:] == ["--all"])
    print(f"stopped {count} set(s) of ranks left by notebooks")
