"""The speed-ups one at a time, on the same model and batch, measured side by side: each round launches the baseline
and every configuration in turn, so that each ratio compares runs taken under the same load.

    python -m utils.lesson_11.speedups      # writes notebooks/data/11_speedups.json (several minutes on 2 cores)

Memory per rank: model state plus what a step allocates at its peak (utils/lesson_11/profiling.py).
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from utils.lesson_11.runs import ROOT, launch, memory_per_rank, provenance

OUT = ROOT / "notebooks" / "data" / "11_speedups.json"
RANKS = 2
MODEL = ["--dim", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "128", "--batch-size", "8",
         "--steps", "8"]  # fmt: skip
CONFIGURATIONS = {  # name: options added to the baseline (DDP, fp32, AdamW as a for-loop, no checkpointing)
    "baseline": [],
    "bf16 autocast": ["--autocast", "bf16"],
    "foreach AdamW": ["--optimizer-impl", "foreach"],
    "fused AdamW": ["--optimizer-impl", "fused"],
    "full checkpointing": ["--checkpointing", "full"],
    "selective checkpointing": ["--checkpointing", "selective"],
    "torch.compile": ["--compile"],
    "DDP 0.25 MB buckets": ["--bucket-cap-mb", "0.25"],
    "FSDP2": ["--strategy", "fsdp"],
    "FSDP2, explicit prefetch": ["--strategy", "fsdp", "--prefetch", "explicit"],
}
# What each technique buys, and where (the table's last column: the reason, which the measurements test on a CPU).
WHY = {
    "bf16 autocast": "GPU: tensor cores run bf16 matmuls several times faster and activations halve; CPU: it "
                     "depends on the CPU's bf16 instructions (AVX512-BF16, AMX) and which kernels use them",
    "foreach AdamW": "one operation over all parameters instead of one per parameter: fewer kernel launches (GPU) "
                     "and fewer Python calls (both)",
    "fused AdamW": "the whole update in one kernel per group: the fewest launches and passes over memory",
    "full checkpointing": "memory down (keeps only each block's input), time up (forward run twice)",
    "selective checkpointing": "between the two: keeps what is dear to recompute, recomputes the cheap",
    "torch.compile": "fuses elementwise operations into few kernels (inductor: C++ on a CPU, Triton on a GPU)",
    "DDP 0.25 MB buckets": "more buckets: communication starts earlier in backward, each all-reduce pays its latency",
    "FSDP2": "parameters, gradients and optimizer state sharded: memory down, a gather per block each way",
    "FSDP2, explicit prefetch": "the next block's gather starts before it is needed",
}  # fmt: skip


def measure(rounds: int) -> dict:
    before = os.getloadavg()[0]
    runs = {name: [] for name in CONFIGURATIONS}
    for round_ in range(rounds):
        for name, options in CONFIGURATIONS.items():
            metrics = launch(RANKS, [*MODEL, *options])
            runs[name].append({"tokens_per_s": metrics["tokens_per_s"], "memory_per_rank": memory_per_rank(metrics),
                               "final_loss": metrics["final_loss"]})  # fmt: skip
            print(f"round {round_ + 1}  {name:28s} {metrics['tokens_per_s']:9,.0f} tokens/s", flush=True)
    rows = []
    for name, measured in runs.items():
        ratios = [m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(measured, runs["baseline"])]  # same round
        rows.append({
            "name": name, "options": CONFIGURATIONS[name], "why": WHY.get(name, "the reference"),
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in measured),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "memory_per_rank": statistics.median(m["memory_per_rank"] for m in measured), "runs": measured,
        })  # fmt: skip
    command = f"python -m utils.lesson_11.speedups --rounds {rounds}"
    return {**provenance("speed-ups one at a time", command, before, RANKS, OUT), "ranks": RANKS, "model": MODEL,
            "rounds": rounds, "rows": rows}  # fmt: skip


# Published figures, beside ours (each on its own hardware and model; never compared number for number).
PUBLISHED = [
    {"source": "torchtitan, Llama 3.1 8B, FSDP on 8 H100 (500 W), local batch 2, selective checkpointing",
     "unit": "tokens/s per GPU", "where": "github.com/pytorch/torchtitan, docs/performance.md, Table 1",
     "steps": [["FSDP", 5762], ["+ torch.compile", 6667], ["+ torch.compile + float8", 8532]]},
    {"source": "NERSC SC23 tutorial 'Deep Learning at Scale', a vision transformer on one A100 40 GB, batch 16",
     "unit": "samples/s (epochs 2-4)", "where": "github.com/NERSC/sc23-dl-tutorial, README, single-GPU section",
     "steps": [["4 data-loader workers", 12.4], ["+ DALI data loading", 13.3], ["+ bf16 autocast", 42.6],
               ["+ fused Adam", 42.7], ["+ torch.compile", 42.8]]},
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="launches of each configuration, interleaved")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    record = measure(args.rounds)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
