"""Lesson 01's mutants: plausible mistakes in each TODO of solutions/01_collectives.py, each of which
`make check LESSON=01` must report as a failure of that TODO (run them with `make mutants LESSON=01`)."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the ring's reduce-scatter phase
    Mutant(
        todo=1,
        what="adds the incoming chunk into the chunk it just sent (receive index = send index)",
        find="send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size",
        replace="send_index, receive_index = (rank - step) % world_size, (rank - step) % world_size",
    ),
    Mutant(
        todo=1,
        what="overwrites its chunk with the incoming one instead of adding",
        find="chunks[receive_index] += incoming",
        replace="chunks[receive_index].copy_(incoming)",
    ),
    # TODO 2: the ring's all-gather phase
    Mutant(
        todo=2,
        what="sends chunk (rank - s) instead of its finished chunk (rank + 1 - s)",
        find="send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size",
        replace="send_index, receive_index = (rank - step) % world_size, (rank - 1 - step) % world_size",
    ),
    Mutant(
        todo=2,
        what="one step too few (n - 2): one chunk never arrives",
        find="    for step in range(world_size - 1):\n        send_index, receive_index = (rank + 1 - step)",
        replace="    for step in range(world_size - 2):\n        send_index, receive_index = (rank + 1 - step)",
    ),
    # TODO 3: all-reduce = reduce-scatter + all-gather
    Mutant(
        todo=3,
        what="rounds the padded length down: a tensor not divisible by n loses its tail",
        find="padded = torch.zeros(-(-flat.numel() // world_size) * world_size,",
        replace="padded = torch.zeros(max(flat.numel() // world_size, 1) * world_size,",
    ),
    Mutant(
        todo=3,
        what="averages instead of summing",
        find="dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM)",
        replace="dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.AVG)",
    ),
    Mutant(
        todo=3,
        what="returns the sum in a new tensor instead of writing it into `tensor`",
        find="    flat.copy_(padded[: flat.numel()])",
        replace="    return padded[: flat.numel()].view_as(tensor).clone()",
    ),
    # TODO 4: lab, a collective some ranks skip
    Mutant(
        todo=4,
        what="a rank with an empty batch returns before the all-reduce (the lab's bug)",
        find="    count = (tokens >= 0).sum().to(torch.float64)  # an empty",
        replace=(
            "    if tokens.numel() == 0:\n        return 0\n"
            "    count = (tokens >= 0).sum().to(torch.float64)  # an empty"
        ),
    ),
    Mutant(
        todo=4,
        what="counts the padding as tokens",
        find="count = (tokens >= 0).sum().to(torch.float64)  # an",
        replace="count = torch.tensor(float(tokens.numel()))  # an",
    ),
    # TODO 5: lab, a rank that raises
    Mutant(
        todo=5,
        what="max() of an empty slice raises on the last rank (the lab's bug)",
        find="local = mine.max() if mine.numel() else",
        replace="local = mine.max() if True else",
    ),
    Mutant(
        todo=5,
        what="an empty slice contributes 0, which wins when every value is negative",
        find='torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)',
        replace="torch.tensor(0.0, dtype=values.dtype, device=values.device)",
    ),
    # TODO 6: lab, shapes that differ between ranks
    Mutant(
        todo=6,
        what="pads to its own length instead of the longest (the shapes still differ)",
        find="longest = int(lengths.max())",
        replace="longest = values.numel()",
    ),
    Mutant(
        todo=6,
        what="returns the padded gather (the padding zeros stay in)",
        find="return torch.cat([row[:n] for row, n in zip(gathered.view(world_size, longest), lengths.tolist())])",
        replace="return gathered",
    ),
    # TODO 7: lab, send/recv in the wrong order
    Mutant(
        todo=7,
        what="both partners send first (the lab's bug): each send waits for a receive",
        find="    if rank % 2 == 0:\n        dist.send(tensor, dst=partner)",
        replace="    if True:\n        dist.send(tensor, dst=partner)",
    ),
    Mutant(
        todo=7,
        what="both partners receive first",
        find="    if rank % 2 == 0:\n        dist.send(tensor, dst=partner)",
        replace="    if False:\n        dist.send(tensor, dst=partner)",
    ),
    # TODO 8: lab, a rank-dependent branch around a collective
    Mutant(
        todo=8,
        what="each rank stops on its own loss, before the all-reduce (the lab's bug)",
        find="        loss = torch.tensor(local_loss, dtype=torch.float64)\n",
        replace=(
            "        if local_loss < target:\n            return step + 1\n"
            "        loss = torch.tensor(local_loss, dtype=torch.float64)\n"
        ),
    ),
    Mutant(
        todo=8,
        what="sums the losses instead of averaging: every rank agrees, on the wrong step",
        find="dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank now holds the same number...",
        replace="dist.all_reduce(loss)  # every rank now holds the same number...",
    ),
]
