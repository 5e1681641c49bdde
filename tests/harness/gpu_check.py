"""`make test-gpu`: every lesson's solution with NCCL on this node's GPUs, checked against the same run on CPU.

For instructors with a GPU node (world size = the number of visible GPUs, at least 1). For each lesson and
each of its strategies, methods, schedules and implementations (CHECKS below):
- the run completes and writes its metrics file;
- every collective the course's code called got tensors on the rank's CUDA device (COURSE_CHECK_DEVICE=1
  makes each one check, and each rank reports how many it checked);
- its losses match the CPU/gloo run of the same configuration within the check's tolerance (fp32 and SGD,
  with TF32 off: a GPU and a CPU sum in different orders, so they agree to rounding, not to the bit);
- lesson 08: a rank SIGKILLed mid-run under `torchrun --max-restarts 1` resumes to the bit-identical
  losses and parameters of the uninterrupted GPU run;
- --watch: NVML's utilization, memory and power of every visible GPU, torch.cuda's peak, and the job report.
On a node with one GPU every check runs at world size 1 (NCCL refuses two ranks on one GPU: the first
line printed says what this node allows), so it proves devices, dtypes and NCCL calls, not multi-rank
parity; the CPU test suite proves that.

With --figures it also measures, on one GPU, tokens/s and model FLOPs utilisation of lesson 00's model
sizes with bf16 autocast, and the peak CUDA memory of each lesson 03 strategy beside the model-state
estimate, and writes them with the machine, driver, versions, load and command to
notebooks/data/gpu_figures.json.

    python -m tests.harness.gpu_check [--figures] [--lessons 00 02] [--quick]
Without a GPU it stops at once with one line saying so: it never passes silently.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.harness.launch import ROOT, Run, course_env, torchrun
from utils.model import GPU_EXAMPLE, TINY, ModelConfig, flops_per_token

FP32_RTOL = 1e-4  # relative difference of each logged loss, GPU vs CPU, after a few fp32 SGD steps
LOW_PRECISION_RTOL = 2e-2  # bf16/fp16 compute or compression: the two devices round differently
SMALL = ["--steps", "5", "--optimizer", "sgd", "--log-every", "1"]


@dataclass
class Check:
    lesson: str
    label: str
    args: list = field(default_factory=list)
    rtol: float = FP32_RTOL
    logs: bool = True  # the script takes --log-dir (every training script; lesson 01 has no logs)
    min_gpus: int = 1
    cpu_args: list | None = None  # the CPU reference's arguments, where the GPU path has no CPU counterpart


CHECKS = [
    Check("00", "baseline", SMALL),
    Check("00", "bf16 autocast", [*SMALL, "--autocast", "bf16"], LOW_PRECISION_RTOL),
    Check("01", "collectives and ring", ["--sizes", "4K,64K", "--steps", "2"], logs=False),
    Check("02", "DDP built-in", [*SMALL, "--ddp", "builtin"]),
    Check("02", "DDP from scratch, 2 micro-batches", [*SMALL, "--ddp", "scratch", "--grad-accum", "2"]),
    *(Check("03", strategy, [*SMALL, "--strategy", strategy, "--momentum", "0.9"])
      for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")),
    Check("03", "fsdp bf16", [*SMALL, "--strategy", "fsdp", "--precision", "bf16"], LOW_PRECISION_RTOL),
    Check("04", "TP from scratch", [*SMALL, "--tp-impl", "scratch"]),
    Check("04", "TP from scratch + SP", [*SMALL, "--tp-impl", "scratch", "--sequence-parallel"]),
    Check("04", "DTensor TP", [*SMALL, "--tp-impl", "dtensor"]),
    Check("04", "DTensor TP + SP", [*SMALL, "--tp-impl", "dtensor", "--sequence-parallel"]),
    *(Check("05", f"{impl} {schedule}", [*SMALL, "--pp-impl", impl, "--schedule", schedule])
      for impl, schedule in (("scratch", "gpipe"), ("scratch", "1f1b"), ("builtin", "gpipe"), ("builtin", "1f1b"))),
    # At world size 1 both virtual stages sit on one rank, which then sends to itself: NCCL does, but the CPU
    # reference run of interleaved fails on torch 2.11's gloo ("Pair is not connected"), so it needs two GPUs. The
    # zero-bubble interleaved-zb and zbv (backward split into I and W) also hold two stages per rank: untried at world
    # size 1 on torch 2.11, they ask for two GPUs too.
    *(Check("05", f"builtin {schedule}", [*SMALL, "--pp-impl", "builtin", "--schedule", schedule], min_gpus=2)
      for schedule in ("interleaved", "interleaved-zb", "zbv")),
    # Lesson 06 at world size = the GPUs as data parallelism (pp = tp = 1): the grid, the DP average and the
    # built-in mesh on NCCL; layouts with tp, pp > 1 need that many GPUs per dimension.
    Check("06", "3D from scratch", [*SMALL, "--impl", "scratch"]),
    Check("06", "3D built-in", [*SMALL, "--impl", "builtin"]),
    *(Check("07", method, [*SMALL, "--method", method], LOW_PRECISION_RTOL if method in ("fp16", "bf16") else FP32_RTOL)
      for method in ("none", "fp16", "bf16", "topk", "powersgd", "localsgd", "postlocal")),
    *(Check("07", f"quantize {bits} bits", [*SMALL, "--method", "quantize", "--bits", str(bits)], LOW_PRECISION_RTOL)
      for bits in (2, 4, 8, 16, 32)),
    Check("08", "checkpoints", [*SMALL, "--checkpoint-every", "2"]),
    Check("08", "async checkpoints", [*SMALL, "--checkpoint-every", "2", "--async-save"]),
    # Lesson 09: context parallelism at world size = the GPUs, the ring (both splits) and Ulysses from scratch.
    # torch's context_parallel runs only on GPUs (it replaces the fused CUDA attention kernels): its CPU reference is
    # the ring from scratch, and at world size 1 it would be a ring of one, so it needs 2 GPUs.
    *(Check("09", f"CP ring, {split}", [*SMALL, "--impl", "ring", "--cp-split", split])
      for split in ("contiguous", "zigzag")),
    Check("09", "CP Ulysses", [*SMALL, "--impl", "ulysses"]),
    Check("09", "CP built-in", [*SMALL, "--impl", "builtin"], cpu_args=[*SMALL, "--impl", "ring"], min_gpus=2),
    # Lesson 10: the experts at world size = the GPUs (8 experts split over 1, 2, 4 or 8), both dispatches: uneven
    # all_to_all_single with its counts on the host (dropless), fixed buffers (padded).
    *(Check("10", f"EP {dispatch} {impl}", [*SMALL, "--dispatch", dispatch, "--impl", impl, "--experts", "8"])
      for dispatch in ("dropless", "padded") for impl in ("scratch", "builtin")),
    # Lesson 11: profiled steps (the CUDA branch of the trace's breakdown: kernels, NCCL's among them), FSDP2's explicit
    # prefetch, and the speed-ups one at a time.
    Check("11", "DDP profiled", [*SMALL, "--strategy", "ddp"]),
    Check("11", "FSDP2 explicit prefetch", [*SMALL, "--strategy", "fsdp", "--prefetch", "explicit"]),
    Check("11", "fused optimizer, selective checkpointing", [*SMALL, "--optimizer-impl", "fused", "--checkpointing",
                                                         "selective"]),
    Check("11", "bf16 autocast, compiled", [*SMALL, "--autocast", "bf16", "--compile"], LOW_PRECISION_RTOL),
]  # fmt: skip
QUICK = {"baseline", "collectives and ring", "DDP built-in", "fsdp", "DTensor TP + SP", "scratch 1f1b", "none",
         "checkpoints", "CP ring, zigzag", "EP dropless scratch"}  # fmt: skip

# Peak dense bf16 FLOP/s from the vendors' data sheets (without sparsity), by a substring of the device name.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
FIGURE_MODELS = {  # lesson 00's model sizes, on one GPU with bf16 autocast
    "TINY": (TINY, ["--batch-size", "64"]),
    "GPU_EXAMPLE": (GPU_EXAMPLE, ["--batch-size", "16"]),
    "GPU_EXAMPLE x2 wide": (ModelConfig(seq_len=1024, dim=1024, n_heads=16, n_layers=8), ["--batch-size", "16"]),
}


def lesson_script(number: str) -> Path | None:
    return next(iter(sorted((ROOT / "solutions").glob(f"{number}_*.py"))), None)


def model_args(config: ModelConfig) -> list[str]:
    sizes = [("--dim", config.dim), ("--n-layers", config.n_layers), ("--n-heads", config.n_heads)]
    return [str(item) for pair in [*sizes, ("--seq-len", config.seq_len)] for item in pair]


def launch(check: Check, nproc: int, folder: Path, env: dict) -> Run:
    args = [*check.args, *(["--log-dir", folder / "runs"] if check.logs else [])]
    if check.lesson == "08":
        args += ["--checkpoint-dir", folder / "checkpoints"]
    if check.lesson == "11":  # every lesson 11 check profiles its steps: one trace per rank
        args += ["--profile", folder / "traces"]
    if check.lesson == "04" and nproc > 4:  # heads (and the width) must split over the GPUs
        args += ["--n-heads", str(nproc), "--dim", str(16 * nproc)]
    if check.lesson == "09" and nproc > 4:  # Ulysses gives each rank whole heads
        args += ["--n-heads", str(nproc)]
    if check.lesson == "05":  # two blocks per rank (interleaved puts two stages on each), a micro-batch per stage
        args += ["--n-layers", str(2 * nproc), "--microbatches", str(max(4, nproc))]
    # cold: torchrun itself, as on the cluster (warm ranks are the CPU suite's shortcut)
    return torchrun(lesson_script(check.lesson), nproc, args, tmp_path=folder, env=env, timeout=600, cold=True)


def gpu_env(**extra) -> dict:
    # CUBLAS_WORKSPACE_CONFIG: cuBLAS's deterministic mode, needed where a script asks for deterministic algorithms.
    return course_env(COURSE_CHECK_DEVICE=1, NVIDIA_TF32_OVERRIDE=0, COURSE_TIMEOUT_S=120,
                      CUBLAS_WORKSPACE_CONFIG=":4096:8", **extra)  # fmt: skip


def check_one(check: Check, gpus: int, tmp: Path) -> list[str]:
    """Problems found for one configuration (empty: it passed)."""
    if lesson_script(check.lesson) is None:
        return [f"no solutions/{check.lesson}_*.py"]
    folder = tmp / check.lesson / re.sub(r"\W+", "_", check.label)
    gpu = launch(check, gpus, folder / "gpu", gpu_env())
    if gpu.returncode != 0 or gpu.metrics is None:
        return [f"the GPU run failed (exit {gpu.returncode}):\n{gpu.tail(25)}"]
    problems = []
    checked = re.findall(r"\[rank (\d+)\] device check: (\d+) collective calls", gpu.output)
    if len(checked) != gpus:
        problems.append(f"{len(checked)} of {gpus} ranks reported their collectives' device check")
    reference = check if check.cpu_args is None else Check(check.lesson, check.label, check.cpu_args, check.rtol)
    cpu = launch(reference, gpus, folder / "cpu", course_env(CUDA_VISIBLE_DEVICES=""))
    if cpu.returncode != 0 or cpu.metrics is None:
        return problems + [f"the CPU run failed (exit {cpu.returncode}):\n{cpu.tail(25)}"]
    gpu_losses, cpu_losses = gpu.metrics.get("losses"), cpu.metrics.get("losses")
    if (gpu_losses is None) != (cpu_losses is None):
        problems.append("only one of the two runs recorded its losses")
    elif gpu_losses is not None:
        worst = max((abs(g - c) / max(abs(c), 1e-12) for g, c in zip(gpu_losses, cpu_losses)), default=0.0)
        if len(gpu_losses) != len(cpu_losses) or not gpu_losses or worst > check.rtol:
            problems.append(
                f"losses differ from the CPU run by up to {worst:.1e} (allowed {check.rtol:.0e}): "
                f"GPU {gpu_losses} vs CPU {cpu_losses}"
            )
    return problems


def check_resume_after_kill(gpus: int, tmp: Path) -> list[str]:
    """Lesson 08 on CUDA: rank 0 SIGKILLed after step 5, torchrun restarts, the run ends bit-identical."""
    script, common = lesson_script("08"), [*SMALL[2:], "--steps", "8", "--checkpoint-every", "2"]
    runs = {}
    for name, extra, restarts in (("reference", [], 0), ("killed", ["--crash-at-step", "5", "--crash-rank", "0"], 1)):
        folder = tmp / "08" / f"resume_{name}"
        args = [*common, *extra, "--checkpoint-dir", folder / "checkpoints", "--log-dir", folder / "runs"]
        env = gpu_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, COURSE_NO_PROGRESS=1)
        runs[name] = torchrun(script, gpus, args, tmp_path=folder, timeout=600, env=env, max_restarts=restarts)
        if runs[name].returncode != 0 or runs[name].metrics is None:
            return [f"the {name} GPU run failed (exit {runs[name].returncode}):\n{runs[name].tail(25)}"]
    reference, killed = runs["reference"].metrics, runs["killed"].metrics
    if "killed with SIGKILL at step 5" not in runs["killed"].output:
        return ["the crash did not happen"]
    if killed["losses"] != reference["losses"] or killed["param_checksum"] != reference["param_checksum"]:
        return [f"the resumed run is not bit-identical: {killed['losses']} vs {reference['losses']}"]
    return []


def check_watch_records_the_gpus(gpus: int, tmp: Path) -> list[str]:
    """--watch on CUDA: NVML's fields for every visible GPU (utilization, memory used, power) and torch.cuda's peak,
    the GPU lesson 00 trains on busy, and the job report naming the GPUs it left idle."""
    from utils import monitor

    folder = tmp / "00" / "watch"
    args = [*SMALL[2:], "--steps", "400", "--batch-size", "64", "--watch", "0.2", "--log-dir", folder / "runs"]
    run = torchrun(lesson_script("00"), 1, args, tmp_path=folder, env=gpu_env(), timeout=600, cold=True)
    if run.returncode != 0 or run.metrics is None:
        return [f"the GPU run failed (exit {run.returncode}):\n{run.tail(25)}"]
    record = run.metrics["monitor"][0]
    samples = [s for s in record["samples"] if "gpus" in s]
    problems = []
    if record["device_kind"] != "gpu" or record["devices_allocated"] != gpus or len(samples) < 3:
        problems.append(f"expected {gpus} GPUs and 3 samples or more with NVML fields: {json.dumps(record)[:400]}")
    for sample in samples:
        for gpu in sample["gpus"]:
            if not (0 <= gpu["util_percent"] <= 100 and gpu["mem_used_bytes"] > 0 and gpu["power_w"] > 0):
                problems.append(f"an NVML reading out of range: {gpu}")
        if not sample.get("cuda_peak_bytes", 0) > 0:
            problems.append(f"no torch.cuda peak memory in {sample}")
    if samples and max(s["gpus"][0]["util_percent"] for s in samples) == 0:
        problems.append("GPU 0 never busy while lesson 00 trained on it")
    lines = monitor.report_lines(monitor.load(Path(passed_metrics(run))))
    idle = f"1 of {gpus} GPUs busy: the script runs one process"
    if gpus > 1 and lines[-1] != idle:
        problems.append(f"the report should end with {idle!r}:\n" + "\n".join(lines))
    return problems[:5]


def passed_metrics(run: Run) -> str:
    command = [str(part) for part in run.command]
    return command[command.index("--metrics-out") + 1]


def can_share_a_gpu(tmp: Path) -> str:
    """One line: what happens when two ranks are started on a node with one GPU (what lesson 01's live ranks,
    and every multi-rank lesson, would do there)."""
    run = torchrun(lesson_script("01"), 2, ["--skip-benchmark"], env=gpu_env(), timeout=180)
    refusal = re.search(r"ERROR: (.*)", run.output)
    if run.returncode == 0:
        return "two ranks on one GPU ran lesson 01's collectives with NCCL"
    return f"two ranks on one GPU: refused (exit {run.returncode}): " + (refusal.group(1) if refusal else run.tail(3))


def machine() -> dict:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def measure_figures(tmp: Path) -> dict:
    """tokens/s and MFU of lesson 00's model sizes (bf16 autocast), and lesson 03's peak memory by strategy."""
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
    throughput = []
    for label, (config, extra) in FIGURE_MODELS.items():
        args = ["--steps", "60", "--autocast", "bf16", *model_args(config), *extra, "--log-dir", tmp / "figures"]
        runs = [torchrun(lesson_script("00"), 1, args, tmp_path=tmp / "figures", timeout=600).check() for _ in range(3)]
        rates = sorted(run.metrics["tokens_per_s"] for run in runs)
        achieved = rates[1] * flops_per_token(config)
        throughput.append({
            "model": label, "dim": config.dim, "n_layers": config.n_layers, "n_heads": config.n_heads,
            "seq_len": config.seq_len, "batch_size": int(extra[1]),
            "tokens_per_s_median_of_3": rates[1], "tokens_per_s_min_max": [rates[0], rates[-1]],
            "flops_per_token": flops_per_token(config), "achieved_tflops": achieved / 1e12,
            "mfu_vs_bf16_peak": achieved / peak if peak else None,
        })  # fmt: skip
    memory = []
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        args = ["--steps", "3", "--strategy", strategy, "--optimizer", "adamw", *model_args(GPU_EXAMPLE),
                "--batch-size", "8", "--log-dir", tmp / "figures"]  # fmt: skip
        run = torchrun(lesson_script("03"), 1, args, tmp_path=tmp / "figures" / strategy, timeout=600)
        metrics = run.check().metrics
        memory.append({
            "strategy": strategy,
            "estimated_model_state_bytes": sum(metrics["estimated_bytes_per_rank"].values()),
            "held_model_state_bytes": sum(metrics["bytes_per_rank"].values()),
            "activation_bytes": metrics["activation_bytes"],
            "peak_cuda_allocated_bytes": metrics["peak_memory_bytes"],
        })  # fmt: skip
    return {
        "about": "Measured by `python -m tests.harness.gpu_check --figures` on one GPU. Throughput: lesson 00's "
        "script, "
        "bf16 autocast, 60 steps, median of 3 runs. Memory: lesson 03's script at world size 1 (AdamW, fp32 "
        "state), where every strategy holds the whole model: the peak shows the model state plus activations "
        "and temporaries on one device, not the sharding, which needs several GPUs.",
        "command": "python -m tests.harness.gpu_check --figures",
        "machine": machine(),
        "peak_bf16_flops": peak,
        "throughput": throughput,
        "memory_world_size_1": memory,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", nargs="*", default=None, help="lesson numbers (default: all)")
    parser.add_argument("--quick", action="store_true", help="one configuration per lesson")
    parser.add_argument("--jobs", type=int, default=1, help="configurations checked at once (they share the GPUs)")
    parser.add_argument("--no-checks", action="store_true", help="only the figures (with --figures)")
    parser.add_argument("--figures", action="store_true", help="also measure tokens/s, MFU and memory on one GPU")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="where runs write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it on a GPU node")
        return 2
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if gpus == 1 and not args.no_checks:
        print(can_share_a_gpu(args.out), flush=True)
    checks = [c for c in CHECKS if (args.lessons is None or c.lesson in args.lessons) and
              (not args.quick or c.label in QUICK) and not args.no_checks]  # fmt: skip
    for check in [c for c in checks if c.min_gpus > gpus]:
        print(f"lesson {check.lesson} {check.label}: not run here, it needs {check.min_gpus} GPUs")
    checks = [c for c in checks if c.min_gpus <= gpus]
    # Each configuration runs on its own GPU processes; several at once share the GPUs (--jobs), which is
    # fine for correctness checks. Timings (--figures) are measured afterwards, alone.
    jobs = {f"lesson {c.lesson} {c.label}": (check_one, c, gpus, args.out) for c in checks}
    if (args.lessons is None or "08" in args.lessons) and not args.no_checks:
        jobs["lesson 08 killed and resumed, bit-identical"] = (check_resume_after_kill, gpus, args.out)
    if (args.lessons is None or "00" in args.lessons) and not args.no_checks:
        jobs["--watch: NVML fields and the job report"] = (check_watch_records_the_gpus, gpus, args.out)
    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(*job): name for name, job in jobs.items()}
        for future in as_completed(futures):
            problems = future.result()
            failed += bool(problems)
            print(f"{futures[future]}: " + ("ok" if not problems else "FAILED\n  " + "\n  ".join(problems)), flush=True)
    total = len(jobs)
    if args.figures:
        figures = measure_figures(args.out)
        path = ROOT / "notebooks" / "data" / "gpu_figures.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(json.dumps(figures, indent=2))
    print(f"{total - failed} of {total} GPU checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
