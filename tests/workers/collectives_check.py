"""Run under torchrun by tests/test_01_collectives.py: check each TODO of a lesson-01 file.

Imports the lesson file (solution or a learner's exercise) as a module and compares each hand-written
piece with the torch.distributed collective that does the same job, on several shapes, including
tensors with fewer elements than ranks. Rank 0 writes {todo: {shape: largest difference or error}}.
Arguments: LESSON OUT [CHECK ...] (default: every check).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from utils.course.lessons import load_script
from utils.distributed_utils import destroy_process_group, setup

SHAPES = [(1,), (3,), (5,), (4, 6), (1000,), (33, 17)]


def rank_tensor(shape, rank):
    # Integers in float32: every summation order gives the exact same result.
    return torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(rank * 7 + len(shape))).float()


def largest_gap(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0  # a rank's chunk may be empty


def check(compare, world_size):
    results = {}
    for shape in SHAPES:
        try:
            difference = torch.tensor(float(compare(shape)))
        except NotImplementedError as error:
            results[str(shape)] = f"not done: {error}"
            continue
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        results[str(shape)] = difference.item()
    return results


def main():
    lesson_path, out_path = sys.argv[1], sys.argv[2]
    _, rank, _, world_size = setup(seed=0)
    lesson = load_script(lesson_path, "lesson01")

    def todo1_reduce_scatter(shape):
        x = rank_tensor(shape, rank)
        expected = x.clone()
        dist.all_reduce(expected)
        chunks = list(x.view(-1).tensor_split(world_size))
        lesson.ring_reduce_scatter(chunks)
        owned = (rank + 1) % world_size  # the chunk this rank must hold, summed, after the phase
        # Read from the tensor, not the list: the chunks are views, and the sum must land in the tensor they view.
        return largest_gap(
            x.view(-1).tensor_split(world_size)[owned], expected.view(-1).tensor_split(world_size)[owned]
        )

    def todo2_all_gather(shape):
        total = sum(rank_tensor(shape, r) for r in range(world_size)).view(-1)
        expected_chunks = total.tensor_split(world_size)
        owned = (rank + 1) % world_size
        gathered = torch.full_like(total, float("nan"))
        chunks = list(gathered.tensor_split(world_size))  # views into one tensor, as ring_all_reduce makes them
        chunks[owned].copy_(expected_chunks[owned])  # start from the state TODO 1 leaves behind
        lesson.ring_all_gather(chunks)
        return max(largest_gap(c, e) for c, e in zip(gathered.tensor_split(world_size), expected_chunks))

    def ring_all_reduce(shape):
        x = rank_tensor(shape, rank)
        expected = x.clone()
        dist.all_reduce(expected)
        return (lesson.ring_all_reduce(x) - expected).abs().max().item()

    def todo3_rs_ag(shape):
        x = rank_tensor(shape, rank)
        expected = x.clone()
        dist.all_reduce(expected)
        result = lesson.all_reduce_from_collectives(x)
        assert result.shape == expected.shape, f"shape {tuple(result.shape)} instead of {tuple(expected.shape)}"
        return (x - expected).abs().max().item()  # in place: x itself must hold the sum

    checks = {"todo1": todo1_reduce_scatter, "todo2": todo2_all_gather, "ring": ring_all_reduce, "todo3": todo3_rs_ag}
    chosen = sys.argv[3:] or list(checks)  # the test re-runs one check at a time when a launch crashes
    results = {name: check(checks[name], world_size) for name in chosen}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy_process_group()


if __name__ == "__main__":
    main()
