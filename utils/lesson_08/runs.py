"""The notebook's runs of solutions/08_fault_tolerance.py: torchrun --standalone --max-restarts=N, one folder each."""

import json
import os
import subprocess
import sys
from pathlib import Path

from utils.training import ROOT


class Launcher:
    """launch(name, *options, restarts=0, nproc=2, show=()) -> (metrics, checkpoint folder): the lesson's script
    with `common` options and its own folder under `work`; prints rank 0's lines that contain one of `show`."""

    def __init__(self, script: Path, work: Path, common: list):
        self.script, self.work, self.common = script, work, common

    def __call__(self, name: str, *args, restarts: int = 0, nproc: int = 2, show=()) -> tuple[dict, Path]:
        """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives restarted workers a fresh TCP store (else they can read the
        addresses of the workers that died, and fail to connect). torchrun reads this variable but does not
        document it: check that it still exists when you upgrade torch."""
        folder = self.work / name
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", str(self.script), *map(str, self.common), *map(str, args),
            "--checkpoint-dir", str(folder / "checkpoints"), "--metrics-out", str(folder / "metrics.json"),
            "--log-dir", str(folder / "runs"),
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "COURSE_NO_PROGRESS": "1",
        }
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
        for line in done.stdout.splitlines():
            if any(word in line for word in show):
                print(line.replace(str(self.work), "WORK"))
        return json.loads((folder / "metrics.json").read_text()), folder / "checkpoints"
