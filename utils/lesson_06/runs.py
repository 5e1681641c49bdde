"""The notebook's runs: a lesson script launched with torchrun, rank 0's output shown without its timings."""

import contextlib
import io

from utils.course.notebook import torchrun


def launch(nproc: int, args: list, checkpoint, show: bool = False, script: str = "solutions/06_3d_parallelism.py"):
    """Run `script` on `nproc` processes, saving its full model to `checkpoint`; return its metrics. show: print rank
    0's output without the lines that carry a timing (they differ from run to run)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = torchrun(script, nproc, [*args, "--checkpoint", checkpoint])
    if show:
        print("\n".join(line for line in out.getvalue().splitlines() if not ("tokens/s" in line or "saved" in line)))
    return metrics
