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

ROOT = Path(__file__).resolve().parents[1]


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
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if show:
            print(result.stdout, end="")
        if result.returncode != 0:
            tail = "\n".join(result.stderr.splitlines()[-15:])
            raise RuntimeError(f"{script} failed (exit code {result.returncode}):\n{tail}")
        return json.loads(metrics_path.read_text())
