"""Re-execute notebooks in place, the way their committed outputs are made (maintainers; `make outputs`).

    python -m utils.course.refresh_notebook notebooks/02_data_parallel.ipynb [more notebooks]

Each notebook runs top to bottom in a fresh kernel started in its own folder, on the CPU (gloo), one thread per
process (torch's own threads would otherwise compete with the ranks for the cores). One difference from running
every cell at once: before a cell tagged `quiet-before` (one that reads the load average, then starts the runs it
times), wait until the machine is quiet. Otherwise the notebook's own earlier cells are still in the 1-minute
average, and the timing is marked LOADED although no other job ran; a learner who reads between cells gets the
quiet machine this gives. Only the tagged cells wait: a cell that reads the load after earlier cells' runs must
see the load those runs had.
"""

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from utils.course.measured import QUIET, load_average, wait_until_quiet

TAG = "quiet-before"  # in a cell's metadata: wait for a quiet machine before running it


class QuietBeforeTimings(NotebookClient):
    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type == "code" and TAG in cell.metadata.get("tags", []):
            start = time.monotonic()
            load = wait_until_quiet()
            quiet = "" if load < QUIET / 2 else f" (still {load_average()}: not quiet, the cell will say so)"
            waited = time.monotonic() - start
            print(f"  cell {cell_index}: waited {waited:.0f} s for a quiet machine{quiet}", flush=True)
        return await super().async_execute_cell(cell, cell_index, execution_count, store_history)


def refresh(path: Path):
    notebook = nbformat.read(path, as_version=4)
    start = time.monotonic()
    where = {"metadata": {"path": str(path.parent)}}  # the kernel starts in the notebook's folder
    client = QuietBeforeTimings(notebook, timeout=1800, kernel_name="python3", resources=where)
    client.execute()
    nbformat.write(notebook, path)
    print(f"{path}: executed in {time.monotonic() - start:.0f} s", flush=True)


def main():
    paths = [Path(arg) for arg in sys.argv[1:]]
    if not paths or not all(path.suffix == ".ipynb" and path.exists() for path in paths):
        sys.exit("usage: python -m utils.course.refresh_notebook notebooks/NN_name.ipynb [...]")
    # The committed outputs are CPU runs (gloo), one thread per rank, as `make notebooks` checks them.
    os.environ.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    for path in paths:
        refresh(path)


if __name__ == "__main__":
    main()
