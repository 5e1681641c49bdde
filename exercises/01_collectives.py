# Exercise for lesson 01: complete the numbered TODOs. (This file is generated from
# solutions/01_collectives.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 01: collectives, the vocabulary of every parallelism in this course.

Part 1 runs each collective of torch.distributed on small tensors and shows every rank's tensor
before and after. Part 2 builds all-reduce twice by hand: as a ring of send/recv (a reduce-scatter
phase, then an all-gather phase) and from the reduce-scatter and all-gather collectives, and checks
both against dist.all_reduce. Part 3 measures the hand-written ring against the library. Part 4 is a
debugging lab: five short multi-rank functions that hang or crash, for you to diagnose and fix (TODOs 4-8).

    torchrun --nproc_per_node=4 exercises/01_collectives.py
    python exercises/01_collectives.py            # a world of one: runs, but nothing to exchange
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import utils` from solutions/ or exercises/

import torch
import torch.distributed as dist

from utils.course.measured import loaded_and_warned
from utils.distributed_utils import destroy_process_group, is_root_process, print0, run_main, setup
from utils.metrics import write_metrics
from utils.training import CourseArgumentParser, parse_args, positive_int

# --------------------------------------------------------------------------------------------------
# Part 1: each collective on a tiny tensor
# --------------------------------------------------------------------------------------------------


def gather_to_all(tensor: torch.Tensor) -> list[list[float]]:
    """Every rank's copy of `tensor` (as lists), so rank 0 can show the whole picture."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, tensor.tolist())
    return pieces


def demonstrate_collectives(rank: int, world_size: int, device: torch.device) -> dict:
    """Run each collective once; return {name: {"before": per-rank lists, "after": per-rank lists}}.

    Every tensor a collective touches lives on `device`: NCCL (GPUs) rejects CPU tensors."""
    demos = {}

    def record(name, before, after, only_on_root=False):
        demos[name] = {"before": gather_to_all(before), "after": gather_to_all(after)}
        if only_on_root:  # the other ranks' tensors hold nothing meaningful: show them as None
            demos[name]["after"][1:] = [None] * (world_size - 1)

    def mine():  # rank r starts with [10r+1, 10r+2, ...]: easy to follow by eye
        return torch.arange(1, world_size + 1, dtype=torch.float32, device=device) + 10 * rank

    # broadcast: rank 0's tensor overwrites everyone's.
    x = mine()
    before = x.clone()
    dist.broadcast(x, src=0)
    record("broadcast", before, x)

    # reduce: the sum arrives on rank 0 only (what the others hold afterwards is not to be used).
    x = mine()
    before = x.clone()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    record("reduce", before, x, only_on_root=True)

    # all-reduce: everyone gets the sum. Data parallelism averages gradients this way.
    x = mine()
    before = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    record("all_reduce", before, x)

    # all-gather: everyone gets everyone's tensor, concatenated. FSDP gathers parameters this way.
    x = mine()
    gathered = torch.empty(world_size * x.numel(), device=device)
    dist.all_gather_single(gathered, x)
    record("all_gather", x, gathered)

    # reduce-scatter: sum, then rank r keeps chunk r of the sum. FSDP reduces gradients this way.
    x = mine()
    chunk = torch.empty(x.numel() // world_size, device=device)
    dist.reduce_scatter_single(chunk, x, op=dist.ReduceOp.SUM)
    record("reduce_scatter", x, chunk)

    # all-to-all: rank r sends its chunk j to rank j. Expert parallelism routes tokens this way.
    x = mine()
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x)
    record("all_to_all", x, received)

    # send/recv: point to point. Each rank passes its tensor to the next rank around a ring.
    x = mine()
    received = x.clone()  # a world of one keeps its own tensor
    if world_size > 1:
        request = dist.isend(x, dst=(rank + 1) % world_size)  # isend: don't wait, or everyone would
        dist.recv(received, src=(rank - 1) % world_size)
        request.wait()
    record("send_recv", x, received)
    return demos


# --------------------------------------------------------------------------------------------------
# Part 2: all-reduce by hand
# --------------------------------------------------------------------------------------------------


def pass_around_ring(send: torch.Tensor, receive: torch.Tensor):
    """Send `send` to the right-hand neighbour while receiving `receive` from the left-hand one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    request = dist.isend(send, dst=(rank + 1) % world_size)
    dist.recv(receive, src=(rank - 1) % world_size)
    request.wait()


def ring_reduce_scatter(chunks: list[torch.Tensor]):
    """In place: afterwards chunk (rank + 1) % n on this rank holds the sum of that chunk over all ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO 1: the reduce-scatter phase of the ring. Over n - 1 steps each rank passes a partial sum right
    #   (pass_around_ring) and adds the one from its left into its copy. Which chunk at step s?
    raise NotImplementedError("TODO 1: the reduce-scatter phase of the ring")


def ring_all_gather(chunks: list[torch.Tensor]):
    """In place: rank r starts with the finished chunk (r + 1) % n and ends with all of them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO 2: the all-gather phase of the ring. The finished chunks travel around the ring as TODO 1's partial
    #   sums did, each rank passing on the one it got last; this time they land in place: nothing to add.
    raise NotImplementedError("TODO 2: the all-gather phase of the ring")


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, with send/recv only: reduce-scatter, then all-gather."""
    # Views into the tensor, not copies: the phases write the result straight into it.
    chunks = list(tensor.view(-1).tensor_split(dist.get_world_size()))
    ring_reduce_scatter(chunks)
    ring_all_gather(chunks)
    return tensor


def all_reduce_from_collectives(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, as dist.reduce_scatter_single then dist.all_gather_single."""
    world_size = dist.get_world_size()
    # TODO 3: all-reduce = reduce-scatter + all-gather. Both collectives cut their input into n equal pieces,
    #   and the tensor's length may not divide by n: give them one that does, and leave the sum in `tensor`.
    raise NotImplementedError("TODO 3: all-reduce = reduce-scatter + all-gather")
    return tensor


def check_against_library(name: str, all_reduce_by_hand, device) -> float:
    """Largest difference from dist.all_reduce over several shapes; stops the lesson if it is wrong."""
    worst = 0.0
    for shape in [(1,), (5,), (3, 7), (1000,), (64, 64)]:
        generator = torch.Generator().manual_seed(dist.get_rank() * 100 + len(shape))
        x = torch.randn(shape, generator=generator).to(device)
        expected = x.clone()
        dist.all_reduce(expected)
        worst = max(worst, (all_reduce_by_hand(x) - expected).abs().max().item())
    worst_tensor = torch.tensor(worst, device=device)
    dist.all_reduce(worst_tensor, op=dist.ReduceOp.MAX)
    # Sums in another order round differently: float32 agrees to about 1e-6, not exactly.
    verdict = "matches" if worst_tensor.item() < 1e-5 else f"DOES NOT MATCH (off by {worst_tensor.item():.2g})"
    print0(f"{name:>30} {verdict} dist.all_reduce")
    return worst_tensor.item()


# --------------------------------------------------------------------------------------------------
# Part 3: how fast? The alpha-beta model and bus bandwidth
# --------------------------------------------------------------------------------------------------


def seconds_per_call(all_reduce, tensor: torch.Tensor, repeats: int) -> float:
    """Average time of one call, as the slowest rank saw it."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        all_reduce(tensor)
    dist.barrier()
    elapsed = torch.tensor((time.perf_counter() - start) / repeats, dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


IMPLEMENTATIONS = {"library": dist.all_reduce, "ring": ring_all_reduce, "rs_ag": all_reduce_from_collectives}


def benchmark(sizes_bytes: list[int], rounds: int, device) -> list[dict]:
    """Time library, ring and reduce-scatter+all-gather all-reduce on the same tensors, interleaved.

    For each size and implementation: the median time of `rounds` rounds (and the fastest and slowest
    round, the run-to-run spread), the algorithm bandwidth S / t and the bus bandwidth."""
    world_size = dist.get_world_size()
    rows = []
    for size in sizes_bytes:
        tensor = torch.ones(size // 4, device=device)  # float32
        repeats = max(2, min(50, (4 << 20) // size))  # more repeats for small, quick messages
        for all_reduce in IMPLEMENTATIONS.values():  # warm-up: connections, allocations
            all_reduce(tensor)
        times = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(rounds):  # interleaved rounds: a slow moment of the machine hits all three
            for name, all_reduce in IMPLEMENTATIONS.items():
                times[name].append(seconds_per_call(all_reduce, tensor, repeats))
        row = {"bytes": size, "world_size": world_size}
        for name in IMPLEMENTATIONS:
            seconds = statistics.median(times[name])
            algorithm_bandwidth = size / seconds  # bytes of the tensor per second: what the application sees
            row[name] = {
                "seconds": seconds,
                "seconds_min": min(times[name]),
                "seconds_max": max(times[name]),
                "algbw_GBps": algorithm_bandwidth / 1e9,
                # What each link carried: a ring all-reduce sends 2(n-1)/n of the tensor per rank.
                "busbw_GBps": algorithm_bandwidth * 2 * (world_size - 1) / world_size / 1e9,
            }
        rows.append(row)
    return rows


def fit_alpha_beta(rows: list[dict], name: str, world_size: int) -> tuple[float, float]:
    """Fit the ring all-reduce model t(S) = 2(n-1) alpha + 2(n-1)/n S beta to the measured times.

    alpha: the one-way cost of one message (seconds), paid 2(n-1) times, once per ring step;
    beta: seconds per byte on one link, so 1/beta is the link bandwidth (bytes/s).
    A straight line t = a + b S is fitted by least squares on the relative error (the sizes span
    decades; each counts alike), then alpha = a / (2(n-1)) and beta = b n / (2(n-1)).
    Returns (nan, nan) in a world of one, where nothing is sent.
    """
    if world_size < 2:
        return float("nan"), float("nan")
    sizes = torch.tensor([float(r["bytes"]) for r in rows], dtype=torch.float64)
    seconds = torch.tensor([r[name]["seconds"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1) / seconds.unsqueeze(1)
    intercept, slope = torch.linalg.lstsq(design, torch.ones_like(seconds).unsqueeze(1)).solution.squeeze(1).tolist()
    steps = 2 * (world_size - 1)
    return intercept / steps, slope * world_size / steps


def parse_size(text: str) -> int:
    """An argparse type: a message size in bytes, such as 4096, 64K or 16M, a multiple of 4 (float32)."""
    units = {"K": 1 << 10, "M": 1 << 20}
    number, unit = (text[:-1], units[text[-1].upper()]) if text and text[-1].upper() in units else (text, 1)
    try:
        size = int(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes with K or M, e.g. 64K") from None
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive multiple of 4 bytes (float32); e.g. 64K")
    return size


def size_list(text: str) -> list[int]:
    """An argparse type: comma-separated message sizes, e.g. 1K,32K,1M,16M."""
    return [parse_size(part.strip()) for part in text.split(",")]


def machine_description(device: torch.device) -> dict:
    """What a reference measurement needs next to it: the machine and the versions that made it."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "memory_GiB": round(memory_gib, 1) if memory_gib else None,
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def save_reference(path: Path, rows: list[dict], args, device, load_before: float):
    """Merge this world size's benchmark into the reference file `path` (one entry per world size)."""
    if not is_root_process():
        return
    load_after = os.getloadavg()[0]
    reference = json.loads(path.read_text()) if path.exists() else {}
    reference.setdefault(
        "about",
        "All-reduce time per call (median of interleaved rounds, with the fastest and slowest round) for "
        "the library, the hand-written ring (TODOs 1-2) and reduce-scatter + all-gather (TODO 3). Written by "
        "`torchrun --nproc_per_node=N exercises/01_collectives.py --benchmark-out FILE`.",
    )
    runs = reference.setdefault("runs", {})
    runs[str(dist.get_world_size())] = {
        "date": date.today().isoformat(),
        "command": f"torchrun --nproc_per_node={dist.get_world_size()} exercises/01_collectives.py "
        f"--sizes {args.sizes_text} --steps {args.steps} --benchmark-out {path}",
        "rounds": args.steps,
        "machine": machine_description(device),
        "load_average_1min": {"before": load_before, "after": load_after},
        "loaded": loaded_and_warned(load_before, load_after, dist.get_world_size(), path),  # others on the cores?
        "rows": rows,
    }
    reference["runs"] = dict(sorted(runs.items(), key=lambda item: int(item[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reference, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# Part 4: debugging lab. Each function below is short, plausible, and (in the exercise) wrong: on three
# ranks it hangs, crashes or disagrees. Run it on live ranks (notebook section 5) or `make check LESSON=01`,
# read which rank failed in which call, and fix it. The lab runs on gloo with a 5 s timeout.
# --------------------------------------------------------------------------------------------------


def count_real_tokens(tokens: torch.Tensor) -> int:
    """The number of real tokens (not the padding -1) in every rank's batch together, on every rank.
    At the end of an epoch a rank's batch can be empty."""
    # TODO 4: lab, a collective some ranks skip. In the exercise, a rank with an empty batch returns at once.
    #   Which ranks wait in which call, and for whom? Fix it so that every rank returns the total over all
    #   ranks, an empty batch included.
    if tokens.numel() == 0:
        return 0  # nothing to count on this rank
    count = (tokens >= 0).sum().to(torch.float64)
    dist.all_reduce(count)
    return int(count.item())


def largest_value(values: torch.Tensor) -> float:
    """The largest element of `values` (the same tensor on every rank), each rank scanning one slice."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = -(-values.numel() // world_size)  # slices of ceil(numel / n): the last ones can be empty
    mine = values[rank * per_rank : (rank + 1) * per_rank]
    # TODO 5: lab, a rank that raises. In the exercise, which rank raises, and what do the other ranks
    #   see in the all-reduce that follows? Fix it so that an empty slice takes part without raising and
    #   without changing the answer.
    local = mine.max()  # the largest of this rank's slice
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.item()


def gather_all(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, concatenated in rank order, on every rank. Each rank has as many
    values as it has (lengths differ between ranks, e.g. the tokens each rank generated)."""
    world_size = dist.get_world_size()
    # TODO 6: lab, shapes that differ between ranks. In the exercise every rank sizes the output from its
    #   own length. What does gloo do with it (and what does TORCH_DISTRIBUTED_DEBUG=DETAIL say)? Fix it so
    #   that every rank returns every rank's values, no more, in rank order, whatever their lengths.
    gathered = torch.empty(world_size * values.numel(), dtype=values.dtype, device=values.device)
    dist.all_gather_single(gathered, values)
    return gathered


def swap_with_partner(tensor: torch.Tensor) -> torch.Tensor:
    """Ranks pair up (0 with 1, 2 with 3, ...) and swap tensors; the last rank of an odd world has no
    partner and keeps its own."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    partner = rank ^ 1  # 0 <-> 1, 2 <-> 3, ...
    if partner >= world_size:
        return tensor.clone()
    received = torch.empty_like(tensor)
    # TODO 7: lab, send/recv in the wrong order. In the exercise both partners send first: on gloo a send
    #   completes only once the partner receives, so who is receiving? Fix it so that every pair completes
    #   its swap.
    dist.send(tensor, dst=partner)  # ours first...
    dist.recv(received, src=partner)  # ...then the partner's
    return received


def steps_until_converged(losses: list[float], target: float) -> int:
    """A training loop's skeleton: this rank's loss at step i is losses[i]. The job stops after the first
    step whose loss averaged over the ranks is below `target`; every rank returns the number of steps run."""
    for step, local_loss in enumerate(losses):
        # TODO 8: lab, a rank-dependent branch around a collective. In the exercise each rank decides to
        #   stop from its own loss. Which rank leaves first, and where are the others then? Fix it so that
        #   every rank leaves the loop at the same step, the one the docstring asks for.
        if local_loss < target:  # this rank's loss is low enough: stop
            return step + 1
        loss = torch.tensor(local_loss, dtype=torch.float64)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean, for the log
    return len(losses)


def main():
    load_before = os.getloadavg()[0]  # before this run's own work: other jobs' share of the cores
    parser = CourseArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=5, help="timed rounds per message size")
    parser.add_argument(
        "--sizes", type=size_list, default="1K,32K,1M,16M", help="message sizes in bytes (K and M suffixes)"
    )
    parser.add_argument("--skip-benchmark", action="store_true", help="parts 1 and 2 only")
    parser.add_argument("--metrics-out", type=Path, default=None, help="write results as JSON to this file")
    parser.add_argument(
        "--benchmark-out", type=Path, default=None, help="add this world size's timings to a reference JSON file"
    )
    args = parse_args(parser)
    args.sizes_text = ",".join(f"{s >> 20}M" if s % (1 << 20) == 0 else f"{s >> 10}K" if s % 1024 == 0 else str(s)
                               for s in args.sizes)  # fmt: skip

    # No --seed: nothing here draws from the global generator (part 2's random tensors have generators of their own).
    local_rank, rank, device, world_size = setup()
    print0(f"world size {world_size}, backend {dist.get_backend()}, device {device.type}")

    print0("\nPart 1: the collectives, rank by rank")
    demos = demonstrate_collectives(rank, world_size, device)
    for name, demo in demos.items():
        print0(f"  {name}")
        for r in range(world_size):
            after = demo["after"][r] if demo["after"][r] is not None else "(nothing defined)"
            print0(f"    rank {r}: {demo['before'][r]} -> {after}")

    print0("\nPart 2: all-reduce by hand, checked against the library")
    errors = {
        "ring": check_against_library("ring all-reduce (send/recv)", ring_all_reduce, device),
        "rs_ag": check_against_library("reduce-scatter + all-gather", all_reduce_from_collectives, device),
    }

    rows, fit = [], {}
    if not args.skip_benchmark:
        print0(f"\nPart 3: time per all-reduce at {world_size} ranks (median of {args.steps} rounds)")
        rows = benchmark(args.sizes, args.steps, device)
        header = f"{'bytes':>10} {'library':>11} {'ring':>11} {'rs+ag':>11} {'ring speed':>11} {'algbw lib':>11}"
        print0(header + f" {'busbw lib':>11}")
        for row in rows:
            # A speed ratio: library time / ring time (1.00x = as fast as the library, 0.50x = half as fast).
            ring_speed = row["library"]["seconds"] / row["ring"]["seconds"]
            times = "".join(f" {row[name]['seconds'] * 1e6:>9.0f}us" for name in IMPLEMENTATIONS)
            print0(
                f"{row['bytes']:>10}{times} {ring_speed:>10.2f}x"
                f" {row['library']['algbw_GBps']:>6.3f} GB/s {row['library']['busbw_GBps']:>6.3f} GB/s"
            )
        print0("ring speed = library time / ring time; algbw = bytes / time; busbw = algbw x 2(n-1)/n")
        alpha, beta = fit_alpha_beta(rows, "library", world_size)
        fit = {"alpha_s": alpha, "beta_s_per_byte": beta, "link_bandwidth_GBps": 1 / beta / 1e9 if beta else None}
        if world_size > 1:
            print0(
                f"alpha-beta fit of the library, t(S) = 2(n-1) alpha + 2(n-1)/n S beta: "
                f"alpha = {alpha * 1e6:.1f} us per message, 1/beta = {1 / beta / 1e9:.3f} GB/s per link"
            )
        if args.benchmark_out:
            save_reference(args.benchmark_out, rows, args, device, load_before)
            print0(f"reference timings at {world_size} ranks written to {args.benchmark_out}")

    write_metrics(
        args.metrics_out,
        lesson="01_collectives",
        steps=args.steps,
        demos=demos,
        errors=errors,
        benchmark=rows,
        alpha_beta=fit,
    )
    print0(f"FINISHED lesson 01 on {world_size} ranks")
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
