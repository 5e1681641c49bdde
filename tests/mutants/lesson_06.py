"""Lesson 06's mutants: the mistakes a learner makes in each TODO, each of which its test must catch."""

from tests.mutants import Mutant

# TODO 8's solution, line by line
NORM_BODY = (
    "    squares = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)\n"
    "    for p in stage.parameters():\n        if p.grad is None:\n            continue\n"
    '        copies = {"dp", "tp"} - ({"tp"} if hasattr(p, "tp_dim") else set())  # dimensions it is replicated over\n'
    "        if isinstance(p.grad, DTensor):  # built in: a placement per dimension of its mesh (FSDP2's and TP's)\n"
    "            names = p.grad.device_mesh.mesh_dim_names\n"
    "            copies -= {dim for dim, placement in zip(names, p.grad.placements) if not placement.is_replicate()}\n"
    "        if all(place[dim] == 0 for dim in copies):  # one copy of each replicated piece\n"
    "            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad\n"
    "            squares += local.double().pow(2).sum()\n"
    "    dist.all_reduce(squares)  # the other copies add zero: this sums the stages and the shards\n"
    "    return squares.sqrt()\n"
)
COPIES = 'copies = {"dp", "tp"} - ({"tp"} if hasattr(p, "tp_dim") else set())'
DTENSOR_SHARDS = (
    "        if isinstance(p.grad, DTensor):  # built in: a placement per dimension of its mesh (FSDP2's and TP's)\n"
    "            names = p.grad.device_mesh.mesh_dim_names\n"
    "            copies -= {dim for dim, placement in zip(names, p.grad.placements) if not placement.is_replicate()}\n"
)
ONE_COPY = "if all(place[dim] == 0 for dim in copies):  # one copy of each replicated piece"
LOCAL = "local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad"
ADD = "            squares += local.double().pow(2).sum()\n"
INDENTED_LOCAL_ADD = "            " + LOCAL + "\n" + ADD
ALL_REDUCE = "    dist.all_reduce(squares)  # the other copies add zero: this sums the stages and the shards\n"
RETURN = "    return squares.sqrt()\n"

