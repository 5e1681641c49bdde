"""The strategies side by side, each profiled on every rank: communication, exposed communication and waiting per
step, beside what lessons 02-05's formulas say travels and what can be hidden.

    python -m utils.lesson_11.exposure            # writes notebooks/data/11_exposure.json (a few minutes on 2 cores)
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from utils.lesson_11.runs import ROOT, launch, mean_over_ranks, provenance
from utils.model import ModelConfig, count_parameters

OUT = ROOT / "notebooks" / "data" / "11_exposure.json"
MODEL = ["--dim", "64", "--n-layers", "4", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8", "--steps", "6"]
SIZES = dict(dim=64, n_layers=4, n_heads=4, seq_len=64, batch_size=8)
STRATEGIES = {  # name: (options, what the formula says can be hidden behind computation)
    "DDP, one all-reduce after backward": (["--ddp-overlap", "off"], "nothing"),
    "DDP, one 25 MB bucket": ([], "nothing: the model fits one bucket, ready at the end"),
    "DDP, 0.05 MB buckets": (["--bucket-cap-mb", "0.05"], "all but the last bucket"),
    "FSDP2, FSDP2's prefetch": (["--strategy", "fsdp"], "the backward gathers"),
    "FSDP2, explicit prefetch": (["--strategy", "fsdp", "--prefetch", "explicit"], "all but the first gather"),
    "FSDP2, no reshard after forward": (["--strategy", "fsdp", "--reshard-after-forward", "off"],
                                        "the backward gathers are gone"),
    "TP": (["--strategy", "tp"], "nothing: each block waits for its all-reduces"),
    "PP (GPipe, 4 micro-batches)": (["--strategy", "pp", "--microbatches", "4"], "the bubble is waiting"),
}  # fmt: skip


def predicted(name: str, nproc: int) -> dict:
    """Bytes a rank sends per step by the formulas of lessons 02-05 (fp32), and the pipeline's bubble."""
    config = ModelConfig(dim=SIZES["dim"], n_layers=SIZES["n_layers"], n_heads=SIZES["n_heads"],
                         seq_len=SIZES["seq_len"])  # fmt: skip
    params = 4 * count_parameters(config)
    share = (nproc - 1) / nproc
    activations = 4 * SIZES["batch_size"] * SIZES["seq_len"] * SIZES["dim"]
    if name.startswith("DDP"):
        return {"bytes": 2 * share * params, "formula": "2 (N-1)/N x 4P (ring all-reduce)"}
    if name.startswith("FSDP2"):
        gathers = 1 if "no reshard" in name else 2
        return {"bytes": (gathers + 1) * share * params,
                "formula": f"{gathers + 1} (N-1)/N x 4P ({gathers} all-gather{'s' if gathers > 1 else ''}, "
                           "1 reduce-scatter)"}  # fmt: skip
    if name == "TP":
        return {
            "bytes": SIZES["n_layers"] * 4 * 2 * share * activations,
            "formula": "L x 4 all-reduces x 2 (N-1)/N x 4BTD",
        }
    m = 4
    return {"bytes": 2 * activations, "bubble": (nproc - 1) / (m + nproc - 1),
            "formula": "2 x 4BTD per boundary; bubble (p-1)/(m+p-1)"}  # fmt: skip


def measure(world_sizes=(2, 4)) -> dict:
    before, rows = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory() as folder:
        for nproc in world_sizes:
            for name, (options, hidden) in STRATEGIES.items():
                traces = Path(folder) / f"{nproc}-{len(rows)}"
                metrics = launch(nproc, [*MODEL, *options, "--profile", traces])
                row = {"strategy": name, "ranks": nproc, "hideable": hidden, **predicted(name, nproc)}
                for key in ("step", "computation", "communication", "exposed_communication", "waiting", "data",
                            "other"):  # fmt: skip
                    row[key] = mean_over_ranks(metrics, key)
                row["per_rank"] = metrics["per_rank"]
                rows.append(row)
                print(
                    f"{nproc} ranks  {name:35s} exposed {row['exposed_communication'] * 1e3:6.1f} ms of "
                    f"{row['communication'] * 1e3:6.1f}, waiting {row['waiting'] * 1e3:6.1f}",
                    flush=True,
                )
    command = "python -m utils.lesson_11.exposure"
    return {**provenance("exposed communication per strategy", command, before, max(world_sizes), OUT),
            "model": MODEL, "rows": rows}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    record = measure(tuple(args.world_sizes))
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
