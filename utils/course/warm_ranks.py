"""Warm ranks: start a launch's processes by forking one that has imported torch already.

For the test suite and the notebooks under `make test`; a learner never needs it. On 2 cores most of
a short launch was spent importing: torchrun imports torch, then every rank imports torch, its
distributed packages and `datasets` again (about 5 s of CPU each). The pool is one process that
imports them once (PRELOAD) and then waits. For each launch it forks a small launcher, which forks
the ranks; each rank gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...), runs the script as `__main__` and exits the way Python exits. From
there a rank is what it is under torchrun: a process of its own that joins its process group over
TCP, trains, tears down and exits.

What differs from torchrun, and what keeps the tests honest about it:
- torchrun's agent (rendezvous, restarts, signal forwarding) is not there. A launch that needs it
  (max_restarts, TORCH_ELASTIC_* settings) or whose environment changes what an import reads (OMP_,
  TORCH_, CUDA_, HF_ ... variables: `differs_at_import`) runs cold, through torchrun itself; so does
  every launch when COURSE_COLD_RANKS=1 is set, and at least one test per lesson (`cold=True`).
- The ranks of one launch share the pool's Python hash seed (a set of strings iterates in the same
  order on every rank); under torchrun each rank has its own. Code that relies on that order is
  wrong either way; the cold runs would show it.
- A rank leaves with os._exit after its atexit handlers: the interpreter's module-by-module shutdown
  (seconds with torch loaded) is skipped, so a crash there (a C++ destructor at exit) shows only in
  the cold runs.
- When a rank fails, the launcher stops the others (SIGTERM, then SIGKILL after the shutdown
  timeout) and exits 1, as torchrun does; a plain `python script.py` launch keeps its exit code.

    pool = WarmRanks.start()                     # once per test session: about as long as one launch
    launch = pool.launch(script, args, nproc=2, env=env, cwd=root, stdout=w, stderr=w)
    code = launch.wait()                         # after reading the output to its end
"""

import atexit
import gc
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOCKET_VARIABLE = "COURSE_WARM_RANKS"  # where the pool listens; set for the processes a test session starts

# What every lesson imports that takes seconds: imported once, in the pool, before any fork.
PRELOAD = [
    "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.checkpoint",
    "torch.distributed.algorithms.ddp_comm_hooks", "torch.utils.tensorboard", "numpy", "datasets", "psutil",
]  # fmt: skip