MUTANTS = [
    # TODO 1: the coordinates of a rank
    Mutant(todo=1, what="PP innermost instead of TP (the TP all-reduce crosses nodes)",
           find='"pp": rank // (layout.dp * layout.tp),', replace='"pp": rank % layout.pp,',
           shows=("its pp differs", "pp were the innermost")),
    Mutant(todo=1, what="dp not wrapped at its size (counts replicas across stages)",
           find='"dp": rank // layout.tp % layout.dp,', replace='"dp": rank // layout.tp,',
           shows=("its dp differs", "not wrapped at its size")),
    Mutant(todo=1, what="pp divides by dp only, forgetting the tp ranks of each replica",
           find='"pp": rank // (layout.dp * layout.tp),', replace='"pp": rank // layout.dp,',
           shows=("its pp differs", "divided by dp only")),
    Mutant(todo=1, what="dp read from the lowest digit, as tp is (forgets to divide by tp first)",
           find='"dp": rank // layout.tp % layout.dp,', replace='"dp": rank % layout.dp,',
           shows=("its dp differs", "without dividing by tp")),
    # TODO 2: the groups of one dimension
    Mutant(todo=2, what="keys by the group's own coordinate: ranks that differ in it land in different groups",
           find="key = tuple(place[other] for other in DIMS if other != dim)",
           replace="key = tuple(place[other] for other in DIMS)",
           shows=("group 0", "every group is one rank")),
    Mutant(todo=2, what="keys by the stage only: a TP group swallows every replica of the stage",
           find="key = tuple(place[other] for other in DIMS if other != dim)", replace='key = (place["pp"],)',
           shows=("group 0", "the stage alone")),
    Mutant(todo=2, what="collects each rank's coordinate in the dimension instead of its global rank",
           find="groups.setdefault(key, []).append(rank)", replace="groups.setdefault(key, []).append(place[dim])",
           shows=("group 0", "coordinate in the dimension were collected")),
    # TODO 3: the process groups
    Mutant(todo=3, what="each rank creates only its own groups (torch: every rank waits forever)",
           find="            group = new_group(ranks)\n            if rank in ranks:\n",
           replace="            if rank in ranks:\n                group = new_group(ranks)\n",
           shows=("rank 1 creates", "only the groups it is in")),
    Mutant(todo=3, what="keeps the last group created, not the one it belongs to",
           find="            if rank in ranks:\n                groups[dim], members[dim] = group, ranks",
           replace="            groups[dim], members[dim] = group, ranks",
           shows=("it keeps", "kept the last")),
    Mutant(todo=3, what="stops at its own group: the dimension's later groups are never created on this rank",
           find="                groups[dim], members[dim] = group, ranks\n",
           replace="                groups[dim], members[dim] = group, ranks\n                break\n",
           shows=("rank 1 creates", "stopped creating")),
    # TODO 4: the replica's share of the batch
    Mutant(todo=4, what="slices by the TP coordinate: TP shards of one replica read different sequences",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]',
           replace='return batch.chunk(grid.layout.dp)[grid.coords["tp"] % grid.layout.dp]',
           shows=("same replica", "tp coordinate")),
    Mutant(todo=4, what="every replica reads the whole global batch",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]', replace="return batch",
           shows=("whole global batch",)),
    Mutant(todo=4, what="split(dp) for chunk(dp): parts of dp sequences instead of dp parts",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]',
           replace='return batch.split(grid.layout.dp)[grid.coords["dp"]]',
           shows=("as if split(dp)",)),
    # TODO 5: a pipeline neighbour's global rank
    Mutant(todo=5, what="the stage number taken as the global rank (lesson 05's one stage per rank)",
           find='return grid.members["pp"][stage]', replace="return stage",
           shows=("stage number were the global rank",)),
    Mutant(todo=5, what="the neighbour's rank without this rank's replica (always replica 0)",
           find='return grid.members["pp"][stage]',
           replace='return stage * grid.layout.dp * grid.layout.tp + grid.coords["tp"]',
           shows=("in replica 0",)),
    Mutant(todo=5, what="stage x tp + own shard: forgets the dp replicas between two stages",
           find='return grid.members["pp"][stage]', replace='return stage * grid.layout.tp + grid.coords["tp"]',
           shows=("forgetting the dp replicas",)),
    Mutant(todo=5, what="the neighbour looked up in the DP group instead of the PP group",
           find='return grid.members["pp"][stage]', replace='return grid.members["dp"][stage]',
           shows=("looked up in the DP group",)),
    # TODO 6: the data-parallel gradient average
    Mutant(todo=6, what="sums the gradients without dividing by the group's size",
           find="    flat /= dist.get_world_size(group)\n", replace="",
           shows=("sum over the group", "not divided")),
    Mutant(todo=6, what="divides by the world size instead of the DP group's",
           find="flat /= dist.get_world_size(group)", replace="flat /= dist.get_world_size()",
           shows=("divided by 4", "world's size")),
    Mutant(todo=6, what="averages the buffer but never copies it back into the gradients",
           find="        gradient.copy_(average.view_as(gradient))",
           replace="        gradient = average.view_as(gradient)",
           shows=("own gradient, unchanged", "never copied back")),
    Mutant(todo=6, what="ReduceOp.AVG, then divides by the group's size again",
           find="dist.all_reduce(flat, group=group)",
           replace="dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)",
           shows=("divided by 4", "divided twice")),
    Mutant(todo=6, what="all-reduces over the whole world instead of the DP group",
           find="dist.all_reduce(flat, group=group)", replace="dist.all_reduce(flat)",
           shows=("all-reduced over the whole world",)),
    # TODO 7: the built-in composition
    Mutant(todo=7, what="only the stage is wrapped: no per-block FSDP units",
           find='    for block in stage.blocks.values():\n        fully_shard(block, mesh=mesh["dp"], '
                'reshard_after_forward=one_stage)\n',
           replace="",
           shows=("none for blocks.0", "only the stage were wrapped")),
    Mutant(todo=7, what="no tensor parallelism: every TP rank holds whole projections",
           find='    tensor_parallel.apply_tensor_parallel(model, mesh["tp"])\n', replace="",
           shows=("not sharded over tp", "never applied")),
    Mutant(todo=7, what="the stage root is not wrapped: embeddings and head are never averaged over dp",
           find='    fully_shard(stage, mesh=mesh["dp"])  # the root', replace="    pass  # the root",
           shows=("none for the stage", "never averaged over dp")),
    Mutant(todo=7, what="the sub-meshes swapped: TP over the DP ranks, FSDP over the TP ranks",
           find='    tensor_parallel.apply_tensor_parallel(model, mesh["tp"])\n',
           replace='    mesh = {"pp": mesh["pp"], "dp": mesh["tp"], "tp": mesh["dp"]}\n'
                   '    tensor_parallel.apply_tensor_parallel(model, mesh["tp"])\n',
           shows=("not sharded over tp", "sub-meshes were swapped")),
    Mutant(todo=7, what="fully_shard without mesh= as in lesson 03: FSDP over the whole world, not the DP sub-mesh",
           find='        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=one_stage)\n'
                '    fully_shard(stage, mesh=mesh["dp"])',
           replace="        fully_shard(block, reshard_after_forward=one_stage)\n    fully_shard(stage)",
           shows=("TODO 7's code raised",)),
    Mutant(todo=7, what="reshard_after_forward left out: under the pipeline every micro-batch gathers each block again",
           find=', reshard_after_forward=one_stage)', replace=")",
           shows=("gathered again after forward", "FSDP's default")),
    Mutant(todo=7, what="the condition inverted: reshards under the pipeline, keeps whole blocks with one stage",
           find='one_stage = mesh["pp"].size() == 1', replace='one_stage = mesh["pp"].size() > 1',
           shows=("gathered again after forward", "inverted")),
    Mutant(todo=7, what="never reshards: with one stage the blocks stay whole and FSDP saves no parameter memory",
           find='one_stage = mesh["pp"].size() == 1', replace="one_stage = False",
           shows=("stayed gathered", "False in every run")),
    Mutant(todo=7, what="decides by the DP group's size instead of the pipeline's stages",
           find='one_stage = mesh["pp"].size() == 1', replace='one_stage = mesh["dp"].size() == 1',
           shows=("stayed gathered", "False in every run")),
    # TODO 8: the lab, a gradient norm every rank agrees on
    Mutant(todo=8, what="the handed-out logic in the learner's words: every rank adds everything it holds",
           find=NORM_BODY,
           replace=NORM_BODY.splitlines(keepends=True)[0] + "    for p in stage.parameters():\n"
                   "        if p.grad is not None:\n"
                   "            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad\n"
                   "            squares += local.double().pow(2).sum()\n"
                   "    dist.all_reduce(squares)\n    return squares.sqrt()\n",
           shows=("every rank adds the squares of everything", "counted once per copy")),
    Mutant(todo=8, what="every parameter taken for a TP shard: one TP keeps whole is added on every TP rank (DP right)",
           find=COPIES, replace='copies = {"dp"}',
           shows=("counted on every TP rank",)),
    Mutant(todo=8, what="only TP's copies skipped: every DP replica adds its copy of the averaged gradients",
           find=COPIES, replace='copies = set() if hasattr(p, "tp_dim") else {"tp"}',
           shows=("count dp times",)),
    Mutant(todo=8, what="tp_dim ignored: from scratch a TP shard is added on TP rank 0 only",
           find=COPIES, replace='copies = {"dp", "tp"}',
           shows=("only TP rank 0 adds", "others are missing")),
    Mutant(todo=8, what="FSDP2's DP shards taken for copies (as after DDP's average): added on DP rank 0 only",
           find=ONE_COPY, replace='if place["dp"] == 0 and all(place[dim] == 0 for dim in copies):',
           shows=("only DP rank 0 adds FSDP2's shards",)),
    Mutant(todo=8, what="DTensor placements ignored: built in, every shard added on rank (dp 0, tp 0) only",
           find=DTENSOR_SHARDS, replace="",
           shows=("a sharded piece",)),
    Mutant(todo=8, what="no all-reduce: each rank's norm of its own pieces",
           find=ALL_REDUCE, replace="",
           shows=("no collective adds the other ranks'",)),
    Mutant(todo=8, what="returns the sum of the squares: no square root",
           find=RETURN, replace="    return squares\n",
           shows=("not its square root",)),
    Mutant(todo=8, what="adds the parameters' norms (a square root per parameter), not their squares",
           find=ADD + ALL_REDUCE + RETURN,
           replace=ADD.replace(".pow(2).sum()", ".norm()") + ALL_REDUCE + "    return squares\n",
           shows=("every rank's norm", "one process's")),
    Mutant(todo=8, what="the square root before the all-reduce: adds the ranks' norms, not their squares",
           find=ALL_REDUCE + RETURN,
           replace="    norm = squares.sqrt()\n    dist.all_reduce(norm)\n    return norm\n",
           shows=("square root before the all-reduce",)),
    Mutant(todo=8, what="averages the ranks' squares (ReduceOp.AVG) to undo the copies",
           find=ONE_COPY + "\n" + INDENTED_LOCAL_ADD + ALL_REDUCE,
           replace="if True:\n" + INDENTED_LOCAL_ADD + "    dist.all_reduce(squares, op=dist.ReduceOp.AVG)\n",
           shows=("every rank's norm", "one process's")),
    Mutant(todo=8, what="the stages taken for copies too: only the first stage adds its squares",
           find=COPIES, replace='copies = {"pp", "dp", "tp"} - ({"tp"} if hasattr(p, "tp_dim") else set())',
           shows=("only the first stage adds",)),
    Mutant(todo=8, what="squares a DTensor gradient without to_local(): a DTensor added to a tensor",
           find=INDENTED_LOCAL_ADD, replace=INDENTED_LOCAL_ADD.replace(LOCAL, "local = p.grad"),
           shows=("raised", "06_3d_parallelism.py:")),
    Mutant(todo=8, what="the pieces' squares stacked: torch.stack([]) raises on a rank that holds only copies",
           find=NORM_BODY,
           replace="    parts = []\n    for p in stage.parameters():\n"
                   "        if p.grad is None:\n            continue\n"
                   "        " + COPIES + "\n" + DTENSOR_SHARDS + "        " + ONE_COPY + "\n"
                   "            " + LOCAL + "\n"
                   "            parts.append(local.double().pow(2).sum())\n"
                   "    squares = torch.stack(parts).sum()\n" + ALL_REDUCE + RETURN,
           shows=("stack expects a non-empty TensorList",)),
    Mutant(todo=8, what="built in, copies read from the placements alone: the tp copies on FSDP2's dp mesh are missed",
           find=DTENSOR_SHARDS,
           replace="        if isinstance(p.grad, DTensor):  # the placements say what is copied\n"
                   "            names = p.grad.device_mesh.mesh_dim_names\n"
                   "            copies = {dim for dim, placement in zip(names, p.grad.placements) "
                   "if placement.is_replicate()}\n",
           shows=("their tp copies are in no placement",)),
    Mutant(todo=8, what="built in, each DTensor's whole norm on every rank and no all-reduce: the stages never add up",
           find=NORM_BODY,
           replace="    squares = torch.zeros((), dtype=torch.float64)\n    built_in = False\n"
                   "    for p in stage.parameters():\n        if p.grad is None:\n            continue\n"
                   "        if isinstance(p.grad, DTensor):  # the whole parameter's norm, on every rank of its mesh\n"
                   "            built_in = True\n"
                   "            squares += torch.linalg.vector_norm(p.grad).full_tensor().double() ** 2\n"
                   "            continue\n"
                   '        copies = {"dp"} if hasattr(p, "tp_dim") else {"dp", "tp"}\n'
                   "        if all(place[dim] == 0 for dim in copies):\n"
                   "            squares += p.grad.double().pow(2).sum()\n"
                   "    if not built_in:  # a DTensor's norm is whole already\n        dist.all_reduce(squares)\n"
                   "    return squares.sqrt()\n",
           shows=("summed over the dp group only",)),
]  # fmt: skip

