"""Lesson 02's benchmarks: what each way of sharding data costs (utils/lesson_02/samplers.py), and the lesson's
throughput at 1, 2 and 4 ranks.

    torchrun --nproc_per_node=2 utils/lesson_02/benchmarks.py --benchmark  # memory and time per batch of each
    torchrun --nproc_per_node=4 utils/lesson_02/benchmarks.py --memory     # memory per rank: a copy each, or mapped
    python utils/lesson_02/benchmarks.py --throughput    # tokens/s at 1, 2, 4 ranks, 5 runs each: the notebook's data

Memory is counted per rank as PSS, shared pages 1/k in each of k processes (utils/lesson_02/host_memory.py).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from utils.course.measured import cpu_name, loaded_and_warned, wait_until_quiet
from utils.data import map_tokens, write_token_file
from utils.distributed_utils import destroy_process_group
from utils.lesson_02.host_memory import memory_mb
from utils.lesson_02.samplers import DatasetShardSampler, DispatchLoader, ShardedBatchSampler, StridedIterable


def load_copy(path) -> torch.Tensor:
    """The whole token file read into this process's memory: a private copy per process."""
    tokens = torch.empty(Path(path).stat().st_size, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.readinto(tokens.numpy())  # straight into the tensor: one copy of the file in memory
    return tokens


class TokenFile(Dataset):
    """A map-style dataset of (inputs, targets) blocks of a token file, memory-mapped (utils.data.map_tokens):
    the processes of a node share the file's pages in the page cache."""

    def __init__(self, path, seq_len):
        self.tokens = map_tokens(Path(path))
        self.seq_len = seq_len

    def __len__(self):
        return len(self.tokens) // (self.seq_len + 1)

    def __getitem__(self, i):
        block = self.tokens[i * (self.seq_len + 1) : (i + 1) * (self.seq_len + 1)].long()
        return block[:-1], block[1:]


def token_stream(path, seq_len):
    """The same blocks as TokenFile, read from the file one at a time: a stream that never holds the file."""
    with open(path, "rb") as f:
        while len(chunk := f.read(seq_len + 1)) == seq_len + 1:
            block = torch.tensor(list(chunk), dtype=torch.long)
            yield block[:-1], block[1:]


def random_tokens(megabytes: int) -> bytes:
    return torch.randint(0, 256, (megabytes * 2**20,), dtype=torch.uint8, generator=torch.Generator()).numpy().tobytes()


def memory_benchmark(megabytes: int) -> list[dict]:
    """Memory per rank for the same token file, read into a copy per process or memory-mapped.

    Every rank loads the file and touches every page; then, while all ranks hold it, each measures how much
    its RSS (every page it touched, shared or not) and its PSS (its share) grew.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = [tempfile.mkdtemp(prefix="memory-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = Path(folder[0]) / "tokens.u8"
    if rank == 0:
        write_token_file(path, random_tokens(megabytes))
    rows = []
    for how, load in [("a copy per process", load_copy), ("memory-mapped", map_tokens)]:
        dist.barrier()
        before = memory_mb()
        tokens = load(path)
        int(tokens[::4096].sum())  # touch one byte of every page: the whole file is resident
        dist.barrier()
        after = memory_mb()
        dist.barrier()
        del tokens
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, {k: after[k] - before[k] for k in after})
        rows.append(
            {
                "how": how,
                "world_size": world_size,
                "file_mb": megabytes,
                "rss_mb": [r["rss"] for r in per_rank],
                "pss_mb": [r["pss"] for r in per_rank],
            }
        )
    dist.barrier()
    if rank == 0:
        path.unlink()
        path.parent.rmdir()
    return rows


def benchmark(megabytes: int, batch_size: int, seq_len: int, batches: int) -> list[dict]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = [tempfile.mkdtemp(prefix="sharding-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = Path(folder[0]) / "tokens.bin"
    if rank == 0:
        write_token_file(path, random_tokens(megabytes))
    dist.barrier()

    def loader(strategy):
        if strategy == "1 dataset sharding":
            dataset = TokenFile(path, seq_len)
            return DataLoader(dataset, batch_size, sampler=DatasetShardSampler(len(dataset)), drop_last=True)
        if strategy == "2 iterable sharding":
            return DataLoader(StridedIterable(lambda: token_stream(path, seq_len)), batch_size)
        if strategy == "3 batch-sampler sharding":
            dataset = TokenFile(path, seq_len)
            sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator())
            return DataLoader(dataset, batch_sampler=ShardedBatchSampler(sampler, batch_size))
        return DispatchLoader(TokenFile(path, seq_len) if rank == 0 else None, batch_size)

    rows = []
    for strategy in ["1 dataset sharding", "2 iterable sharding", "3 batch-sampler sharding", "4 dispatching"]:
        dist.barrier()
        before = memory_mb()["pss"]
        start = time.perf_counter()
        data = iter(loader(strategy))
        next(data)  # the first batch pays for loading the file and drawing the epoch's order
        first = time.perf_counter()
        for _ in range(batches):
            next(data)
        end = time.perf_counter()
        dist.barrier()  # every rank holds its data now: the shared pages are counted 1/N in each
        held = memory_mb()["pss"] - before
        dist.barrier()
        del data
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (held, first - start, (end - first) / batches))
        rows.append(
            {
                "strategy": strategy,
                "rank0_mb": per_rank[0][0],
                "other_ranks_mb": max((r[0] for r in per_rank[1:]), default=float("nan")),
                # the slowest rank sets the pace of all
                "first_batch_s": max(r[1] for r in per_rank),
                "ms_per_batch": 1000 * max(r[2] for r in per_rank),
            }
        )
    dist.barrier()
    if rank == 0:
        path.unlink()
        path.parent.rmdir()
    return rows


THROUGHPUT_FILE = Path(__file__).resolve().parents[2] / "notebooks" / "data" / "02_throughput.json"
THROUGHPUT_ARGS = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8"]


def throughput_benchmark(world_sizes, runs: int, steps: int, out: Path) -> dict:
    """Lesson 02's job throughput (tokens/s of all ranks together) at each world size, `runs` times each.

    Weak scaling: every rank keeps its batch (--batch-size 8), so the global batch grows with the ranks. The
    runs of different world sizes are interleaved, so a change in the machine's load hits all of them alike.
    """
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "COURSE_NO_PROGRESS": "1"}
    results = {str(n): [] for n in world_sizes}
    load_before = wait_until_quiet()
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for n in world_sizes:
                metrics = Path(tmp) / f"metrics-{n}-{run}.json"
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                    str(root / "solutions" / "02_data_parallel.py"), *THROUGHPUT_ARGS, "--steps", str(steps),
                    "--optimizer", "sgd", "--log-dir", str(Path(tmp) / "runs"), "--metrics-out", str(metrics),
                ]  # fmt: skip
                subprocess.run(command, cwd=root, env=env, check=True, capture_output=True, timeout=600)
                tokens_per_s = json.loads(metrics.read_text())["tokens_per_s"]
                results[str(n)].append(tokens_per_s)
                print(f"run {run + 1}/{runs}, {n} rank(s): {tokens_per_s:,.0f} tokens/s", flush=True)
    record = {
        "what": "lesson 02 job throughput (tokens/s, all ranks together), --ddp builtin, gloo on CPU",
        "command": "torchrun --nproc_per_node=N solutions/02_data_parallel.py "
        + " ".join(THROUGHPUT_ARGS + ["--steps", str(steps), "--optimizer", "sgd"]),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "os": f"{platform.system()} {platform.release()}",
        },
        # More load than our own ranks explain means other jobs shared the cores: not the machine's speed then.
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "loaded": loaded_and_warned(load_before, os.getloadavg()[0], max(world_sizes), out),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "world_sizes": list(world_sizes),
        "runs": runs,
        "steps": steps,
        "tokens_per_s": results,
        "median": {n: statistics.median(v) for n, v in results.items()},
        "min": {n: min(v) for n, v in results.items()},
        "max": {n: max(v) for n, v in results.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main():
    parser = argparse.ArgumentParser(description="Benchmarks of lesson 02: data sharding, memory, throughput.")
    parser.add_argument("--benchmark", action="store_true", help="the four sharding strategies (under torchrun)")
    parser.add_argument("--memory", action="store_true", help="memory per rank, copied or mapped (under torchrun)")
    parser.add_argument("--throughput", action="store_true", help="lesson 02's tokens/s at 1, 2, 4 ranks (python)")
    parser.add_argument("--megabytes", type=int, default=64, help="size of the token file")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batches", type=int, default=50, help="batches timed per strategy")
    parser.add_argument("--runs", type=int, default=5, help="--throughput: runs per world size")
    parser.add_argument("--steps", type=int, default=30, help="--throughput: steps per run")
    parser.add_argument("--metrics-out", type=Path, default=None, help="also write the table here (JSON)")
    args = parser.parse_args()
    if args.throughput:
        throughput_benchmark([1, 2, 4], args.runs, args.steps, args.metrics_out or THROUGHPUT_FILE)
        return
    if not (args.benchmark or args.memory):
        parser.print_help()
        return
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    if args.memory:
        rows = memory_benchmark(args.megabytes)
        if dist.get_rank() == 0:
            print(f"world size {world_size}, a {args.megabytes} MB token file, growth per rank (MB)")
            print(f"{'how':<20} {'RSS max':>8} {'PSS max':>8}")
            for row in rows:
                print(f"{row['how']:<20} {max(row['rss_mb']):>8.1f} {max(row['pss_mb']):>8.1f}")
    else:
        rows = benchmark(args.megabytes, args.batch_size, args.seq_len, args.batches)
        if dist.get_rank() == 0:
            print(f"world size {world_size}, {args.megabytes} MB of tokens, batch {args.batch_size} per rank")
            print(f"{'strategy':<26} {'rank 0 MB':>10} {'others MB':>10} {'1st batch s':>12} {'ms/batch':>9}")
            for row in rows:
                print(
                    f"{row['strategy']:<26} {row['rank0_mb']:>10.1f} {row['other_ranks_mb']:>10.1f}"
                    f" {row['first_batch_s']:>12.2f} {row['ms_per_batch']:>9.2f}"
                )
    if args.metrics_out and dist.get_rank() == 0:
        record = {"world_size": world_size, "megabytes": args.megabytes, "rows": rows}
        args.metrics_out.write_text(json.dumps(record, indent=2) + "\n")
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


if __name__ == "__main__":
    main()
