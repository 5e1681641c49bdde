"""Run the lesson scripts from a notebook cell, the way you would in a terminal.

    from utils.notebook import torchrun
    metrics = torchrun("solutions/01_collectives.py", nproc=4, args=["--steps", "5"])

is `torchrun --nproc_per_node=4 solutions/01_collectives.py --steps 5 --metrics-out ...`, printing
what rank 0 prints and returning the script's metrics file as a dict.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def kill_tree(pid: int):
    """Kill torchrun and every rank it started (the ranks run in sessions of their own)."""
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def torchrun(script, nproc: int = 2, args=(), *, show: bool = True, timeout: float = 300) -> dict:
    """Launch `script` (a path relative to the course root) with `nproc` processes; return its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics_path = Path(tmp) / "metrics.json"
        command = [
            sys.executable, "-m", "torch.distributed.run",  # torchrun, from this notebook's environment
            "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / script), *map(str, args), "--metrics-out", str(metrics_path),
        ]  # fmt: skip
        # One thread per process: the ranks share the machine's cores (and torchrun stays quiet).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        process = subprocess.Popen(command, cwd=ROOT, env=env, text=True, **pipes)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            raise RuntimeError(f"{script} did not finish within {timeout} s: stopped it and its ranks") from None
        if show:
            print(stdout, end="")
        if process.returncode != 0:
            tail = "\n".join(stderr.splitlines()[-15:])
            raise RuntimeError(f"{script} failed (exit code {process.returncode}):\n{tail}")
        return json.loads(metrics_path.read_text())
