"""`make test-floor`: every lesson's script under the oldest torch the course supports, against the tested one.

Clusters lag behind PyTorch's newest release, so requirements.txt admits a range. The whole suite (notebooks
included) runs on the tested release in `.venv`; this check runs each lesson's solution at 2 ranks on the
CPU under the floor release (`.venv-floor`, this interpreter) and under `--reference` (`.venv`'s python),
and requires the same losses from both.

    .venv-floor/bin/python -m tests.harness.floor_check --reference .venv/bin/python [--lessons 03 05]
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.harness.launch import ROOT, course_env, torchrun

LOSS_RTOL = 1e-5  # the same fp32 SGD steps on two torch releases: rounding, not algorithm, may differ
SMALL = ["--steps", "3", "--optimizer", "sgd", "--log-every", "1"]
RUNS = {  # lesson: (processes, arguments)
    "00": (1, SMALL),  # lesson 00 is the single-process baseline
    "01": (2, ["--skip-benchmark"]),  # the collectives and the hand-written all-reduces, not their timings
    "02": (2, [*SMALL, "--ddp", "scratch"]),
    "03": (2, [*SMALL, "--strategy", "all"]),
    "04": (2, [*SMALL, "--tp-impl", "dtensor", "--sequence-parallel"]),
    "05": (2, [*SMALL, "--pp-impl", "builtin", "--schedule", "1f1b"]),
    "06": (2, [*SMALL, "--impl", "builtin", "--pp", "2", "--schedule", "gpipe"]),  # DeviceMesh, FSDP2, pipelining
    "07": (2, [*SMALL, "--method", "powersgd"]),
    "08": (2, [*SMALL, "--checkpoint-every", "2"]),
    "09": (2, [*SMALL, "--impl", "ring", "--cp-split", "zigzag"]),  # the ring: batch_isend_irecv, its Function
    "10": (2, [*SMALL, "--impl", "builtin", "--dispatch", "padded"]),  # all_to_all_single's autograd form
    # FSDP2's explicit prefetch and selective checkpointing's policy, profiled (the trace's events by name)
    "11": (2, [*SMALL, "--strategy", "fsdp", "--prefetch", "explicit", "--checkpointing", "selective"]),
}


def version_of(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def launch(python: str, script: Path, nproc: int, args: list, folder: Path):
    extra = ["--checkpoint-dir", folder / "checkpoints"] if script.name.startswith("08_") else []
    if not script.name.startswith("01_"):
        extra += ["--log-dir", folder / "runs"]
    return torchrun(script, nproc, [*args, *extra], tmp_path=folder, timeout=300,
                    env=course_env(CUDA_VISIBLE_DEVICES=""), python=python)  # fmt: skip


def collective_results(output: str) -> list[str]:
    """Lesson 01's printed results: each rank's tensors before and after each collective, and the verdicts."""
    return [line.strip() for line in output.splitlines() if re.match(r"\s+rank \d+: |.* dist.all_reduce$", line)]


def check(number: str, reference_python: str, tmp: Path) -> list[str]:
    script = next((ROOT / "solutions").glob(f"{number[:2]}_*.py"))  # a key "NN-x": a second run of lesson NN
    nproc, args = RUNS[number]
    floor = launch(sys.executable, script, nproc, args, tmp / number / "floor")
    if floor.returncode != 0 or floor.metrics is None:
        return [f"failed under torch {torch.__version__} (exit {floor.returncode}):\n{floor.tail(20)}"]
    reference = launch(reference_python, script, nproc, args, tmp / number / "reference")
    if reference.returncode != 0 or reference.metrics is None:
        return [f"failed under the reference torch (exit {reference.returncode}):\n{reference.tail(20)}"]
    ours, theirs = floor.metrics.get("losses"), reference.metrics.get("losses")
    if ours is None and theirs is None:  # lesson 01 trains nothing: compare what its collectives computed
        ours, theirs = collective_results(floor.output), collective_results(reference.output)
        return [] if ours and ours == theirs else [f"the collectives' results differ:\n{ours}\nvs\n{theirs}"]
    if ours is None or theirs is None or len(ours) != len(theirs) or not ours:
        return [f"the losses were not recorded alike: {ours} vs {theirs}"]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))
    return (
        []
        if worst <= LOSS_RTOL
        else [f"losses differ by up to {worst:.1e} (allowed {LOSS_RTOL:.0e}): {ours} vs {theirs}"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="the python of the environment with the tested torch")
    parser.add_argument("--lessons", nargs="*", default=sorted(RUNS))
    args = parser.parse_args()
    print(f"floor torch {torch.__version__} vs reference torch {version_of(args.reference)}, on the CPU", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for number in args.lessons:
            problems = check(number, args.reference, Path(tmp))
            failed += bool(problems)
            print(f"lesson {number}: " + ("same losses" if not problems else "FAILED\n  " + "\n  ".join(problems)),
                  flush=True)  # fmt: skip
    print(f"{len(args.lessons) - failed} of {len(args.lessons)} lessons ran alike on torch {torch.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