# Correct answers written another way: each must pass its TODO (and blame no other).
COORDINATES = (
    '    return {\n        "pp": rank // (layout.dp * layout.tp),\n'
    '        "dp": rank // layout.tp % layout.dp,\n        "tp": rank % layout.tp,\n    }\n'
)
GROUPS = (
    "    for dim in DIMS:\n        for ranks in group_members(layout, dim):\n            group = new_group(ranks)\n"
    "            if rank in ranks:\n                groups[dim], members[dim] = group, ranks\n"
)
VARIANTS = [
    # TODO 1
    Mutant(todo=1, what="divmod, the last digit first, and the keys in another order",
           find=COORDINATES,
           replace="    rest, tp = divmod(rank, layout.tp)\n    pp, dp = divmod(rest, layout.dp)\n"
                   '    return {"tp": tp, "dp": dp, "pp": pp}\n'),
    Mutant(todo=1, what="the rank's index in a tensor of ranks shaped (pp, dp, tp)",
           find=COORDINATES,
           replace="    ranks = torch.arange(layout.world_size).reshape(layout.pp, layout.dp, layout.tp)\n"
                   "    return dict(zip(DIMS, (ranks == rank).nonzero()[0].tolist()))\n"),
    # TODO 2
    Mutant(todo=2, what="groups as tuples, found by comparing every pair of ranks' other coordinates",
           find="    groups: dict[tuple, list[int]] = {}\n    for rank in range(layout.world_size):\n"
                "        place = coordinates(rank, layout)\n"
                "        key = tuple(place[other] for other in DIMS if other != dim)\n"
                "        groups.setdefault(key, []).append(rank)\n    return list(groups.values())\n",
           replace="    def others(rank):\n"
                   "        return [v for d, v in coordinates(rank, layout).items() if d != dim]\n\n"
                   "    everyone = range(layout.world_size)\n"
                   "    found = {tuple(r for r in everyone if others(r) == others(rank)) for rank in everyone}\n"
                   "    return sorted(found)\n"),
    # TODO 3
    Mutant(todo=3, what="the dimensions in another order (the same on every rank), members kept as tuples",
           find=GROUPS,
           replace="    for dim in reversed(DIMS):\n        for ranks in map(tuple, group_members(layout, dim)):\n"
                   "            group = new_group(ranks)\n            if rank in ranks:\n"
                   "                groups[dim], members[dim] = group, ranks\n"),
    Mutant(todo=3, what="every group created first, the rank's own picked afterwards",
           find=GROUPS,
           replace="    made = [(dim, ranks, new_group(ranks))\n"
                   "            for dim in DIMS for ranks in group_members(layout, dim)]\n"
                   "    for dim, ranks, group in made:\n        if rank in ranks:\n"
                   "            groups[dim], members[dim] = group, ranks\n"),
    # TODO 4
    Mutant(todo=4, what="a strided split: every dp-th sequence from the replica's index (trains the same)",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]',
           replace='return batch[grid.coords["dp"] :: grid.layout.dp]'),
    Mutant(todo=4, what="a slice computed from the replica's size",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]',
           replace='size = len(batch) // grid.layout.dp\n'
                   '    return batch[grid.coords["dp"] * size : (grid.coords["dp"] + 1) * size]'),
    # TODO 5
    Mutant(todo=5, what="the rank computed from the grid's formula",
           find='return grid.members["pp"][stage]',
           replace='return (stage * grid.layout.dp + grid.coords["dp"]) * grid.layout.tp + grid.coords["tp"]'),
    Mutant(todo=5, what="this rank moved by whole stages",
           find='return grid.members["pp"][stage]',
           replace='return grid.rank + (stage - grid.coords["pp"]) * grid.layout.dp * grid.layout.tp'),
    # TODO 6
    Mutant(todo=6, what="ReduceOp.AVG (gloo has it) instead of a sum and a division",
           find="    dist.all_reduce(flat, group=group)\n    flat /= dist.get_world_size(group)\n",
           replace="    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n"),
    Mutant(todo=6, what="one all-reduce per gradient, in place, asynchronous, then waited for",
           find="    flat = torch.cat([g.flatten() for g in gradients])\n    dist.all_reduce(flat, group=group)\n"
                "    flat /= dist.get_world_size(group)\n"
                "    for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):\n"
                "        gradient.copy_(average.view_as(gradient))\n",
           replace="    works = [dist.all_reduce(g, group=group, async_op=True) for g in gradients]\n"
                   "    for gradient, work in zip(gradients, works):\n        work.wait()\n"
                   "        gradient.div_(dist.get_world_size(group))\n"),
    # TODO 7
    Mutant(todo=7, what="the embeddings in an FSDP unit of their own on the first stage",
           find="    fully_shard(stage, mesh=mesh[\"dp\"])  # the root",
           replace="    if stage.first:\n"
                   "        for embedding in (stage.token_embedding, stage.position_embedding):\n"
                   "            fully_shard(embedding, mesh=mesh[\"dp\"], reshard_after_forward=one_stage)\n"
                   "    fully_shard(stage, mesh=mesh[\"dp\"])  # the root"),
    Mutant(todo=7, what="the root wrapped with the blocks' reshard_after_forward (FSDP2 results unchanged)",
           find='    fully_shard(stage, mesh=mesh["dp"])  # the root',
           replace='    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=one_stage)  # the root'),
    Mutant(todo=7, what="the pipeline's size read from the mesh's shape",
           find='one_stage = mesh["pp"].size() == 1', replace='one_stage = mesh.shape[0] == 1'),
    # TODO 8
    Mutant(todo=8, what="torch.linalg.vector_norm of each local piece, squared",
           find=ADD, replace=ADD.replace("local.double().pow(2).sum()",
                                         "torch.linalg.vector_norm(local, dtype=torch.float64) ** 2")),
    Mutant(todo=8, what="a list of the pieces' squares, then torch.stack(...).sum()",
           find=NORM_BODY,
           replace="    parts = []\n    for p in stage.parameters():\n"
                   "        if p.grad is None:\n            continue\n"
                   "        " + COPIES + "\n" + DTENSOR_SHARDS + "        " + ONE_COPY + "\n"
                   "            " + LOCAL + "\n"
                   "            parts.append(local.double().pow(2).sum())\n"
                   "    zero = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)\n"
                   "    squares = torch.stack(parts).sum() if parts else zero  # a rank may hold only copies\n"
                   + ALL_REDUCE + RETURN),
    Mutant(todo=8, what="every rank adds each piece's squares divided by the number of ranks that hold it",
           find=NORM_BODY,
           replace="    everyone = [None] * dist.get_world_size()\n    dist.all_gather_object(everyone, place)\n"
                   + NORM_BODY.replace("        " + ONE_COPY + "\n", "")
                   .replace(INDENTED_LOCAL_ADD,
                            "        holders = sum(  # the ranks with a copy of this piece\n"
                            "            all(other[dim] == place[dim] for dim in place if dim not in copies)\n"
                            "            for other in everyone\n        )\n"
                            "        " + LOCAL + "\n"
                            "        squares += local.double().pow(2).sum() / holders\n")
                   .replace(ALL_REDUCE, "    dist.all_reduce(squares)  # every holder adds its share\n")),
    Mutant(todo=8, what="DTensor gradients made whole with full_tensor(), then added once, on (dp 0, tp 0)",
           find=DTENSOR_SHARDS + "        " + ONE_COPY + "\n" + "            " + LOCAL + "\n",
           replace="        if isinstance(p.grad, DTensor):  # whole on every rank: a copy over dp and tp\n"
                   '            local, copies = p.grad.full_tensor(), {"dp", "tp"}\n'
                   "        else:\n            local = p.grad\n"
                   "        if all(place[dim] == 0 for dim in copies):\n"),
    Mutant(todo=8, what="float32 accumulation (the gradients' own dtype)",
           find=NORM_BODY,
           replace=NORM_BODY.replace("torch.zeros((), dtype=torch.float64, ", "torch.zeros((), ")
                            .replace("local.double().pow(2)", "local.pow(2)")),
    Mutant(todo=8, what="returns a Python float",
           find=RETURN, replace="    return squares.sqrt().item()\n"),
]  # fmt: skip
