"""The four data-sharding strategies of utils/lesson_02/samplers.py: every sample exactly once per epoch.

Strategies 1-3 take the rank and world size as arguments, so one process can play every rank; the
dispatcher (4) needs real collectives and runs under torchrun (tests/workers/sharding_dispatch.py).
Uneven dataset sizes are padded by repetition (drop_last=False) or cut (drop_last=True); the
iterable strategy always drops the last incomplete round.
"""

import json
import math
import mmap
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, WeightedRandomSampler

from tests.harness.launch import ROOT, torchrun
from utils.lesson_02.host_memory import memory_mb
from utils.lesson_02.samplers import DatasetShardSampler, ShardedBatchSampler, StridedIterable


def check_epoch(per_rank: list[list[int]], n: int, round_size: int, drop_last: bool):
    """per_rank[r] = the indices rank r saw in one epoch, in order; rounds of round_size samples."""
    counts = {len(seen) for seen in per_rank}
    assert len(counts) == 1, f"ranks saw different numbers of samples {counts}: the shorter ones would hang"
    seen = Counter(i for ranks in per_rank for i in ranks)
    assert set(seen) <= set(range(n)), f"indices outside the dataset: {set(seen) - set(range(n))}"
    total = sum(seen.values())
    if drop_last:
        assert total == n // round_size * round_size, f"{total} samples kept of {n} (rounds of {round_size})"
        assert max(seen.values(), default=1) == 1, "a sample was seen twice although the tail is dropped"
    else:
        assert total == math.ceil(n / round_size) * round_size, f"{total} samples for {n} (rounds of {round_size})"
        assert set(seen) == set(range(n)), f"samples never seen: {sorted(set(range(n)) - set(seen))}"
        assert total - n == sum(c - 1 for c in seen.values()), "more repeats than the padding needs"


CASES = [(world, n, drop_last) for world in (2, 3, 4) for n in (24, 25, 7) for drop_last in (False, True)]


@pytest.mark.parametrize("world_size, n, drop_last", CASES)
def test_dataset_sharding_every_sample_once(world_size, n, drop_last):
    for epoch in range(2):
        per_rank = []
        for rank in range(world_size):
            sampler = DatasetShardSampler(n, rank, world_size, seed=5, drop_last=drop_last)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
            assert len(per_rank[-1]) == len(sampler)
        check_epoch(per_rank, n, world_size, drop_last)


@pytest.mark.parametrize("world_size, n, drop_last", CASES)
def test_dataset_sharding_is_distributed_sampler(world_size, n, drop_last):
    """The hand-written sampler gives exactly the indices of torch's DistributedSampler."""
    for rank in range(world_size):
        ours = DatasetShardSampler(n, rank, world_size, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(n), world_size, rank, shuffle=True, seed=5, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), f"rank {rank}/{world_size}, epoch {epoch}, n={n}"


def test_set_epoch_reshuffles():
    sampler = DatasetShardSampler(50, 0, 2, seed=0)
    first = list(sampler)
    assert list(sampler) == first, "without set_epoch every epoch has the same order"
    sampler.set_epoch(1)
    assert list(sampler) != first, "set_epoch(1) did not change the order"


@pytest.mark.parametrize("world_size, n", [(w, n) for w in (2, 3, 4) for n in (24, 25, 7)])
def test_iterable_sharding_every_sample_once(world_size, n):
    per_rank = [list(StridedIterable(lambda: iter(range(n)), rank, world_size)) for rank in range(world_size)]
    check_epoch(per_rank, n, world_size, drop_last=True)


def test_iterable_sharding_splits_across_dataloader_workers():
    """2 ranks x 2 DataLoader worker processes: four readers of the stream, each sample read by one."""
    n, world_size = 23, 2
    per_rank = []
    for rank in range(world_size):
        loader = DataLoader(StridedIterable(lambda: iter(range(n)), rank, world_size), batch_size=2, num_workers=2)
        per_rank.append([int(i) for batch in loader for i in batch])
    check_epoch(per_rank, n, world_size * 2, drop_last=True)


