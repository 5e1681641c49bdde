"""Checks of utils/ddp_scratch.py and DistributedDataParallel, run under torchrun by tests/test_ddp_scratch.py.

    torchrun --nproc_per_node=N tests/workers/ddp_parity.py RESULTS.json

Each rank builds the model from a different seed (the wrapper's broadcast must fix that), trains a few
SGD steps on its slice of each global batch, and compares every parameter with a single-process
reference trained on the whole global batch. Rank 0 writes the largest differences (over all ranks)
and the bytes counted on the wire to RESULTS.json.
"""

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from utils.ddp_scratch import DataParallel, bus_bytes
from utils.distributed_utils import destroy_process_group, run_main, setup

STEPS, BATCH, LR = 4, 3, 0.1


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def global_batches(world_size, micro_steps):
    """The same global batches on every rank: STEPS x micro_steps x (world_size * BATCH) samples."""
    generator = torch.Generator().manual_seed(42)
    n = world_size * BATCH
    return [
        [(torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator)) for _ in range(micro_steps)]
        for _ in range(STEPS)
    ]


def train(model, batches, rank, world_size, data_parallel):
    """SGD on this rank's slice of each micro-batch; no_sync on all micro-steps but the last."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step_batches in batches:
        for i, (x, y) in enumerate(step_batches):
            if data_parallel:
                x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = i == len(step_batches) - 1
            context = model.no_sync() if (data_parallel and not last) else torch.enable_grad()
            with context:
                loss = nn.functional.mse_loss(model(x), y) / len(step_batches)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def max_diff(model, reference):
    ours = model.module if hasattr(model, "module") else model
    diffs = [(a - b).abs().max() for a, b in zip(ours.state_dict().values(), reference.state_dict().values())]
    worst = torch.stack(diffs).max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank
    return float(worst)


def main():
    _, rank, _, world_size = setup(seed=0)
    results = {"world_size": world_size}
    reference_init = make_model(seed=0)  # what rank 0 starts from
    for micro_steps in (1, 2):
        batches = global_batches(world_size, micro_steps)
        reference = copy.deepcopy(reference_init)
        train(reference, batches, rank, world_size, data_parallel=False)
        wrappers = {
            "scratch_one_bucket": lambda m: DataParallel(m),
            "scratch_small_buckets": lambda m: DataParallel(m, bucket_cap_mb=0.0002),
            "builtin": lambda m: DistributedDataParallel(m),
        }
        for name, wrap in wrappers.items():
            model = wrap(make_model(seed=rank))  # different weights per rank until the wrapper broadcasts
            train(model, batches, rank, world_size, data_parallel=True)
            key = f"{name}_accum{micro_steps}"
            results[f"max_diff_{key}"] = max_diff(model, reference)
            if isinstance(model, DataParallel):
                results[f"buckets_{key}"] = len(model.buckets)
                results[f"allreduce_bytes_{key}"] = model.allreduce_bytes / STEPS  # per optimizer step
                results[f"overlapped_{key}"] = model.buckets_overlapped
    params = list(reference_init.parameters())
    results["param_count"] = sum(p.numel() for p in params)
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    results["bus_bytes"] = bus_bytes(results["param_bytes"], world_size)
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=2))
    del model  # DDP holds the process group: free it before the group goes (else gloo's teardown can hang)
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
