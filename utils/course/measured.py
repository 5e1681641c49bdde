"""Where a timing came from: the line a notebook prints beside every figure it measured.

A time measured on a shared machine says little about the machine: the same step took 10x longer on it while
other jobs ran. So every timing cell says where, when and under what load it was taken, and with what.
"""

import os
import platform
import sys
import time

import torch


def load_average() -> str:
    """The 1-minute load average (runnable processes) against the core count, e.g. '3.4 on 2 cores'."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def conditions(load_before: str, command: str) -> str:
    """One paragraph: machine, cores, load before and after, versions, date and the command measured."""
    return (
        f"measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {cpu_name()} ({os.cpu_count()} cores, "
        f"{platform.system()}), load average {load_before} before the runs and {load_average()} after; "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; command: {command}. "
        "The load counts runnable processes: more than our own processes explain (by over half a core) means other "
        "jobs shared the cores, and such figures (marked LOADED) are not the machine's speed."
    )


QUIET = 0.5  # runnable processes of other jobs a measurement accepts: half a core


def wait_until_quiet(timeout_s: float = 240.0) -> float:
    """Wait up to timeout_s for the 1-minute load average to fall below QUIET / 2, and return it.

    A previous run's processes stay in the 1-minute average for a minute or two after they end, so a benchmark
    that follows another one waits for them to leave it before it reads the load "before" its own runs."""
    deadline = time.monotonic() + timeout_s
    # Half of QUIET: our own processes, starting, add to the average the benchmark reads next.
    while os.getloadavg()[0] >= QUIET / 2 and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def others_loaded(before: float, after: float, ours: int) -> bool:
    """Did other jobs share the cores? `before`: the load average before our processes ran (or as they started);
    `after`: right after, when up to `ours` of the runnable processes it counts were our own."""
    return max(before, after - ours) > QUIET


def loaded_and_warned(before: float, after: float, ours: int, path) -> bool:
    """others_loaded(), and when it is true a loud line on stderr: the figures written to `path` were taken while
    other jobs shared the cores, and the file is marked `"loaded": true` (notebooks label such figures)."""
    loaded = others_loaded(before, after, ours)
    if loaded:
        print(
            f"WARNING: load average {before:.1f} before and {after:.1f} after ({ours} processes of ours, "
            f"{os.cpu_count()} cores): other jobs shared the cores; {path} is marked loaded, not the machine's speed. "
            "Measure again on a quiet machine.",
            file=sys.stderr,
            flush=True,
        )
    return loaded
