"""Data parallelism from scratch, on torch.distributed primitives: what DistributedDataParallel does.

    model = DataParallel(model, bucket_cap_mb=25)     # instead of DistributedDataParallel(model)
    loss_fn(model(x), y).backward()                   # gradients are averaged across ranks during backward
    optimizer.step()

Four ideas, in the order they appear below:
1. Every rank starts from the same weights: broadcast the parameters from rank 0.
2. Every rank ends backward with the same gradient: the average over ranks of the local gradients.
   Since all ranks hold equal batch sizes, the mean of their mean losses is the mean loss of the global
   batch, so N ranks with batch b take exactly the step one process takes with batch N*b.
3. Bucketing and overlap: a hook on each parameter fires as soon as its gradient is accumulated.
   Small gradients are copied into flat buckets (one all-reduce per bucket instead of per tensor, since
   each collective has a fixed latency cost), and a full bucket is all-reduced asynchronously while
   backward keeps computing the gradients of earlier layers. We wait for the buckets at the end of backward.
4. `no_sync()`: in gradient accumulation, the inner micro-steps only accumulate local gradients; the
   last micro-step communicates the accumulated sum once.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


class Bucket:
    """Some parameters whose gradients travel together in one flat tensor."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets, total = {}, 0  # id(parameter) -> where its gradient starts in `flat`
        for p in params:
            self.offsets[id(p)] = total
            total += p.numel()
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()  # ids of the parameters whose gradient is in `flat`
        self.work = None  # the handle of the asynchronous all-reduce, once launched

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def put(self, p: nn.Parameter):
        """Copy p's gradient into its slice of the flat buffer."""
        offset = self.offsets[id(p)]
        self.flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready.add(id(p))

    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def unpack(self):
        """Copy the averaged gradients back into each parameter's .grad."""
        for p in self.params:
            offset = self.offsets[id(p)]
            averaged = self.flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)


def bus_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `nbytes`: 2(N-1)/N x nbytes.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving (N-1)/N of the data per rank.
    """
    return 2 * (world_size - 1) / world_size * nbytes


class DataParallel(nn.Module):
    """A hand-written DistributedDataParallel: broadcast, bucketed asynchronous gradient all-reduce, no_sync."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False inside no_sync()
        self.allreduce_bytes = 0  # bytes of gradients all-reduced so far, all steps together
        self.buckets_overlapped = 0  # of its buckets, how many were launched while backward was still running

        # Idea 1. Same starting point everywhere: rank 0's parameters (and buffers) overwrite the others'.
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)

        # Idea 3. Buckets, filled in reverse order of the parameters: backward produces the last layers'
        # gradients first. The order depends only on the model, so it is the same on every rank;
        # and we launch buckets strictly in this order (below), so every rank issues the same
        # sequence of all-reduces even if hooks fire in a different order.
        cap_bytes = bucket_cap_mb * 2**20
        self.buckets: list[Bucket] = []
        current, current_bytes = [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            current.append(p)
            current_bytes += p.numel() * p.element_size()
            if current_bytes >= cap_bytes:
                self.buckets.append(Bucket(current))
                current, current_bytes = [], 0
        if current:
            self.buckets.append(Bucket(current))
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._next_to_launch = 0  # buckets are launched in list order: this one is next
        self._syncing = False  # True from the first hook of a synchronising backward until its end

        # Idea 2. A hook per parameter, called by autograd right after p.grad has been accumulated.
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients; the next one outside communicates."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _gradient_ready(self, p: nn.Parameter):
        if not self.require_sync:
            return
        if not self._syncing:
            # First gradient of this backward: ask autograd to call us back when backward has finished,
            # to wait for the buckets there (this is how DistributedDataParallel does it too).
            self._syncing = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        bucket = self._bucket_of[id(p)]
        bucket.put(p)
        # Launch every full bucket whose predecessors are launched: the same order on every rank.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():
            self._launch(self.buckets[self._next_to_launch])

    def _launch(self, bucket: Bucket):
        # AVG averages over ranks (gloo has no PREMUL_SUM; AVG works on gloo and NCCL alike).
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)
        self.allreduce_bytes += bucket.nbytes
        self._next_to_launch += 1

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce and write the averages into .grad. Runs at the end of backward."""
        if not self._syncing:
            return  # nothing to wait for (a no_sync backward, or already finished)
        self.buckets_overlapped = self._next_to_launch
        # A parameter that took no part in this forward has no hook call; send its gradient (or zeros)
        # anyway, so that every rank launches every bucket.
        for bucket in self.buckets[self._next_to_launch :]:
            for p in bucket.params:
                if id(p) not in bucket.ready:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    bucket.put(p)
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.unpack()
            bucket.ready.clear()
            bucket.work = None
        self._next_to_launch, self._syncing = 0, False
