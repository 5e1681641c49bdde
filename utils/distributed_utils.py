"""The few functions every lesson uses to start, talk and stop as one distributed job.

    local_rank, rank, device, world_size = setup(seed=0)
    print0("only rank 0 prints this")
    ...
    destroy_process_group()

`setup()` works the same under `torchrun`, under `srun` without torchrun (it reads SLURM_*), and
as a plain `python script.py` (a world of one). It picks NCCL and a CUDA device where GPUs exist,
gloo and the CPU otherwise, so the lessons run unchanged on a laptop and on the cluster.
"""

import functools
import gc
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import utils.course.compat  # noqa: F401  (older torch gets the collective names the lessons use)
from utils import monitor

# A collective that waits longer than this is a bug (a rank crashed, a rank skipped a collective,
# the world size is wrong): fail with a message instead of hanging forever. COURSE_TIMEOUT_S overrides.
DEFAULT_TIMEOUT_S = 60


class CourseError(RuntimeError):
    """A mistake the learner can fix; `run_main` prints it as one line, without a traceback."""


class Refusal(CourseError):
    """An option or a world size that cannot run, refused before any collective: every rank decides alike from
    the same command line, so rank 0 alone prints it (the others exit with the same code, silently)."""


# --------------------------------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_rank() -> int:
    """This process's global rank as its launcher gave it, before (or without) a process group.

    torchrun sets RANK; srun alone sets SLURM_PROCID; a plain `python script.py` is rank 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def _launcher_environment() -> tuple[int, int, int]:
    """(local_rank, rank, world_size) from torchrun, from srun, or a world of one.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. srun alone sets SLURM_PROCID,
    SLURM_NTASKS and SLURM_LOCALID, and we derive the rendezvous address from the node list.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            nodes = subprocess.run(
                ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            os.environ["MASTER_ADDR"] = nodes[0]
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000))
        return (
            int(os.environ["SLURM_LOCALID"]),
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
        )
    # Plain `python script.py`: a world of one on this machine.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return 0, 0, 1


