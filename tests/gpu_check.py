"""`make test-gpu`: every lesson's solution with NCCL on this node's GPUs, checked against the same run on CPU.

For instructors with a GPU node (world size = the number of visible GPUs, at least 1). For each lesson:
- the run completes and writes its metrics file;
- every collective the course's code called got tensors on the rank's CUDA device (COURSE_CHECK_DEVICE=1
  makes each one check, and each rank reports how many it checked);
- its losses match the CPU/gloo run of the same configuration within LOSS_RTOL (fp32 and SGD, with TF32
  off: a GPU and a CPU sum in different orders, so they agree to rounding, not to the bit).
With --figures it also measures tokens/s of lesson 00's baseline and of the GPU_EXAMPLE configuration
(bf16 autocast) on one GPU, with the model FLOPs utilisation, and writes them to notebooks/data/gpu_figures.json.

    python -m tests.gpu_check [--figures] [--lessons 00 02]
Without a GPU it stops at once with one line saying so: it never passes silently.
"""

import argparse
import json
import platform
import re
import sys
from pathlib import Path

import torch

from tests.launch import ROOT, course_env, torchrun
from utils.model import GPU_EXAMPLE, TINY, flops_per_token

LOSS_RTOL = 1e-4  # relative difference of each logged loss, GPU vs CPU, after a few fp32 SGD steps
SMALL = ["--steps", "5", "--optimizer", "sgd", "--log-every", "1"]
RUNS = {  # lesson: (processes: "gpus" or a number, arguments)
    "00": (1, SMALL),  # the single-device baseline
    "01": ("gpus", ["--sizes", "4K,64K", "--steps", "2"]),
    "02": ("gpus", SMALL),
    "03": ("gpus", SMALL),
    "04": ("gpus", SMALL),
    "05": ("gpus", SMALL),
    "07": ("gpus", SMALL),
    "08": ("gpus", SMALL),
}
# Peak dense bf16 FLOP/s from the vendors' data sheets, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def lesson_script(number: str) -> Path | None:
    return next(iter(sorted((ROOT / "solutions").glob(f"{number}_*.py"))), None)


def check_lesson(number: str, gpus: int, tmp: Path) -> list[str]:
    """Problems found for one lesson (empty: it passed)."""
    script = lesson_script(number)
    if script is None:
        return [f"no solutions/{number}_*.py"]
    nproc, args = RUNS[number]
    nproc = gpus if nproc == "gpus" else nproc
    env_gpu = course_env(COURSE_CHECK_DEVICE=1, NVIDIA_TF32_OVERRIDE=0, COURSE_TIMEOUT_S=120)
    args = [*args, "--log-dir", tmp / number / "runs"]
    gpu = torchrun(script, nproc, args, tmp_path=tmp / number / "gpu", env=env_gpu, timeout=600)
    if gpu.returncode != 0 or gpu.metrics is None:
        return [f"the GPU run failed (exit {gpu.returncode}):\n{gpu.tail(20)}"]
    problems = []
    checked = re.findall(r"\[rank (\d+)\] device check: (\d+) collective calls", gpu.output)
    if len(checked) != nproc:
        problems.append(f"{len(checked)} of {nproc} ranks reported their collectives' device check")
    cpu = torchrun(script, nproc, args, tmp_path=tmp / number / "cpu", env=course_env(CUDA_VISIBLE_DEVICES=""))
    if cpu.returncode != 0 or cpu.metrics is None:
        return problems + [f"the CPU run failed (exit {cpu.returncode}):\n{cpu.tail(20)}"]
    gpu_losses, cpu_losses = gpu.metrics.get("losses"), cpu.metrics.get("losses")
    if gpu_losses is not None:
        worst = max(abs(g - c) / max(abs(c), 1e-12) for g, c in zip(gpu_losses, cpu_losses))
        if len(gpu_losses) != len(cpu_losses) or worst > LOSS_RTOL:
            problems.append(f"losses differ from the CPU run by up to {worst:.1e} (allowed {LOSS_RTOL:.0e})")
    return problems


def measure_figures(tmp: Path) -> dict:
    """tokens/s and MFU of lesson 00 on one GPU: the tiny model, and GPU_EXAMPLE with bf16 autocast."""
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
    configs = {
        "TINY fp32": (TINY, ["--steps", "100"]),
        "GPU_EXAMPLE bf16 autocast": (
            GPU_EXAMPLE,
            ["--steps", "50", "--batch-size", "16", "--autocast", "bf16", "--dim", "512", "--n-layers", "8",
             "--n-heads", "8", "--seq-len", "1024"],
        ),
    }  # fmt: skip
    rows = []
    for label, (config, args) in configs.items():
        run = torchrun(lesson_script("00"), 1, [*args, "--log-dir", tmp / "figures"], tmp_path=tmp / "figures")
        run.check()
        tokens_per_s = run.metrics["tokens_per_s"]
        achieved = tokens_per_s * flops_per_token(config)
        rows.append(
            {
                "configuration": label,
                "tokens_per_s": tokens_per_s,
                "flops_per_token": flops_per_token(config),
                "achieved_tflops": achieved / 1e12,
                "mfu_vs_bf16_peak": achieved / peak if peak else None,
            }
        )
    return {
        "gpu": name,
        "peak_bf16_flops": peak,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", nargs="*", default=sorted(RUNS), help="lesson numbers (default: all)")
    parser.add_argument("--figures", action="store_true", help="also measure tokens/s and MFU on one GPU")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="where runs write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it on a GPU node")
        return 2
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = 0
    for number in args.lessons:
        problems = check_lesson(number, gpus, args.out)
        failed += bool(problems)
        print(f"lesson {number}: " + ("ok" if not problems else "FAILED\n  " + "\n  ".join(problems)), flush=True)
    if args.figures:
        figures = measure_figures(args.out)
        path = ROOT / "notebooks" / "data" / "gpu_figures.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(json.dumps(figures, indent=2))
    print(f"{len(args.lessons) - failed} of {len(args.lessons)} lessons passed on the GPU")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
