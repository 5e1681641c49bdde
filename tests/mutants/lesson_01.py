"""Lesson 01's mutants: plausible mistakes in each TODO of solutions/01_collectives.py, each of which
`make check LESSON=01` must report as a failure of that TODO (run them with `make mutants LESSON=01`)."""

from tests.mutants import Mutant

# Names the TODO comments may use (tests/harness/todo_comments.py does not count them as given away).
COMMENT_MAY_NAME = {
    "pass_around_ring": "the helper defined just above TODO 1, which section 3 of the notebook introduces",
    "send": "a point-to-point call of torch.distributed, typed in section 2 of the notebook; TODO 7's title names it",
    "recv": "its receiving half, named alike",
    "isend": "the send that does not wait, typed in section 2 of the notebook",
}

MUTANTS = [
    # TODO 1: the ring's reduce-scatter phase
    Mutant(
        todo=1,
        what="adds the incoming chunk into the chunk it just sent (receive index = send index)",
        find="send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size",
        replace="send_index, receive_index = (rank - step) % world_size, (rank - step) % world_size",
        shows=("into the chunk this rank just sent",),
    ),
    Mutant(
        todo=1,
        what="overwrites its chunk with the incoming one instead of adding",
        find="chunks[receive_index] += incoming",
        replace="chunks[receive_index].copy_(incoming)",
        shows=("replaced this rank's own values",),
    ),
    Mutant(
        todo=1,
        what="rebinds the list entry (chunks[i] = chunks[i] + incoming): the sum never reaches the tensor's view",
        find="chunks[receive_index] += incoming",
        replace="chunks[receive_index] = chunks[receive_index] + incoming",
        shows=("own values", "never reached"),
    ),
    Mutant(
        todo=1,
        what="sizes the receive like the chunk it sends: unequal tensor_split chunks no longer match",
        find="incoming = buffer[: chunks[receive_index].numel()]",
        replace="incoming = torch.empty_like(chunks[send_index])",
        shows=("sized like the chunk it sends",),
    ),
    # TODO 2: the ring's all-gather phase
    Mutant(
        todo=2,
        what="sends chunk (rank - s) instead of its finished chunk (rank + 1 - s)",
        find="send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size",
        replace="send_index, receive_index = (rank - step) % world_size, (rank - 1 - step) % world_size",
        shows=("did not hold yet",),
    ),
    Mutant(
        todo=2,
        what="one step too few (n - 2): one chunk never arrives",
        find="    for step in range(world_size - 1):\n        send_index, receive_index = (rank + 1 - step)",
        replace="    for step in range(world_size - 2):\n        send_index, receive_index = (rank + 1 - step)",
        shows=("stopped a step early",),
    ),
    # TODO 3: all-reduce = reduce-scatter + all-gather
    Mutant(
        todo=3,
        what="rounds the padded length down: a tensor not divisible by n loses its tail",
        find="padded = torch.zeros(-(-flat.numel() // world_size) * world_size,",
        replace="padded = torch.zeros(max(flat.numel() // world_size, 1) * world_size,",
        shows=("raised", "must match the existing size"),
    ),
    Mutant(
        todo=3,
        what="averages instead of summing",
        find="dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM)",
        replace="dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.AVG)",
        shows=("the mean over the ranks",),
    ),
    Mutant(
        todo=3,
        what="returns the sum in a new tensor instead of writing it into `tensor`",
        find="    flat.copy_(padded[: flat.numel()])",
        replace="    return padded[: flat.numel()].view_as(tensor).clone()",
        shows=("own values", "written into it"),
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
        shows=("never joined", "without calling the collective"),
    ),
    Mutant(
        todo=4,
        what="counts the padding as tokens",
        find="count = (tokens >= 0).sum().to(torch.float64)  # an",
        replace="count = torch.tensor(float(tokens.numel()))  # an",
        shows=("padding",),
    ),
    # TODO 5: lab, a rank that raises
    Mutant(
        todo=5,
        what="max() of an empty slice raises on the last rank (the lab's bug)",
        find="local = mine.max() if mine.numel() else",
        replace="local = mine.max() if True else",
        shows=("raised RuntimeError at ", "01_collectives.py:", "(`local = mine.max()", "slice of the values is empty"),
    ),
    Mutant(
        todo=5,
        what="an empty slice contributes 0, which wins when every value is negative",
        find='torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)',
        replace="torch.tensor(0.0, dtype=values.dtype, device=values.device)",
        shows=("0 is what an empty slice brought",),
    ),
    # TODO 6: lab, shapes that differ between ranks
    Mutant(
        todo=6,
        what="pads to its own length instead of the longest (the shapes still differ)",
        find="longest = int(lengths.max())",
        replace="longest = values.numel()",
        shows=("mismatch", "its own length"),
    ),
    Mutant(
        todo=6,
        what="returns the padded gather (the padding zeros stay in)",
        find="return torch.cat([row[:n] for row, n in zip(gathered.view(world_size, longest), lengths.tolist())])",
        replace="return gathered",
        shows=("padding is still in",),
    ),
    Mutant(
        todo=6,
        what="trims every rank's row to its own length instead of that rank's",
        find="return torch.cat([row[:n] for row, n in zip(gathered.view(world_size, longest), lengths.tolist())])",
        replace="return torch.cat([row[: values.numel()] for row in gathered.view(world_size, longest)])",
        shows=("cut every row to its own length",),
    ),
    # TODO 7: lab, send/recv in the wrong order
    Mutant(
        todo=7,
        what="both partners send first (the lab's bug): each send waits for a receive",
        find="    if rank % 2 == 0:\n        dist.send(tensor, dst=partner)",
        replace="    if True:\n        dist.send(tensor, dst=partner)",
        shows=("both partners",),
    ),
    Mutant(
        todo=7,
        what="both partners receive first",
        find="    if rank % 2 == 0:\n        dist.send(tensor, dst=partner)",
        replace="    if False:\n        dist.send(tensor, dst=partner)",
        shows=("both partners",),
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
        shows=("without calling the collective", "own loss"),
    ),
    Mutant(
        todo=8,
        what="sums the losses instead of averaging: every rank agrees, on the wrong step",
        find="dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank now holds the same number...",
        replace="dist.all_reduce(loss)  # every rank now holds the same number...",
        shows=("sum of the ranks' losses",),
    ),
]

