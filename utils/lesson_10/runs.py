"""The notebook's runs of the lesson script: launched with one line each, and the refusal of what cannot run."""

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

from utils.course.notebook import torchrun

ROOT = Path(__file__).resolve().parents[2]


def launcher(script: str, common: list, saved: Path):
    """launch(nproc, *args, name, show=False) -> the run's metrics: `script` with the options `common` then `args`,
    its full model saved to saved / f"{name}.pt"; show=True prints rank 0's output without the lines that carry a
    timing (tokens/s) or a path (the checkpoint saved)."""

    def launch(nproc: int, *args, name: str, show: bool = False) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            metrics = torchrun(script, nproc, [*common, *args, "--checkpoint", saved / f"{name}.pt"])
        if show:
            lines = out.getvalue().splitlines()
            print("\n".join(line for line in lines if "tokens/s" not in line and "saved" not in line))
        return metrics

    return launch


def refusal(script: str, nproc: int, args: list) -> tuple[int, str]:
    """(torchrun's exit code, the one ERROR line) of a run the script refuses: `script` with `args` on `nproc`
    processes."""
    refused = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         str(ROOT / script), *map(str, args)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    line = next(line for line in refused.stderr.splitlines() if "ERROR:" in line)
    return refused.returncode, re.search(r"ERROR: (?:(?!ERROR:|\[rank).)*", line).group(0)  # ranks' lines can merge