# Variables some library reads when it is imported (or when the interpreter starts): a launch whose
# value differs from the pool's cannot reuse the pool's imports and runs cold. TORCHELASTIC_* and
# TORCH_ELASTIC_* are torchrun's own: a launch that sets them wants torchrun.
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "CUDA_", "HF_", "NCCL_", "GLOO_", "PYTHON")
# PYTHONPATH and PYTHONUNBUFFERED are applied per launch; inductor sets its cache folder's variable itself
# the first time it needs it (in the test session or in the pool, whichever imported more).
_NOT_AT_IMPORT = {"PYTHONPATH", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"}


def differs_at_import(env: dict, pool_env: dict) -> list[str]:
    """The variables whose value in `env` differs from the pool's and that an import or start-up reads."""
    names = {name for name in {*env, *pool_env} if name.startswith(_IMPORT_TIME_PREFIXES)} - _NOT_AT_IMPORT
    return sorted(name for name in names if env.get(name) != pool_env.get(name))


# --------------------------------------------------------------------------------------------------
# The client side: what tests/harness/launch.py and utils/course/notebook.py call
# --------------------------------------------------------------------------------------------------


class Launch:
    """One launch in flight: its launcher's pid (kill its tree to stop it) and, at the end, its exit code."""

    def __init__(self, connection: socket.socket, pid: int):
        self.connection, self.pid = connection, pid

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once every rank has exited (read the output to its end first)."""
        self.connection.settimeout(timeout)
        try:
            message = self.connection.recv(65536)
        finally:
            self.connection.close()
        if not message:  # the launcher was killed (a timeout): no exit code came
            return -signal.SIGKILL
        return json.loads(message)["exit"]


class WarmRanks:
    def __init__(self, path: str, environment: dict, process: subprocess.Popen | None = None):
        self.path, self.environment, self.process = path, environment, process

    @classmethod
    def start(cls, env: dict, timeout: float = 120) -> "WarmRanks":
        """Start the pool (a child of this process) with `env`, the environment it imports under."""
        folder = tempfile.mkdtemp(prefix="course-warm-ranks-")
        path = os.path.join(folder, "socket")
        process = subprocess.Popen(
            [sys.executable, "-m", "utils.course.warm_ranks", path], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        ready = process.stdout.readline()  # one line once the imports are done and the socket listens
        if not ready.startswith("ready"):
            process.kill()
            raise RuntimeError(f"the warm-ranks pool did not start: {ready}{process.stdout.read()[-2000:]}")
        return cls(path, dict(env), process)

    @classmethod
    def from_environment(cls) -> "WarmRanks | None":
        """The pool this process's test session started (COURSE_WARM_RANKS), if any."""
        path = os.environ.get(SOCKET_VARIABLE)
        if not path or not os.path.exists(path) or os.environ.get("COURSE_COLD_RANKS") == "1":
            return None
        with open(path + ".env") as file:
            return cls(path, json.load(file))

    def can_launch(self, env: dict) -> bool:
        return not differs_at_import(env, self.environment)

    def launch(self, script, args, *, nproc: int | None, env: dict, cwd, stdout: int, stderr: int) -> Launch:
        """Start `script args` on `nproc` ranks (None: one plain process, no rank variables)."""
        request = {"script": str(script), "args": [str(a) for a in args], "nproc": nproc, "env": env, "cwd": str(cwd)}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(self.path)
        socket.send_fds(connection, [json.dumps(request).encode()], [stdout, stderr])
        connection.settimeout(60)
        return Launch(connection, json.loads(connection.recv(65536))["pid"])

    def run(self, script, args, *, nproc: int | None, env: dict, cwd, timeout: float, merge: bool = True):
        """Launch and wait: (exit code, stdout, stderr), stderr merged into stdout when `merge` (then "").
        Past `timeout` the launcher and its ranks are killed and TimeoutError carries the output so far."""
        pipes = [os.pipe() for _ in range(1 if merge else 2)]
        writers = [pipes[0][1], pipes[-1][1]]
        try:
            launch = self.launch(script, args, nproc=nproc, env=env, cwd=cwd, stdout=writers[0], stderr=writers[1])
        finally:
            for _, write in pipes:
                os.close(write)
        outputs = _read_all([read for read, _ in pipes], time.monotonic() + timeout)
        if outputs is None:
            _kill_group(launch.pid)
            outputs = _read_all([read for read, _ in pipes], time.monotonic() + 10) or ["", ""]
            raise TimeoutError(outputs[0])
        return launch.wait(), outputs[0], outputs[1] if not merge else ""

    def stop(self):
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for leftover in (self.path, self.path + ".env"):
            Path(leftover).unlink(missing_ok=True)
        Path(self.path).parent.rmdir()


def _read_all(fds: list[int], deadline: float) -> list[str] | None:
    """Read each pipe to its end (then close it); None if the deadline passes first. Newlines as text=True gives."""
    chunks = {fd: [] for fd in fds}
    open_fds = set(fds)
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in selector.select(timeout=left):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    open_fds.discard(key.fd)
    texts = [b"".join(chunks[fd]).decode(errors="replace") for fd in fds]
    return [text.replace("\r\n", "\n").replace("\r", "\n") for text in texts] + [""] * (2 - len(fds))


def _kill_group(pid: int):
    """Kill a launcher and its ranks: they share the process group the launcher made."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------------
# The pool's side: `python -m utils.course.warm_ranks SOCKET`
# --------------------------------------------------------------------------------------------------


def serve(path: str):
    import importlib

    started_with = dict(os.environ)  # what launches are compared with: the imports below may add to it

    for name in PRELOAD:
        importlib.import_module(name)
    if others := _other_threads():  # forking a process with threads can copy a lock one holds: refuse
        print(f"not ready: threads {others} run after the imports; forking is unsafe", flush=True)
        sys.exit(1)
    gc.collect()
    gc.freeze()  # the imports' objects: a rank's garbage collector leaves them (and their pages) alone
    base_path = [entry for entry in sys.path[1:] if entry not in _pythonpath(os.environ)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(1.0)
    with open(path + ".env", "w") as file:
        json.dump(started_with, file)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel
    parent = os.getppid()
    print("ready", flush=True)
    quiet = os.open(os.devnull, os.O_WRONLY)  # nobody reads the pool's own output after this line
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    while os.getppid() == parent:  # the test session that started the pool is gone: stop
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        if os.fork() == 0:
            listener.close()
            # The launcher never comes back; a rank does, to run its script at the top of the stack,
            # where nothing of the pool's catches its exit.
            return _launcher(connection, json.loads(message), fds, base_path)
        connection.close()
        for fd in fds:
            os.close(fd)
    return None


def _other_threads() -> list[str]:
    """The threads beside this one, by name, except jemalloc's background thread (pyarrow's allocator,
    through `datasets`): jemalloc takes its locks around fork and restarts that thread in the child."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    return [name for task, name in zip(os.listdir("/proc/self/task"), names)
            if int(task) != threading.get_native_id() and name != "jemalloc_bg_thd"]  # fmt: skip