# The solution's code that several variants replace whole.
COUNT = "    count = (tokens >= 0).sum().to(torch.float64)  # an empty batch counts 0, and still joins the all-reduce\n"
SWAP_IN_ORDER = (
    "    if rank % 2 == 0:\n        dist.send(tensor, dst=partner)\n        dist.recv(received, src=partner)\n"
    "    else:\n        dist.recv(received, src=partner)\n        dist.send(tensor, dst=partner)\n"
)

VARIANTS = [  # correct answers written another way: each TODO's check must accept them
    # TODO 1: the ring's reduce-scatter phase
    Mutant(
        todo=1,
        what="the step's exchange written out with isend and irecv, each waited for",
        find="        pass_around_ring(chunks[send_index], incoming)\n",
        replace="        sending = dist.isend(chunks[send_index], dst=(rank + 1) % world_size)\n"
        "        dist.irecv(incoming, src=(rank - 1) % world_size).wait()\n        sending.wait()\n",
    ),
    Mutant(
        todo=1,
        what="a fresh buffer per step, indices kept non-negative by hand, add_ instead of +=",
        find="    buffer = torch.empty_like(chunks[0])  # tensor_split makes chunk 0 the largest\n"
        "    for step in range(world_size - 1):\n"
        "        send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size\n"
        "        incoming = buffer[: chunks[receive_index].numel()]\n"
        "        pass_around_ring(chunks[send_index], incoming)\n"
        "        chunks[receive_index] += incoming\n",
        replace="    for step in range(world_size - 1):\n"
        "        send_index = (rank - step + world_size) % world_size\n"
        "        receive_index = (send_index - 1 + world_size) % world_size\n"
        "        incoming = torch.zeros_like(chunks[receive_index])\n"
        "        pass_around_ring(chunks[send_index], incoming)\n"
        "        chunks[receive_index].add_(incoming)\n",
    ),
    # TODO 2: the ring's all-gather phase
    Mutant(
        todo=2,
        what="follows the chunk it holds last instead of computing both indices from the step",
        find="    for step in range(world_size - 1):\n"
        "        send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size\n"
        "        pass_around_ring(chunks[send_index], chunks[receive_index])\n",
        replace="    held = (rank + 1) % world_size\n    for _ in range(world_size - 1):\n"
        "        arriving = (held - 1) % world_size\n        pass_around_ring(chunks[held], chunks[arriving])\n"
        "        held = arriving\n",
    ),
    Mutant(
        todo=2,
        what="both halves of the exchange asynchronous (isend and irecv), then waits for both",
        find="        pass_around_ring(chunks[send_index], chunks[receive_index])\n",
        replace="        requests = [dist.isend(chunks[send_index], dst=(rank + 1) % world_size),\n"
        "                    dist.irecv(chunks[receive_index], src=(rank - 1) % world_size)]\n"
        "        for request in requests:\n            request.wait()\n",
    ),
    # TODO 3: all-reduce = reduce-scatter + all-gather
    Mutant(
        todo=3,
        what="pads with F.pad, uses the *_tensor names of the two collectives, copies back with view_as",
        find="    flat = tensor.view(-1)\n"
        "    padded = torch.zeros(-(-flat.numel() // world_size) * world_size, dtype=tensor.dtype, "
        "device=tensor.device)\n"
        "    padded[: flat.numel()] = flat\n"
        "    shard = torch.empty(padded.numel() // world_size, dtype=tensor.dtype, device=tensor.device)\n"
        "    dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM)\n"
        "    dist.all_gather_single(padded, shard)\n"
        "    flat.copy_(padded[: flat.numel()])\n",
        replace="    count = tensor.numel()\n"
        "    padded = torch.nn.functional.pad(tensor.flatten(), (0, (-count) % world_size))\n"
        "    shard = padded.new_empty(padded.numel() // world_size)\n"
        "    dist.reduce_scatter_tensor(shard, padded)\n"
        "    dist.all_gather_into_tensor(padded, shard)\n"
        "    tensor.copy_(padded[:count].view_as(tensor))\n",
    ),
    Mutant(
        todo=3,
        what="rounds up with math.ceil, concatenates the padding, waits on asynchronous collectives",
        find="    padded = torch.zeros(-(-flat.numel() // world_size) * world_size, dtype=tensor.dtype, "
        "device=tensor.device)\n"
        "    padded[: flat.numel()] = flat\n"
        "    shard = torch.empty(padded.numel() // world_size, dtype=tensor.dtype, device=tensor.device)\n"
        "    dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM)\n"
        "    dist.all_gather_single(padded, shard)\n",
        replace="    import math\n\n    per_rank = math.ceil(flat.numel() / world_size)\n"
        "    padded = torch.cat([flat, flat.new_zeros(per_rank * world_size - flat.numel())])\n"
        "    shard = flat.new_empty(per_rank)\n"
        "    dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM, async_op=True).wait()\n"
        "    dist.all_gather_single(padded, shard, async_op=True).wait()\n",
    ),
    Mutant(
        todo=3,
        what="the list forms of the two collectives, on views of the padded tensor",
        find="    dist.reduce_scatter_single(shard, padded, op=dist.ReduceOp.SUM)\n"
        "    dist.all_gather_single(padded, shard)\n",
        replace="    dist.reduce_scatter(shard, list(padded.chunk(world_size)))\n"
        "    dist.all_gather(list(padded.chunk(world_size)), shard)\n",
    ),
    # TODO 4: lab, a collective some ranks skip
    Mutant(
        todo=4,
        what="keeps the branch but joins the all-reduce with a zero count",
        find=COUNT,
        replace="    if tokens.numel() == 0:\n        count = torch.zeros((), dtype=torch.float64)\n"
        "    else:\n        count = (tokens >= 0).sum().to(torch.float64)\n",
    ),
    Mutant(
        todo=4,
        what="counts with count_nonzero in an integer tensor",
        find=COUNT,
        replace="    count = torch.count_nonzero(tokens >= 0).reshape(1)\n",
    ),
    # TODO 5: lab, a rank that raises
    Mutant(
        todo=5,
        what="an empty slice brings the smallest value, which never beats the largest",
        find='    local = mine.max() if mine.numel() else torch.tensor(float("-inf"), dtype=values.dtype, '
        "device=values.device)\n",
        replace="    local = mine.max() if len(mine) > 0 else values.min()\n",
    ),
    Mutant(
        todo=5,
        what="appends -inf to every slice, so none is empty",
        find='    local = mine.max() if mine.numel() else torch.tensor(float("-inf"), dtype=values.dtype, '
        "device=values.device)\n",
        replace='    local = torch.cat([mine, values.new_full((1,), float("-inf"))]).max()\n',
    ),
    # TODO 6: lab, shapes that differ between ranks
    Mutant(
        todo=6,
        what="gathers the lengths as Python objects and the padded values as a list of tensors",
        find="    length = torch.tensor([values.numel()], device=values.device)\n"
        "    lengths = torch.empty(world_size, dtype=length.dtype, device=values.device)\n"
        "    dist.all_gather_single(lengths, length)\n"
        "    longest = int(lengths.max())\n"
        "    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)\n"
        "    padded[: values.numel()] = values\n"
        "    gathered = torch.empty(world_size * longest, dtype=values.dtype, device=values.device)\n"
        "    dist.all_gather_single(gathered, padded)\n"
        "    return torch.cat([row[:n] for row, n in zip(gathered.view(world_size, longest), lengths.tolist())])\n",
        replace="    lengths = [None] * world_size\n"
        "    dist.all_gather_object(lengths, values.numel())\n"
        "    longest = max(lengths)\n"
        "    padded = torch.cat([values, values.new_zeros(longest - values.numel())])\n"
        "    pieces = [torch.empty_like(padded) for _ in range(world_size)]\n"
        "    dist.all_gather(pieces, padded)\n"
        "    return torch.cat([piece[:n] for piece, n in zip(pieces, lengths)])\n",
    ),
    # TODO 7: lab, send/recv in the wrong order
    Mutant(
        todo=7,
        what="posts the send without waiting (isend), receives, then waits for the send",
        find=SWAP_IN_ORDER,
        replace="    request = dist.isend(tensor, dst=partner)\n    dist.recv(received, src=partner)\n"
        "    request.wait()\n",
    ),
    Mutant(
        todo=7,
        what="the higher rank of each pair sends first",
        find=SWAP_IN_ORDER,
        replace=SWAP_IN_ORDER.replace("rank % 2 == 0", "rank > partner"),
    ),
    Mutant(
        todo=7,
        what="posts the receive first (irecv), then sends",
        find=SWAP_IN_ORDER,
        replace="    request = dist.irecv(received, src=partner)\n    dist.send(tensor, dst=partner)\n"
        "    request.wait()\n",
    ),
    # TODO 8: lab, a rank-dependent branch around a collective
    Mutant(
        todo=8,
        what="sums the losses and divides by the world size itself",
        find="        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank now holds the same number...\n"
        "        if loss.item() < target:  # ...so every rank takes the same branch\n",
        replace="        dist.all_reduce(loss)\n        if loss.item() / dist.get_world_size() < target:\n",
    ),
    Mutant(
        todo=8,
        what="gathers every rank's loss and averages them on each rank",
        find="        loss = torch.tensor(local_loss, dtype=torch.float64)\n"
        "        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank now holds the same number...\n"
        "        if loss.item() < target:  # ...so every rank takes the same branch\n",
        replace="        everyone = [None] * dist.get_world_size()\n"
        "        dist.all_gather_object(everyone, local_loss)\n"
        "        if sum(everyone) / len(everyone) < target:\n",
    ),
]
