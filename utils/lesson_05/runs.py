"""Lesson 05's runs from the notebook: the lesson script launched with the notebook's common arguments, rank 0's
output shown without the lines that change from run to run, and each named run's full model kept so that runs can
be compared parameter by parameter.

    lesson = Runs(COMMON)
    metrics = lesson.launch(2, "--schedule", "gpipe", name="scratch GPipe", show=True)
    weights = lesson.parameters("scratch GPipe")       # {name: tensor}, the stages gathered
"""

import contextlib
import io
import tempfile
from pathlib import Path

import torch

from utils.course.notebook import torchrun

VARYING = ("tokens/s", "measured", "saved the model")  # lines that carry timings or a temporary path


class Runs:
    def __init__(self, common: list):
        self.common = common
        self.folder = Path(tempfile.mkdtemp())  # each named run's full model

    def launch(self, nproc: int, *args, show=False, name=None, script="solutions/05_pipeline_parallel.py") -> dict:
        """Run `script` on nproc processes with the common arguments and `args`; returns its metrics."""
        out = io.StringIO()
        keep = ["--checkpoint", self.folder / f"{name}.pt"] if name else []
        with contextlib.redirect_stdout(out):
            metrics = torchrun(script, nproc, [*self.common, *args, *keep])
        if show:
            print("\n".join(line for line in out.getvalue().splitlines() if not any(word in line for word in VARYING)))
        return metrics

    def parameters(self, name: str) -> dict:
        """The full model that the run `name` saved."""
        return torch.load(self.folder / f"{name}.pt", weights_only=True)["model"]
