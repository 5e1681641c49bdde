"""Four ways to give each data-parallel rank its share of the data, and when each one wins.

Every step, the N ranks together consume one global batch of N x b samples; each rank must get a
different b of them, every sample of the epoch exactly once, and all ranks the same number of steps
(a rank that runs out of batches early leaves the others waiting in an all-reduce forever).

1. Dataset sharding (`DatasetShardSampler`, what `DistributedSampler` does): every rank holds the
   whole map-style dataset, draws the same global order (same seed, same epoch) and keeps every N-th
   index. Simple and fast; costs one copy of the data (or of its index) per rank.
2. Iterable sharding (`StridedIterable`): the data is a stream you cannot index (files read in order,
   a web stream). Every rank reads the stream and keeps every N-th sample, also split across the
   DataLoader's worker processes. Little memory; every rank reads everything.
3. Batch-sampler sharding (`ShardedBatchSampler`): one sampler draws each *global* batch (weighted,
   class-balanced, length-bucketed...), identically on every rank from a shared seed, and each rank
   takes its slice. Use it when the batch composition is a global decision.
4. Dispatching (`DispatchLoader`): only rank 0 holds and loads the data; it scatters each global
   batch's slices to the others. Least memory on the other ranks; rank 0 and its link become the bottleneck.

Uneven sizes: 1, 3 and 4 pad the last round by repeating samples from the start of the epoch's order
(or drop it with drop_last=True); 2 cannot go back in a stream, so it drops the last incomplete round.

    torchrun --nproc_per_node=2 utils/sharding.py --benchmark    # memory and time per batch of each
    torchrun --nproc_per_node=4 utils/sharding.py --memory       # memory per rank: a copy each, or memory-mapped
    python utils/sharding.py --throughput                        # lesson 02's tokens/s at 1, 2, 4 ranks, 5 runs
                                                                 # each -> notebooks/data/02_throughput.json
"""

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from utils.course.measured import loaded_and_warned, wait_until_quiet
from utils.data import map_tokens, write_token_file
from utils.distributed_utils import destroy_process_group


def _rank_and_world(rank, world_size):
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world_size


def _pad_or_drop(order: list[int], multiple: int, drop_last: bool) -> list[int]:
    """Cut `order` to a multiple of `multiple`, or pad it by repeating it from the start."""
    if drop_last:
        return order[: len(order) // multiple * multiple]
    total = math.ceil(len(order) / multiple) * multiple
    repeats = math.ceil(total / len(order)) if order else 0
    return (order * repeats)[:total]


# --------------------------------------------------------------------------------------------------
# 1. Dataset sharding: each rank keeps every N-th index of a shared global order
# --------------------------------------------------------------------------------------------------


class DatasetShardSampler(Sampler):
    """A hand-written DistributedSampler: the same indices, in the same order.

    Every rank shuffles with the same generator seed (seed + epoch), so all ranks agree on the global
    order without talking; rank r keeps positions r, r + N, r + 2N, ... Call set_epoch(e) before each
    epoch, or every epoch repeats the first one's order.
    """

    def __init__(self, dataset_size, rank=None, world_size=None, *, shuffle=True, seed=0, drop_last=False):
        self.n, (self.rank, self.world_size) = dataset_size, _rank_and_world(rank, world_size)
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def _global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def __iter__(self):
        order = _pad_or_drop(self._global_order(), self.world_size, self.drop_last)
        return iter(order[self.rank :: self.world_size])

    def __len__(self):
        rounds = self.n // self.world_size if self.drop_last else math.ceil(self.n / self.world_size)
        return rounds


# --------------------------------------------------------------------------------------------------
# 2. Iterable sharding: keep every N-th sample of a stream (and split it across DataLoader workers)
# --------------------------------------------------------------------------------------------------


class StridedIterable(IterableDataset):
    """Yield this rank's (and this DataLoader worker's) share of a stream of samples.

    `make_stream()` returns a fresh iterator over the samples, the same on every rank. The stream is
    read in rounds of N x W samples (N ranks, W DataLoader workers per rank); reader (rank, worker)
    keeps sample number rank * W + worker of each round. The last, incomplete round is dropped, so
    that every reader yields the same number of samples.
    """

    def __init__(self, make_stream, rank=None, world_size=None):
        self.make_stream = make_stream
        self.rank, self.world_size = _rank_and_world(rank, world_size)

    def __iter__(self):
        worker = get_worker_info()  # None in the main process, else this worker's id and count
        workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        readers, me = self.world_size * workers, self.rank * workers + worker_id
        mine = None
        for position, sample in enumerate(self.make_stream()):
            if position % readers == me:
                mine = sample
            if position % readers == readers - 1:  # a round is complete: hand out our sample of it
                yield mine


# --------------------------------------------------------------------------------------------------
# 3. Batch-sampler sharding: draw each global batch once (same seed everywhere), slice it per rank
# --------------------------------------------------------------------------------------------------


class GlobalBatchSampler(Sampler):
    """Group a sampler's indices into global batches of N x b (the last one padded or dropped).

    The wrapped sampler must draw the same indices on every rank: give it a generator, which
    set_epoch reseeds with seed + epoch (RandomSampler and WeightedRandomSampler take one).
    """

    def __init__(self, sampler, batch_size, rank=None, world_size=None, *, seed=0, drop_last=False):
        self.sampler, self.batch_size = sampler, batch_size
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.seed, self.drop_last, self.epoch = seed, drop_last, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def global_batches(self):
        if hasattr(self.sampler, "generator"):
            self.sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        size = self.batch_size * self.world_size
        order = _pad_or_drop(list(self.sampler), size, self.drop_last)
        return [order[i : i + size] for i in range(0, len(order), size)]

    def __iter__(self):
        return iter(self.global_batches())

    def __len__(self):
        size = self.batch_size * self.world_size
        return len(self.sampler) // size if self.drop_last else math.ceil(len(self.sampler) / size)


class ShardedBatchSampler(GlobalBatchSampler):
    """This rank's slice (b indices) of each global batch: pass it as DataLoader(batch_sampler=...)."""

    def __iter__(self):
        b, r = self.batch_size, self.rank
        return iter(batch[r * b : (r + 1) * b] for batch in self.global_batches())


# --------------------------------------------------------------------------------------------------
# 4. Dispatching: rank 0 loads each global batch and scatters the slices
# --------------------------------------------------------------------------------------------------


class DispatchLoader:
    """Rank 0 loads global batches of N x b and scatters b samples to each rank; the others hold no data.

    `dataset` is only needed on rank 0 (pass None elsewhere). Samples are tensors or tuples of tensors
    of a fixed shape. Rank 0 first broadcasts the number of batches and the shapes, so every rank
    knows how many steps the epoch has and what to receive.
    """

    def __init__(self, dataset, batch_size, *, shuffle=True, seed=0, drop_last=False, device="cpu", num_workers=0):
        self.dataset, self.batch_size, self.device = dataset, batch_size, torch.device(device)
        self.shuffle, self.seed, self.drop_last, self.num_workers = shuffle, seed, drop_last, num_workers
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def _global_loader(self):
        """Rank 0's loader of global batches (drawn as strategy 3 draws them) and its length."""
        if self.shuffle:
            sampler = torch.utils.data.RandomSampler(self.dataset, generator=torch.Generator())
        else:
            sampler = torch.utils.data.SequentialSampler(self.dataset)
        batches = GlobalBatchSampler(
            sampler, self.batch_size, 0, self.world_size, seed=self.seed, drop_last=self.drop_last
        )
        batches.set_epoch(self.epoch)
        return DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers), len(batches)

    def __iter__(self):
        header = [None]
        if self.rank == 0:
            loader, steps = self._global_loader()
            loader = iter(loader)
            first = next(loader, None)
            single = not isinstance(first, list | tuple)
            fields = [first] if single else list(first or [])
            header = [(steps if first is not None else 0, [(tuple(t.shape[1:]), t.dtype) for t in fields], single)]
        dist.broadcast_object_list(header, src=0)  # every rank learns the number of steps and the shapes
        steps, shapes, single = header[0]
        for step in range(steps):
            if self.rank == 0:
                batch = first if step == 0 else next(loader)
                fields = [batch] if single else list(batch)
            received = []
            for i, (shape, dtype) in enumerate(shapes):
                out = torch.empty((self.batch_size, *shape), dtype=dtype, device=self.device)
                slices = None
                if self.rank == 0:  # rank r receives rows r*b .. (r+1)*b - 1 of the global batch
                    slices = [s.contiguous().to(self.device) for s in fields[i].chunk(self.world_size)]
                dist.scatter(out, slices, src=0)
                received.append(out)
            yield received[0] if single else received

    def __len__(self):
        raise TypeError("a DispatchLoader's length is known on rank 0 only; it is sent with the first batch")