@pytest.mark.parametrize("world_size, n, drop_last", CASES)
def test_batch_sampler_sharding_every_sample_once(world_size, n, drop_last):
    batch_size = 2
    for epoch in range(2):
        per_rank, steps = [], set()
        for rank in range(world_size):
            sampler = RandomSampler(range(n), generator=torch.Generator())
            batches = ShardedBatchSampler(sampler, batch_size, rank, world_size, seed=1, drop_last=drop_last)
            batches.set_epoch(epoch)
            rank_batches = list(batches)
            steps.add(len(rank_batches))
            assert len(rank_batches) == len(batches)
            assert all(len(b) == batch_size for b in rank_batches), "every rank batch must be full"
            per_rank.append([i for b in rank_batches for i in b])
        assert len(steps) == 1
        check_epoch(per_rank, n, world_size * batch_size, drop_last)


def test_batch_sampler_sharding_shares_one_weighted_draw():
    """With weights, samples repeat; but the ranks' slices must be disjoint parts of one global draw."""
    weights = torch.linspace(0.1, 1.0, 40)
    world_size, batch_size = 4, 3
    slices = []
    for rank in range(world_size):
        sampler = WeightedRandomSampler(weights, num_samples=60, generator=torch.Generator())
        slices.append(list(ShardedBatchSampler(sampler, batch_size, rank, world_size, seed=7)))
    reference = WeightedRandomSampler(weights, num_samples=60, generator=torch.Generator().manual_seed(7))
    draw = list(reference)
    draw += draw[: -len(draw) % (world_size * batch_size)]  # padded like the sampler pads
    rebuilt = [i for step in zip(*slices) for b in step for i in b]
    assert rebuilt == draw, "the ranks' batches are not slices of the same global draw"


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatching_every_sample_once(world_size, tmp_path):
    results_path = tmp_path / "dispatch.json"
    torchrun(ROOT / "tests/workers/sharding_dispatch.py", world_size, [results_path], timeout=120).check()
    results = json.loads(results_path.read_text())
    assert results["world_size"] == world_size
    for case in results["cases"]:
        n, b, drop_last = case["n"], case["batch_size"], case["drop_last"]
        orders = []
        for per_rank in case["epochs"]:
            assert all(len(batch) == b for batches in per_rank for batch in batches)
            check_epoch([[i for batch in batches for i in batch] for batches in per_rank], n, world_size * b, drop_last)
            orders.append(per_rank)
        if case["shuffle"] and n > world_size * b:
            assert orders[0] != orders[1], "set_epoch did not change the order"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_memory_mb_counts_a_mapped_data_file_but_not_a_mapped_library(tmp_path):
    """The notebook's memory figures leave out program and library files: every Python process maps torch's code,
    so a process's share of it changes whenever another starts or stops. The same pages, mapped from a file named
    like a library, must not count; mapped from a data file, they must."""
    megabytes = 8
    for name, counted in (("tokens.bin", True), ("libtokens.so", False)):
        path = tmp_path / name
        path.write_bytes(os.urandom(megabytes * 2**20))
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            before = memory_mb()
            sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))  # touch every page
            after = memory_mb()
            grown = {key: after[key] - before[key] for key in before}
        if counted:
            assert grown["rss"] > 0.9 * megabytes, f"a mapped data file's pages should count: {grown}"
        else:
            assert abs(grown["rss"]) < 1 and abs(grown["pss"]) < 1, f"a library's pages should not count: {grown}"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="PSS is measured from Linux's /proc/self/smaps")
def test_memory_mapped_tokens_are_shared_between_ranks(tmp_path):
    """2 ranks: a copy per process costs each rank the whole file; a memory map costs each about half of it."""
    out = tmp_path / "memory.json"
    # cold: torchrun's own processes, not warm ranks forked from one parent (they would share its memory)
    args = ["--memory", "--megabytes", 16, "--metrics-out", out]
    torchrun(ROOT / "utils/lesson_02/benchmarks.py", 2, args, timeout=120, cold=True).check()
    copy, mapped = json.loads(out.read_text())["rows"]
    assert copy["how"] == "a copy per process" and mapped["how"] == "memory-mapped"
    assert min(copy["pss_mb"]) > 0.9 * 16, f"a private copy should cost the whole file: {copy}"
    assert max(mapped["pss_mb"]) < 0.6 * 16 + 1, f"the mapped file's pages should be shared by the 2 ranks: {mapped}"
    assert min(mapped["rss_mb"]) > 0.9 * 16, f"each rank touched every page: {mapped}"
