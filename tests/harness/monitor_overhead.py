"""What --watch costs: lesson 00's tokens/s with and without it, side by side, alternating, several times.

    python -m tests.harness.monitor_overhead [--pairs 6] [--steps 150] [--watch 1]

Each pair runs the same training twice, once watched, in an order that alternates from pair to pair (a machine
that slows down during the measurement then weighs on both sides alike). The ratio of each pair's tokens/s is
kept, and the median ratio is the overhead. Beside it, the sampling thread's own CPU time over the run's time: the
share of a core --watch takes, which other jobs' load does not blur. The machine, its load before and after, the
versions and the command go into notebooks/data/monitor_overhead.json beside the numbers: a figure measured on a
loaded machine says so.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import psutil
import torch

from tests.harness.launch import ROOT, python
from utils.course.measured import loaded_and_warned

SCRIPT = ROOT / "solutions" / "00_setup_and_baseline.py"
OUT = ROOT / "notebooks" / "data" / "monitor_overhead.json"


def measure(args: list, folder: Path) -> dict:
    """One run's tokens/s and, when watched, the share of one core its sampling thread used (load-independent)."""
    run = python(SCRIPT, [*args, "--log-dir", folder / "runs"], tmp_path=folder, cold=True, timeout=600).check()
    measured = {"tokens_per_s": run.metrics["tokens_per_s"]}
    if "monitor" in run.metrics:
        record = run.metrics["monitor"][0]
        last = record["samples"][-1]
        measured["sampler_core_share"] = last["sampler_cpu_s"] / (last["t"] - record["start"])
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6, help="runs with and without --watch, side by side")
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--watch", type=float, default=1.0, help="the sampling interval measured (seconds)")
    parser.add_argument("--out", type=Path, default=OUT)
    options = parser.parse_args()
    folder = ROOT / "runs" / "monitor_overhead"
    common = ["--steps", str(options.steps), "--log-every", str(options.steps)]
    load_before = os.getloadavg()
    pairs = []
    for pair in range(options.pairs):
        order = ("watched", "plain") if pair % 2 else ("plain", "watched")
        runs = {}
        for kind in order:
            extra = ["--watch", str(options.watch)] if kind == "watched" else []
            runs[kind] = measure([*common, *extra], folder / f"{pair}_{kind}")
        plain, watched = runs["plain"]["tokens_per_s"], runs["watched"]["tokens_per_s"]
        share = runs["watched"]["sampler_core_share"]
        pairs.append({"plain": plain, "watched": watched, "ratio": watched / plain, "sampler_core_share": share})
        print(f"pair {pair}: plain {plain:,.0f}, watched {watched:,.0f} tokens/s, ratio {watched / plain:.3f}; "
              f"the sampler used {share:.3%} of a core", flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    shares = [p["sampler_core_share"] for p in pairs]
    load_after = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    record = {
        "what": "lesson 00 (one process) tokens/s with --watch over without, pair by pair, alternating order",
        "overhead_median": 1 - statistics.median(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "sampler_core_share_max": max(shares),
        "sampler_note": "the sampling thread's own CPU time over the run's time: what --watch takes from a core "
        "whatever the load (a bound on its cost where the training has no core to spare)",
        "pairs": pairs,
        "watch_interval_s": options.watch,
        "loaded": loaded_and_warned(load_before[0], load_after[0], ours=1, path=options.out),
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "load_before": load_before,  # 1, 5 and 15 minutes
        "load_after": load_after,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": cores,
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "system": platform.platform(),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "psutil": psutil.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m tests.harness.monitor_overhead", *sys.argv[1:]]),
        "script_args": common,
        "environment": {"OMP_NUM_THREADS": "1"},
    }
    options.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"median overhead {record['overhead_median']:+.1%} (ratios {min(ratios):.3f} to {max(ratios):.3f}), "
          f"the sampler at most {max(shares):.3%} of a core; "
          f"load {load_before[0]:.1f} before, {load_after[0]:.1f} after on {cores} cores -> {options.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
