"""How much host memory a process holds for its data: RSS (every page it touches) and PSS (its share: a page
that k processes map counts 1/k in each), without the code every Python process maps."""

import ctypes
import gc
import os
import resource
import sys
from pathlib import Path


def rss_mb() -> float:
    """This process's resident memory now, in MB (VmRSS on Linux; peak RSS elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if os.uname().sysname == "Darwin" else peak / 1024


def memory_mb() -> dict:
    """The memory this process holds for its data now, in MB: rss (every page it touches, shared ones included)
    and pss (its share: a page that k processes map counts 1/k in each), summed over /proc/self/smaps (Linux;
    elsewhere both are the whole process's RSS).

    Program and library files (Python's and torch's code) are left out: every Python process on the machine maps
    them, so this process's share of them changes whenever another process starts or stops, whatever it holds.
    Freed memory is handed back first (release_freed_memory), so it is not counted.
    """
    release_freed_memory()
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return {"rss": rss_mb(), "pss": rss_mb()}
    totals, counted = {"rss": 0.0, "pss": 0.0}, True
    for line in smaps.read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if not first.endswith(":"):  # a mapping's header: address range, permissions, offset, device, inode, path
            fields = line.split(maxsplit=5)
            counted = not is_code_file(fields[5] if len(fields) > 5 else "")
        elif counted and first in ("Rss:", "Pss:"):
            totals[first[:-1].lower()] += int(line.split()[1]) / 1024
    return totals


PYTHON_EXECUTABLE = os.path.realpath(sys.executable)  # as /proc/self/smaps names it


def is_code_file(mapped_path: str) -> bool:
    """A shared library or the Python executable (mapped by every Python process), not data."""
    name = Path(mapped_path).name
    return name.endswith(".so") or ".so." in name or mapped_path == PYTHON_EXECUTABLE


def release_freed_memory():
    """Collect garbage, then hand the heap's freed pages back to the OS: glibc keeps them for reuse otherwise, so a
    reading would count memory already freed (more of it in a process that once freed a large block, as rank 0 does
    after writing the token file) or lose some in the middle of a measurement. memory_mb() calls it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