def _pythonpath(env: dict) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _launcher(connection, request: dict, fds: list[int], base_path: list[str]):
    """In a forked child: fork the ranks, wait for them, stop the rest when one fails, report the exit code."""
    from utils.distributed_utils import free_port

    try:
        os.setsid()  # a process group of its own: a test's timeout kills the launcher and its ranks together
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        nproc = request["nproc"]
        env = dict(request["env"])
        if nproc is not None:  # what torchrun --standalone gives each rank
            env.update(
                MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="warm-ranks", TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            )  # fmt: skip
        ranks = {}
        for rank in range(nproc or 1):
            if (pid := os.fork()) == 0:
                connection.close()
                rank_env = env if nproc is None else {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                      "ROLE_RANK": str(rank)}  # fmt: skip
                return request, rank_env, fds, base_path
            ranks[pid] = rank
        # Like torchrun's agent, host the job's store at MASTER_ADDR:MASTER_PORT (the ranks' process group meets
        # there, and scripts may use it as a store that outlives a broken group); after the forks, so that no
        # rank inherits its server thread. The ranks' clients retry until it listens.
        store = _agent_store(env) if nproc is not None else None
        connection.sendall(json.dumps({"pid": os.getpid()}).encode())
        shutdown_timeout = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
        code = _wait_for(ranks, fds[1], shutdown_timeout, plain=nproc is None, requester=connection)
        del store
        for fd in fds:
            os.close(fd)  # the reader sees the output's end once the ranks and this launcher closed it
        connection.sendall(json.dumps({"exit": code}).encode())
    except BaseException:
        traceback.print_exc()
    os._exit(0)


def _agent_store(env: dict):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("localhost", int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=True,
                         timeout=timedelta(seconds=900), wait_for_workers=False)  # fmt: skip


def _wait_for(ranks: dict, stderr: int, shutdown_timeout: float, plain: bool, requester: socket.socket) -> int:
    """Wait for every rank; when one fails, stop the others as torchrun's agent does. The ranks are in this
    launcher's session, not the requester's: when the requester is gone without stopping them (killed with its
    process group, as `make grade` stops a hung participant), its end of the connection closes and the ranks are
    stopped too, instead of running on with nobody to read them."""
    codes, deadline = {}, None
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is None and _closed(requester):  # nobody reads the output either: say nothing
                for other in set(ranks) - set(codes):
                    _signal(other, signal.SIGTERM)
                deadline = time.monotonic() + shutdown_timeout
            elif deadline is not None and time.monotonic() > deadline:  # SIGKILL what is left after the timeout
                for other in set(ranks) - set(codes):
                    _signal(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and deadline is None and not plain:
            running = set(ranks) - set(codes)
            stopping = ": stopping the other ranks" if running else ""
            os.write(stderr, f"[launcher] rank {ranks[pid]} exited with code {codes[pid]}{stopping}\n".encode())
            for other in running:
                _signal(other, signal.SIGTERM)
            deadline = time.monotonic() + shutdown_timeout
    if plain:
        return next(iter(codes.values()))
    return 0 if all(code == 0 for code in codes.values()) else 1


def _closed(connection: socket.socket) -> bool:
    """Whether the other end closed the connection: the requester sends nothing after its request, so anything
    readable is the end. (Not recv(MSG_DONTWAIT): the connection keeps the listener's 1 s timeout, under which
    Python's recv waits that second first and then raises TimeoutError.)"""
    readable, _, _ = select.select([connection], [], [], 0)
    return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""


def _signal(pid: int, number: int):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _rank(request: dict, env: dict, fds: list[int], base_path: list[str]):
    """In a forked rank: become `python script args`, then leave as Python does (exit code, traceback,
    atexit handlers, flushed output), but without tearing the interpreter's modules down one by one:
    that takes seconds with torch loaded, and the script has destroyed its process group already."""
    code = 1
    try:
        _become(request, env, fds, base_path)
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(code) -> int:
    """What `sys.exit(code)` makes the process's exit status: None is 0, a message is printed and is 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _become(request: dict, env: dict, fds: list[int], base_path: list[str]):
    """Output, signals, modules, environment, directory, argv and sys.path as a fresh `python script` has."""
    stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr}:
        os.close(fd)
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in [name for name in sys.modules if name.split(".")[0] in ("utils", "tests")]:
        del sys.modules[name]  # the course's own modules load afresh, from where this launch's sys.path says
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *_pythonpath(env), *base_path]
    _reseed()


def _reseed():
    """A fresh process seeds `random` and NumPy from the OS; forks would share the pool's state."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


if __name__ == "__main__":
    if (rank := serve(sys.argv[1])) is not None:
        _rank(*rank)
