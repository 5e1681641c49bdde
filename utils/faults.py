"""Fault injection for lesson 08's tests and notebook: kill a rank the way a failure does, slow a step or a save.

None of this is part of the technique: a real job is killed by the kernel, a failed node or the scheduler, and
saves slowly because its model is large. These helpers let a test make each of those happen at a chosen moment
on a tiny model, in seconds.
"""

import os
import signal
import time
from pathlib import Path

KILLED_AT = "killed-at"  # a file in the checkpoint folder: when crash() struck, for the restarted run's restart time


def crash(rank: int, where: str, checkpoint_dir: Path):
    """SIGKILL this process, as the kernel's OOM killer or a failed node would (no handler, no clean-up runs)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / KILLED_AT).write_text(f"{time.time()!r}\n")
    print(f"[rank {rank}] killed with SIGKILL {where}\n", end="", flush=True)  # one write: whole among the ranks' lines
    os.kill(os.getpid(), signal.SIGKILL)


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
