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

utils/lesson_02/benchmarks.py measures what each one costs in memory and time per batch.
"""

import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info


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
