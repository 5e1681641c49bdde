"""Lesson 06's notebook: a small scaling study on this machine's CPU, written to one JSON file.

    python -m tests.workers.three_d_notebook_scaling notebooks/data/06_scaling.json

Runs solutions/06_3d_parallelism.py at a fixed global batch on 1, 2 and 4 processes as pure data parallelism
(tp=1 pp=1), and on 2 and 4 processes with tensor parallelism (tp=2), each run's metrics kept whole, as an sbatch
sweep would leave them in its folder. The file also records where and how they were measured (machine, cores,
load average before and after, versions, date, command) and marks itself "loaded" when the load shows other
jobs than its own: then its figures show what the report does, not how fast the machine is.
"""

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from utils.course.measured import cpu_name, loaded_and_warned, wait_until_quiet
from utils.course.notebook import torchrun

SCRIPT = "solutions/06_3d_parallelism.py"
GLOBAL_BATCH = 16  # sequences per step, however many processes share them
MODEL = ["--dim", "64", "--n-layers", "4", "--n-heads", "4", "--seq-len", "64", "--steps", "6", "--optimizer", "sgd"]
SWEEP = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]  # (processes, tp); pp = 1, dp = processes / tp


def main(out: Path):
    cores, runs = os.cpu_count(), []
    load_before = wait_until_quiet()
    for nproc, tp in SWEEP:
        per_replica = GLOBAL_BATCH * tp // nproc  # dp = nproc / tp replicas share the global batch
        args = [*MODEL, "--tp", tp, "--pp", 1, "--batch-size", per_replica, "--log-dir", "runs/06_scaling"]
        metrics = torchrun(SCRIPT, nproc, args, show=False)
        metrics["command"] = f"torchrun --nproc_per_node={nproc} {SCRIPT} " + " ".join(map(str, args))
        metrics["hosts"] = ["this machine"] * nproc  # the host name is not the point (and not stable)
        runs.append(metrics)
        print(f"{nproc} processes, tp={tp}: {metrics['tokens_per_s']:,.0f} tokens/s", flush=True)
    load_after = os.getloadavg()[0]
    record = {
        "what": "solutions/06_3d_parallelism.py at a fixed global batch on 1, 2, 4 CPU processes (gloo)",
        "machine": {"cpu": cpu_name(), "cores": cores, "os": f"{platform.system()} {platform.release()}"},
        "load_average_1min": {"before": load_before, "after": load_after},
        "loaded": loaded_and_warned(load_before, load_after, max(nproc for nproc, _ in SWEEP), out),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "command": f"OMP_NUM_THREADS=1 python -m tests.workers.three_d_notebook_scaling {out}",
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} (loaded: {record['loaded']})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.workers.three_d_notebook_scaling OUT.json")
    main(Path(sys.argv[1]))
