"""Lesson 05's measurement and checking plumbing: what the pipeline needs besides the technique itself.

- `now` and `record_builtin_timings`: when each F and B ran, for the from-scratch engine and the built-in schedules;
- `measured_bubble`: one step's idle fraction from every rank's timeline;
- `rendezvous_completes`: does a set of communication plans finish if every send waits for its receive?
- `bubble_sweep`: `--bubble-sweep FILE`, the measured bubble at m = 1, 2, 4, 8, with where it was measured, and
  `sweep_means`: what such a file says for one schedule;
- `forward_backward`, `median_times`: one stage's forward and backward with and without activation recomputation,
  and their times (the notebook's last section).
"""

import json
import os
import platform
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from utils.course.measured import cpu_name, others_loaded
from utils.distributed_utils import CourseError, print0

ROOT = Path(__file__).resolve().parents[2]
SWEEP_MICROBATCHES = (1, 2, 4, 8)


def now(device: torch.device) -> float:
    """The clock, after the device finished what was queued (GPU kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --------------------------------------------------------------------------------------------------
# Timelines: (kind, micro-batch, start, end, stage) for every F and B of a step
# --------------------------------------------------------------------------------------------------


def record_builtin_timings(schedule, timeline: list, origin: list, device: torch.device) -> bool:
    """Make a built-in schedule's stages append (kind, mb, start, end, stage) to `timeline` for every F, B and W,
    times from origin[0]. It wraps PipelineStage.forward_one_chunk and backward_one_chunk, which are not public
    API: where they are missing (another torch), nothing is recorded and this returns False. A release that
    stops calling them leaves the timeline empty: `measured_bubble` then says "not recorded" (None). The zero-bubble
    schedules run B as the input's gradient only, and the weights' gradient later (W, backward_weight_one_chunk).

    The built-in's last-stage F is the stage's forward only: the schedule computes the loss outside
    forward_one_chunk. The from-scratch engine's last-stage F includes the loss."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if not all(hasattr(stage, "forward_one_chunk") and hasattr(stage, "backward_one_chunk") for stage in stages):
        return False

    def timed(run, kind, stage_index):
        def run_and_record(chunk, *args, **kwargs):
            start = now(device)
            result = run(chunk, *args, **kwargs)
            timeline.append((kind, chunk, start - origin[0], now(device) - origin[0], stage_index))
            return result

        return run_and_record

    for stage in stages:
        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F", stage.stage_index)
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B", stage.stage_index)
        if hasattr(stage, "backward_weight_one_chunk"):  # zero-bubble schedules: B is the input's gradient only
            stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W", stage.stage_index)
    return True


def measured_bubble(timelines: list) -> float | None:
    """One step's idle fraction: 1 - (time in F and B, summed over ranks) / (ranks x the step's span).

    timelines[r] is rank r's list of (kind, mb, start, end, stage), every rank timed from the same barrier.
    None when some rank recorded nothing (timings not available with this torch release)."""
    if not timelines or any(not timeline for timeline in timelines):
        return None
    busy = sum(end - start for timeline in timelines for _, _, start, end, _ in timeline)
    span = max(end for timeline in timelines for _, _, _, end, _ in timeline)
    return 1 - busy / (len(timelines) * span)


# --------------------------------------------------------------------------------------------------
# The deadlock check: the strictest rendezvous rule
# --------------------------------------------------------------------------------------------------


def rendezvous_completes(plans) -> bool:
    """Do the ranks' communication plans finish if an operation completes only once its partner's batch is posted
    (the strictest rule: an NCCL send may wait for its receive)? plans[r] = rank r's batches of
    (op, peer, what, mb), posted one batch at a time, each waited for before the next. Raises AssertionError
    when a send or receive has no partner at all."""
    posted_in = {}  # (src, dst, what, mb, op) -> (rank, batch index)
    for rank, plan in enumerate(plans):
        for index, batch in enumerate(plan):
            for op, peer, what, mb in batch:
                src, dst = (rank, peer) if op == "send" else (peer, rank)
                posted_in[(src, dst, what, mb, op)] = (rank, index)
    for src, dst, what, mb, op in posted_in:
        partner = "recv" if op == "send" else "send"
        assert (src, dst, what, mb, partner) in posted_in, f"rank {src}'s {what} {mb} to rank {dst} has no {partner}"
    position = [0] * len(plans)
    while any(position[r] < len(plans[r]) for r in range(len(plans))):
        moved = False
        for rank, plan in enumerate(plans):
            if position[rank] == len(plan):
                continue
            ready = True
            for op, peer, what, mb in plan[position[rank]]:
                src, dst = (rank, peer) if op == "send" else (peer, rank)
                peer_rank, peer_batch = posted_in[(src, dst, what, mb, "recv" if op == "send" else "send")]
                ready &= position[peer_rank] >= peer_batch
            if ready:
                position[rank] += 1
                moved = True
        if not moved:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# --bubble-sweep: the measured bubble at m = 1, 2, 4, 8, and where it was measured
# --------------------------------------------------------------------------------------------------


