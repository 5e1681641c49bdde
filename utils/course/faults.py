"""Fault injection for the tests and notebooks: kill a rank the way a failure does, slow a step or a save.

Lesson 08 kills a rank between steps (`crash`); lesson 05 kills one in the middle of a pipeline schedule
(`crash_before_backward`), while its neighbours wait for its tensors.

None of this is part of the technique: a real job is killed by the kernel, a failed node or the scheduler, and
saves slowly because its model is large. These helpers let a test make each of those happen at a chosen moment
on a tiny model, in seconds.
"""

import os
import signal
import sys
import time
from pathlib import Path

KILLED_AT = "killed-at"  # a file in the checkpoint folder: when crash() struck, for the restarted run's restart time


def crash(rank: int, where: str, checkpoint_dir: Path):
    """SIGKILL this process, as the kernel's OOM killer or a failed node would (no handler, no clean-up runs)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / KILLED_AT).write_text(f"{time.time()!r}\n")
    print(f"[rank {rank}] killed with SIGKILL {where}\n", end="", flush=True)  # one write: whole among the ranks' lines
    os.kill(os.getpid(), signal.SIGKILL)


def crash_before_backward(module, rank: int):
    """Make this process exit (code 3) when the next backward reaches `module`'s output: in the middle of a
    pipeline schedule, after its forwards, while a neighbour waits for the gradient this rank would send."""

    def exit_now(*_):
        print(f"[rank {rank}] crashing on purpose before a backward (--crash-at-step)", file=sys.stderr, flush=True)
        os._exit(3)

    module.register_full_backward_pre_hook(exit_now)


def seconds_since_kill(checkpoint_dir: Path) -> float | None:
    """Seconds since crash() killed a rank of this run (None if it did not); forgets it once read on rank 0."""
    killed_at = checkpoint_dir / KILLED_AT
    if not killed_at.exists():
        return None
    return time.time() - float(killed_at.read_text())


def forget_kill(checkpoint_dir: Path):
    (checkpoint_dir / KILLED_AT).unlink(missing_ok=True)


def pause(seconds: float):
    """Stand in for work that takes long on a large model (a step, writing a checkpoint of hundreds of GB).

    Sleeps in short slices, so that a signal handler runs on time (Python runs handlers between bytecodes)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.05, max(end - time.monotonic(), 0)))
