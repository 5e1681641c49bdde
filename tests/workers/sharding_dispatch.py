"""Checks of utils.lesson_02.samplers's DispatchLoader (strategy 4), run under torchrun by tests/test_sharding.py.

    torchrun --nproc_per_node=N tests/workers/sharding_dispatch.py RESULTS.json

Only rank 0 holds the dataset (the sample indices 0..n-1); every rank records the indices it receives.
Rank 0 writes, for each case, the list of each rank's batches to RESULTS.json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from utils.distributed_utils import destroy_process_group, run_main, setup
from utils.lesson_02.samplers import DispatchLoader

# (dataset size, batch size per rank, drop_last, shuffle): even and uneven sizes
CASES = [(24, 2, False, True), (25, 2, False, True), (25, 2, True, False), (7, 3, False, False)]


def main():
    _, rank, _, world_size = setup(seed=0)
    results = []
    for n, batch_size, drop_last, shuffle in CASES:
        # Two fields per sample, like (inputs, targets): the index and the index's negative.
        dataset = TensorDataset(torch.arange(n), -torch.arange(n)) if rank == 0 else None
        loader = DispatchLoader(dataset, batch_size, shuffle=shuffle, seed=3, drop_last=drop_last)
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = []
            for indices, negatives in loader:
                assert torch.equal(negatives, -indices), "the two fields of a sample were scattered apart"
                batches.append(indices.tolist())
            gathered = [None] * world_size
            dist.all_gather_object(gathered, batches)
            epochs.append(gathered)  # epochs[e][rank] = that rank's batches
        results.append({"n": n, "batch_size": batch_size, "drop_last": drop_last, "shuffle": shuffle, "epochs": epochs})
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({"world_size": world_size, "cases": results}))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