def machine() -> dict:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def bubble_sweep(train, args: Namespace, rank: int, world_size: int, device: torch.device, path: Path) -> dict:
    """Run train(args, schedule, m) for GPipe and 1F1B at m = 1, 2, 4, 8 with a fixed micro-batch of --batch-size
    sequences (the batch is m x --batch-size), and add the results for this world size to the JSON file `path`.

    The formula assumes a stage's F and B take the same time whatever m: that holds when the micro-batch is fixed
    and compute dominates communication. Each rank needs a core of its own on CPU (p > cores is refused); a load
    that our own ranks do not explain (other jobs) is recorded, warned about and marked `"loaded": true` in the file."""
    cores = os.cpu_count() or 1
    if device.type == "cpu" and world_size > cores:
        raise CourseError(
            f"--bubble-sweep with {world_size} processes on {cores} cores measures time-sharing, not the pipeline; "
            f"use --nproc_per_node={cores} or fewer"
        )
    load_before = os.getloadavg()[0]
    results = []
    for schedule in ("gpipe", "1f1b"):
        for m in SWEEP_MICROBATCHES:
            metrics = train(Namespace(**{**vars(args), "batch_size": m * args.batch_size}), schedule, m)
            keep = ("bubble_predicted", "bubble_from_steps", "bubble_measured_per_step", "timeline", "tokens_per_s")
            results.append({"schedule": schedule, "microbatches": m, **{k: metrics[k] for k in keep}})
            measured = metrics["bubble_measured"]
            print0(
                f"{schedule:5s} m={m}: bubble measured "
                + (f"{measured:.3f}" if measured is not None else "(not recorded)")
                + f", formula {metrics['bubble_predicted']:.3f}"
            )
    load_after = os.getloadavg()[0]
    loaded = device.type == "cpu" and others_loaded(load_before, load_after, world_size)
    if loaded:
        print0(
            f"WARNING: the load average ({load_before:.1f} before, {load_after:.1f} after, {world_size} ranks of "
            f"ours) shows other jobs on the {cores} cores: not the machine's speed; the file is marked loaded"
        )
    if rank == 0:
        script = Path(sys.argv[0]).resolve()
        shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
        table = json.loads(path.read_text()) if path.exists() else {}
        table[str(world_size)] = {
            "command": f"torchrun --nproc_per_node={world_size} {shown} " + " ".join(sys.argv[1:]),
            "machine": machine(),
            "device": device.type,
            "load_average_1min": {"before": load_before, "after": load_after},
            "loaded": loaded,
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "date": time.strftime("%Y-%m-%d"),
            "micro_batch_size": args.batch_size,
            "n_layers": args.n_layers,
            "dim": args.dim,
            "seq_len": args.seq_len,
            "runs": results,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return {**metrics, "bubble_sweep": results, "loaded": loaded}  # the last run's metrics, and the sweep


class SweepPoint(NamedTuple):
    m: int
    predicted: float  # the formula (p - 1) / (m + p - 1)
    mean: float  # the measured idle fraction over the steps after the first (the first step when it is the only one)
    low: float
    high: float


def sweep_means(table: dict, schedule: str) -> list[SweepPoint]:
    """One world size's sweep (a value of the --bubble-sweep file) for one schedule, in the order of m."""
    points = []
    for run in sorted((r for r in table["runs"] if r["schedule"] == schedule), key=lambda r: r["microbatches"]):
        later = run["bubble_measured_per_step"][1:] or run["bubble_measured_per_step"]
        points.append(SweepPoint(run["microbatches"], run["bubble_predicted"], sum(later) / len(later), min(later),
                                 max(later)))  # fmt: skip
    return points


# --------------------------------------------------------------------------------------------------
# Activation recomputation: its cost in time, on one stage in this process
# --------------------------------------------------------------------------------------------------


def forward_backward(stage, x: torch.Tensor, recompute: bool, backward: bool = True) -> list:
    """The stage's blocks on x (each block checkpointed when `recompute`: only its input is kept), then a backward
    from the sum of the output; returns [x's gradient, every parameter's gradient]."""
    x.grad = None
    stage.zero_grad(set_to_none=True)
    y = x
    for block in stage.blocks.values():
        y = checkpoint(block, y, use_reentrant=False) if recompute else block(y)
    if backward:
        y.sum().backward()
    return [x.grad, *(p.grad for p in stage.parameters())]


def median_times(stage, x: torch.Tensor, kinds: dict, repetitions: int = 12, warm_up: int = 2) -> tuple[dict, dict]:
    """kinds: name -> forward_backward's (recompute, backward). Runs them in turn, `repetitions` times (so that a
    burst of load touches all of them alike); returns (median, fastest) milliseconds per name, the first `warm_up`
    left out."""
    times = {name: [] for name in kinds}
    for _ in range(repetitions):
        for name, (recompute, backward) in kinds.items():
            start = time.perf_counter()
            forward_backward(stage, x, recompute, backward)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values[warm_up:]) * 1e3 for name, values in times.items()}
    return median, {name: min(values[warm_up:]) * 1e3 for name, values in times.items()}
