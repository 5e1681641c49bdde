"""Lesson 06's TODO 6 on its own, under torchrun (4 ranks as dp 2 x tp 2): the DP gradient average.

    torchrun --nproc_per_node=4 tests/workers/three_d_average.py exercises/06_3d_parallelism.py

The DP groups are made here from their definition ({0, 2} and {1, 3}: the same TP shard in both replicas), not
with the learner's grid (TODOs 1-3). Each rank gives its parameters gradients of its own; after the learner's
average_gradients every gradient must be the mean over the rank's DP group, computed here without communication.
Prints one line starting "TODO 6:" on rank 0 and exits 1 when that is not so.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.harness.blame import describe  # noqa: E402
from utils.distributed_utils import destroy_process_group, setup  # noqa: E402

DP_GROUPS = [[0, 2], [1, 3]]
SHAPES = [(3, 4), (5,), (2, 2, 2)]


def gradient(rank: int, index: int) -> torch.Tensor:
    """Rank `rank`'s gradient of parameter `index`: known to every rank, so the mean needs no communication."""
    return torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(100 * rank + index))


def looks_like(got: torch.Tensor, rank: int, index: int, mine: int) -> str:
    """What a wrong gradient is, in words, with the known mistake that gives it (recognised by its values)."""
    group = DP_GROUPS[mine]
    summed = sum(gradient(peer, index) for peer in group)
    world = sum(gradient(peer, index) for peer in range(4))
    candidates = {
        "its own gradient, unchanged: as if the average never reached p.grad (computed, never copied back)": (
            gradient(rank, index)
        ),
        "the sum over the group: as if it were not divided by the group's size": summed,
        "the mean over the whole world: as if all-reduced over the whole world, not the DP group": world / 4,
        f"the world's sum divided by {len(group)}: as if all-reduced over the whole world, not the DP group": world
        / len(group),
        f"the group's sum divided by 4, not by its size {len(group)}: as if divided twice (ReduceOp.AVG, then again) "
        "or by the world's size": summed / 4,
    }
    return next(
        (words for words, value in candidates.items() if torch.allclose(got, value, atol=1e-6)), "something else"
    )


def main() -> int:
    spec = importlib.util.spec_from_file_location("lesson06", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, rank, _, world_size = setup(0)
    assert world_size == 4, "run with --nproc_per_node=4"
    groups = [dist.new_group(ranks) for ranks in DP_GROUPS]  # every rank creates both, in the same order
    mine = next(i for i, ranks in enumerate(DP_GROUPS) if rank in ranks)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for index, p in enumerate(params):
        p.grad = gradient(rank, index)
    problem = None
    try:
        script.average_gradients(params, groups[mine])
    except NotImplementedError as error:
        problem = f"not done yet ({error})"
    except Exception as error:  # noqa: BLE001 - a learner's mistake that raises: say what it raised
        problem = describe(error, "average_gradients")
    for index, p in enumerate(params):
        if problem:
            break
        want = sum(gradient(peer, index) for peer in DP_GROUPS[mine]) / len(DP_GROUPS[mine])
        off = (p.grad - want).abs()
        if float(off.max()) > 1e-6:
            at = tuple(int(i) for i in (off > 1e-6).nonzero()[0])  # the first element that differs
            problem = (
                f"rank {rank}: parameter {index}'s gradient should be the mean over its DP group {DP_GROUPS[mine]}; "
                f"it is {looks_like(p.grad, rank, index, mine)} (first at element {list(at)}: got "
                f"{float(p.grad[at]):.4f}, want {float(want[at]):.4f})"
            )
    problems: list = [None] * world_size
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p), None)
    if rank == 0 and found:
        print(f"TODO 6: {found}", flush=True)
    destroy_process_group()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
