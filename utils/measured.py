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
        "A load above the core count means other jobs shared the cores: these are not the machine's speed."
    )
