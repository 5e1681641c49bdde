"""The lesson script launched for a table: one configuration at a time, its metrics and, when profiled, its traces."""

import os
import time
from pathlib import Path

from utils.course.measured import conditions, load_average, loaded_and_warned
from utils.course.notebook import torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "solutions/11_where_the_time_goes.py"


def launch(nproc: int, args: list, show: bool = False) -> dict:
    """The lesson script on nproc processes (torchrun itself: each measurement sees the processes a learner starts)."""
    return torchrun(SCRIPT, nproc, [*map(str, args)], show=show, cold=True)


def mean_over_ranks(metrics: dict, key: str) -> float:
    values = [rank[key] for rank in metrics["per_rank"]]
    return sum(values) / len(values)


def memory_per_rank(metrics: dict) -> int:
    """The most bytes any rank held at a step's peak: its model state (parameters, gradients, optimizer state) and
    what the step allocated above it (activations, temporaries)."""
    return max(r["params"] + r["grads"] + r["optimizer"] + r["peak_step_bytes"] for r in metrics["per_rank"])


def bf16_instructions() -> list[str]:
    """The CPU's bf16 instructions (Linux's /proc/cpuinfo flags: avx512_bf16, amx_bf16), which decide what bf16
    autocast costs on a CPU; [] where there are none or the flags cannot be read."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(flag for flag in flags.split(":", 1)[1].split() if flag in ("avx512_bf16", "amx_bf16"))


def provenance(what: str, command: str, started_load: float, ours: int, path) -> dict:
    """Where a data file's figures came from (utils/course/measured.py): machine, load, versions, date, command."""
    import platform
    import sys

    import torch

    from utils.course.measured import cpu_name

    after = os.getloadavg()[0]
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "system": platform.system(), "torch": torch.__version__,
               "python": sys.version.split()[0], "bf16_instructions": bf16_instructions()}  # fmt: skip
    return {
        "machine": machine,
        "what": what, "command": command, "conditions": conditions(f"{started_load:.1f}", command),
        "load_average_1min": {"before": started_load, "after": after, "now": load_average()},
        "loaded": loaded_and_warned(started_load, after, ours, path), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }  # fmt: skip
