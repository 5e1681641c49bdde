"""The notebook's training runs: each launched once with the same model and steps, its metrics kept by name.

runs = Runs(["--dim", 32, ...])                              # the options every run shares
runs.launch("1 process (lesson 00)", "solutions/00_setup_and_baseline.py", 1)
runs.tp(2, "scratch", sp=True)                              # lesson 04 at TP 2, hand-written, with SP
runs["TP 2, scratch + SP"]["final_loss"], runs.checkpoints[name]   # its metrics, and the full model it saved
"""

import contextlib
import io
import tempfile
from pathlib import Path

from utils.course.notebook import torchrun


class Runs(dict):
    """{run name: its metrics}; each run also saves its full model, at checkpoints[name]."""

    def __init__(self, common: list):
        super().__init__()
        self.common = list(common)
        self.checkpoints = {}
        self._folder = tempfile.TemporaryDirectory()

    def launch(self, name: str, script: str, nproc: int, *args, show: bool = False) -> dict:
        """Run a script; print rank 0's output without the timing and file lines (they change run to run)."""
        self.checkpoints[name] = Path(self._folder.name) / f"run{len(self.checkpoints)}.pt"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            metrics = torchrun(script, nproc, [*self.common, *args, "--checkpoint", self.checkpoints[name]])
        if show:
            print(
                "\n".join(
                    line for line in out.getvalue().splitlines() if "tokens/s" not in line and "saved" not in line
                )
            )
        self[name] = metrics
        return metrics

    def tp(self, n: int, impl: str, sp: bool = False, show: bool = False) -> dict:
        """Lesson 04 on n ranks, --tp-impl `impl`, with --sequence-parallel when `sp`: the run "TP n, impl[ + SP]"."""
        name = f"TP {n}, {impl}" + (" + SP" if sp else "")
        extra = ["--tp-impl", impl] + (["--sequence-parallel"] if sp else [])
        return self.launch(name, "solutions/04_tensor_parallel.py", n, *extra, show=show)