def setup(
    seed: int = 0, timeout_s: float | None = None, join_timeout_s: float | None = None
) -> tuple[int, int, torch.device, int]:
    """Join the job's process group and return (local_rank, rank, device, world_size).

    Seeds torch with `seed + rank`, so each rank draws different random numbers (data order,
    dropout). Build models from their own seed (see utils.model) so every rank starts identical.
    timeout_s: how long a collective (and the join) waits for the others; join_timeout_s, when longer: how long the
    join waits, the collectives still timeout_s (the notebook's live ranks start one after another).
    """
    local_rank, rank, world_size = _launcher_environment()
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:  # two ranks on one GPU would deadlock NCCL or run out of memory: refuse
            local_ranks = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "?"
            raise CourseError(
                f"rank {rank}: {local_ranks} processes on this node but only {gpus} visible GPU(s); "
                f"start at most {gpus} per node (--nproc_per_node={gpus}), or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES=) to run on the CPU with gloo."
            )
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before the process group: NCCL binds each rank to its GPU
    else:
        backend, device = "gloo", torch.device("cpu")
    timeout_s = timeout_s or float(os.environ.get("COURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    join_s = max(timeout_s, join_timeout_s or 0)
    if not dist.is_initialized():
        try:
            store = None
            if join_s > timeout_s:  # the store waits join_s for every rank; the group's collectives timeout_s
                address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
                store = dist.TCPStore(address, port, world_size, rank == 0, timedelta(seconds=join_s))
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                store=store,
                device_id=device if backend == "nccl" else None,
            )
        except (dist.DistStoreError, RuntimeError) as error:
            raise CourseError(
                f"rank {rank}: only some of the {world_size} processes joined within {join_s:.0f} s "
                f"at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({type(error).__name__}). "
                "Check that --nproc_per_node x --nnodes matches the processes you started, "
                "and that every node can reach MASTER_ADDR."
            ) from error
    _root_cache.cache_clear()
    if os.environ.get("COURSE_CHECK_DEVICE") == "1":
        _check_collective_devices(device)
    torch.manual_seed(seed + rank)
    monitor.start_requested(rank, local_rank, world_size, device)  # with --watch: this rank's sampler thread
    return local_rank, rank, device, world_size


# The collectives a lesson calls by name; with COURSE_CHECK_DEVICE=1 each checks its tensors' device first.
CHECKED_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_single", "reduce_scatter",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)  # fmt: skip
# Not seen by the check: DTensor's and FSDP2's functional collectives (torch.distributed._functional_collectives)
# do not go through these names; those paths get their device from the mesh (init_device_mesh(device.type, ...)).
collective_calls_checked = 0


def _check_collective_devices(device: torch.device):
    """Make every collective called through torch.distributed refuse a tensor that is not on `device`.

    NCCL accepts only GPU tensors and gloo only CPU ones, but their own errors do not say which tensor of
    the course's code was on the wrong device. `make test-gpu` runs every lesson this way.
    """

    def guarded(name, collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            global collective_calls_checked
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
            ops = [op for a in args if isinstance(a, list | tuple) for op in a if isinstance(op, dist.P2POp)]
            tensors += [op.tensor for op in ops]
            for tensor in tensors:
                if tensor.device.type != device.type:
                    raise CourseError(
                        f"dist.{name} got a tensor on {tensor.device}, but this rank's collectives run on "
                        f"{device}: create it on `device` (from setup()) or move it there"
                    )
            collective_calls_checked += 1
            return collective(*args, **kwargs)

        return call

    for name in CHECKED_COLLECTIVES:
        collective = getattr(dist, name)
        if not getattr(collective, "_course_checked", False):
            setattr(dist, name, guarded(name, collective))
            getattr(dist, name)._course_checked = True
    if not issubclass(dist.P2POp, _P2POpOfCheckedCalls):
        dist.P2POp = _P2POpOfCheckedCalls  # batch_isend_irecv (checked above) then checks each op's tensor


class _P2POpOfCheckedCalls(dist.P2POp):
    """dist.P2POp accepts only torch's own isend/irecv: given the checked wrappers, it keeps the function they wrap."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)


def require_world_size(world_size: int, *, divisible_by: int = 1, at_least: int = 1, why: str = ""):
    """Stop with a clear message when a lesson cannot run at this world size."""
    if world_size < at_least or world_size % divisible_by:
        need = f"at least {at_least}" + (f" and a multiple of {divisible_by}" if divisible_by > 1 else "")
        raise CourseError(
            f"this script needs a world size of {need}{' (' + why + ')' if why else ''}, "
            f"but it runs with {world_size}. Launch it with e.g. "
            f"`torchrun --nproc_per_node={max(at_least, divisible_by)} {Path(sys.argv[0]).name}`."
        )


def _lost_peer(error: BaseException) -> bool:
    """Is this the error a collective raises when another rank died, hung or skipped it?"""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        sign in text for sign in ("Timed out", "Connection closed by peer", "Connection reset by peer", "timed out")
    )


def _where_in_course_code(error: BaseException) -> str:
    """file:line of the innermost frame outside torch: the collective call the learner wrote."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "site-packages" not in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} ({frame.line})"


def run_main(main, *args, **kwargs):
    """Call `main`; turn the errors a learner can fix into one line on stderr and exit code 2.

    - a CourseError (wrong world size, missing dataset, ...) prints its message; a Refusal (an option every
      rank refuses alike) is printed by rank 0 only;
    - an unfinished TODO in an exercise, `raise NotImplementedError("TODO n: ...")`, names the TODO
      (all ranks reach it together, so the job stops at once instead of hanging in a collective);
    - a collective that failed because another rank crashed, hung or skipped it says so and where,
      instead of leaving only a traceback from inside torch.
    """
    try:
        result = main(*args, **kwargs)
        monitor.stop_running()  # with --watch: the sampler ends with the run (atexit would, later)
        # Free what main() built (models hold gloo work handles) while Python is fully alive:
        # left to interpreter shutdown, gloo's threads can abort the process after a clean run.
        gc.collect()
        return result
    except Refusal as error:
        if launcher_rank() != 0:
            time.sleep(3)  # rank 0 says it, once: its exit, not ours, should be the one the launcher sees first
            sys.exit(2)
        message = str(error)
    except CourseError as error:
        message = str(error)
    except NotImplementedError as error:
        if not str(error).startswith("TODO"):
            raise
        message = f"{error} is not done yet in {sys.argv[0]}: complete it, then run again."
    except RuntimeError as error:
        if not _lost_peer(error):
            raise
        # "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer. This is ..." -> the gist
        gist = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0]).split(". ")[0]
        timeout = os.environ.get("COURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S)
        message = (
            f"the collective at {_where_in_course_code(error)} failed ({gist}). Another rank crashed, is stuck, "
            f"or skipped this collective (timeout: COURSE_TIMEOUT_S={timeout} s); the first error printed is the cause."
        )
    print(f"[rank {launcher_rank()}] ERROR: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# --------------------------------------------------------------------------------------------------
# Rank 0 does the printing and the writing
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _root_cache() -> bool:
    return dist.get_rank() == 0


def is_root_process() -> bool:
    """True on global rank 0 (and in a program that never started a process group).

    The answer is cached once the process group exists, and only then: asking before `setup()`
    must not freeze a wrong answer.
    """
    if not dist.is_initialized():
        return launcher_rank() == 0
    return _root_cache()


def print0(*args, sep=" ", end="\n", **kwargs):
    """print() on rank 0 only, flushed so that logs interleave in order.

    The line and its end go out in one write: unbuffered (PYTHONUNBUFFERED=1, as torchrun's workers often run),
    print() writes them separately, and another rank's line can land between the two."""
    if is_root_process():
        print(sep.join(map(str, args)) + end, end="", flush=True, **kwargs)


def save0(obj, path):
    """torch.save() on rank 0 only (every rank holds the same object in data parallelism)."""
    if is_root_process():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)


# --------------------------------------------------------------------------------------------------
# DTensors and checkpoints, imported where they are used: torch.distributed.tensor and .checkpoint cost every
# process about a second of CPU time at start-up, which a lesson without DTensors has no use for
# --------------------------------------------------------------------------------------------------


def loaded_dtensor_class():
    """DTensor's class where the program imported it, else None: a program that never imported it holds none
    (importing it costs a second of start-up on every rank)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(tensor) -> bool:
    """isinstance(tensor, DTensor), without importing DTensor."""
    dtensor = loaded_dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def save_full_model(model, optimizer, path):
    """Gather the full (unsharded) model and optimizer state to rank 0's CPU and save them there.

    Works for a plain module, DDP and FSDP2 alike. Every rank must call it: with sharded models
    gathering is a collective. The file loads with plain `torch.load` on one process.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    save0({"model": model_state, "optimizer": optimizer_state}, path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads the file before rank 0 has finished writing it


class AppState:
    """What a distributed checkpoint holds: the model and its optimizer, as (sharded) state dicts.

    DCP calls state_dict() when saving and load_state_dict() when loading (it recognises the two methods: DCP's
    Stateful is a protocol, not a base class to inherit); get/set_state_dict
    translate between the wrapped (DDP/FSDP) parameter names and plain ones, which is what
    lets a checkpoint written by 4 ranks load on 2.
    """

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer or [])
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer or [],
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


def save_sharded_model(model, optimizer, checkpoint_dir):
    """Each rank writes its own shards to `checkpoint_dir` (a folder, one file per rank)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=str(checkpoint_dir))


def load_sharded_model(model, optimizer, checkpoint_dir):
    """Load a sharded checkpoint into `model`/`optimizer`, whatever world size wrote it."""
    if not (Path(checkpoint_dir) / ".metadata").exists():
        raise CourseError(f"no distributed checkpoint in {checkpoint_dir} (its .metadata file is missing)")
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=str(checkpoint_dir))


# --------------------------------------------------------------------------------------------------
# Teardown
# --------------------------------------------------------------------------------------------------


def wait_for_idle_threads(limit_s: float = 2.0):
    """Return once every other thread of this process sleeps, or after limit_s (Linux; elsewhere, after a short
    pause). A thread that never sleeps costs limit_s, never a hang.

    After a gloo collective returns, its worker thread still drops the collective's tensors, and
    dropping a tensor Python made takes the GIL. A thread that asks for the GIL while Python is
    shutting down is ended by Python, and that aborts the process ("terminate called without an
    active exception"). Sleeping here hands the GIL over; a busy machine may not run that thread
    at once, so wait until no thread but this one is running or ready to run."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        time.sleep(0.1)
        return
    me, deadline, quiet = str(threading.get_native_id()), time.monotonic() + limit_s, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.005)  # releases the GIL to a thread that waits for it
        busy = False
        for task in tasks.iterdir():
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended while we looked
            busy |= task.name != me and state == "R"
        quiet = 0 if busy else quiet + 1


def destroy_process_group():
    """Leave the process group cleanly.

    The barrier first: with gloo, a rank that tears down while another is still using the group
    crashes at random ("terminate called without an active exception"). Then wait for gloo's own
    threads to finish with the last collective (see wait_for_idle_threads); on every backend, as a
    GPU job may have gloo groups too (lesson 08's checkpoint group).
    """
    if dist.is_initialized():
        if os.environ.get("COURSE_CHECK_DEVICE") == "1":
            print(f"[rank {dist.get_rank()}] device check: {collective_calls_checked} collective calls", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        wait_for_idle_threads()
    _root_cache.cache_clear()