# --------------------------------------------------------------------------------------------------
# Benchmarks: host memory per rank (PSS: shared pages count 1/k in each of k processes), time per batch
# --------------------------------------------------------------------------------------------------


def rss_mb() -> float:
    """This process's resident memory now, in MB (VmRSS on Linux; peak RSS elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if os.uname().sysname == "Darwin" else peak / 1024


def memory_mb() -> dict:
    """The memory this process holds for its data now, in MB: rss (every page it touches, shared ones included)
    and pss (its share: a page that k processes map counts 1/k in each), summed over /proc/self/smaps (Linux;
    elsewhere both are the whole process's RSS).

    Program and library files (Python's and torch's code) are left out: every Python process on the machine maps
    them, so this process's share of them changes whenever another process starts or stops, whatever it holds.
    Freed memory is handed back first (release_freed_memory), so it is not counted.
    """
    release_freed_memory()
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return {"rss": rss_mb(), "pss": rss_mb()}
    totals, counted = {"rss": 0.0, "pss": 0.0}, True
    for line in smaps.read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if not first.endswith(":"):  # a mapping's header: address range, permissions, offset, device, inode, path
            fields = line.split(maxsplit=5)
            counted = not is_code_file(fields[5] if len(fields) > 5 else "")
        elif counted and first in ("Rss:", "Pss:"):
            totals[first[:-1].lower()] += int(line.split()[1]) / 1024
    return totals


PYTHON_EXECUTABLE = os.path.realpath(sys.executable)  # as /proc/self/smaps names it


def is_code_file(mapped_path: str) -> bool:
    """A shared library or the Python executable (mapped by every Python process), not data."""
    name = Path(mapped_path).name
    return name.endswith(".so") or ".so." in name or mapped_path == PYTHON_EXECUTABLE


def release_freed_memory():
    """Collect garbage, then hand the heap's freed pages back to the OS: glibc keeps them for reuse otherwise, so a
    reading would count memory already freed (more of it in a process that once freed a large block, as rank 0 does
    after writing the token file) or lose some in the middle of a measurement. memory_mb() calls it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


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


THROUGHPUT_FILE = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "02_throughput.json"
THROUGHPUT_ARGS = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8"]


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def throughput_benchmark(world_sizes, runs: int, steps: int, out: Path) -> dict:
    """Lesson 02's job throughput (tokens/s of all ranks together) at each world size, `runs` times each.

    Weak scaling: every rank keeps its batch (--batch-size 8), so the global batch grows with the ranks. The
    runs of different world sizes are interleaved, so a change in the machine's load hits all of them alike.
    """
    root = Path(__file__).resolve().parents[1]
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
