"""Lesson 06's mutants: the mistakes a learner makes in each TODO, each of which its test must catch."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the coordinates of a rank
    Mutant(todo=1, what="PP innermost instead of TP (the TP all-reduce crosses nodes)",
           find='"pp": rank // (layout.dp * layout.tp),', replace='"pp": rank % layout.pp,'),
    Mutant(todo=1, what="dp not wrapped at its size (counts replicas across stages)",
           find='"dp": rank // layout.tp % layout.dp,', replace='"dp": rank // layout.tp,'),
    Mutant(todo=1, what="pp divides by dp only, forgetting the tp ranks of each replica",
           find='"pp": rank // (layout.dp * layout.tp),', replace='"pp": rank // layout.dp,'),
    # TODO 2: the groups of one dimension
    Mutant(todo=2, what="keys by the group's own coordinate: ranks that differ in it land in different groups",
           find="key = tuple(place[other] for other in DIMS if other != dim)",
           replace="key = tuple(place[other] for other in DIMS)"),
    Mutant(todo=2, what="keys by the stage only: a TP group swallows every replica of the stage",
           find="key = tuple(place[other] for other in DIMS if other != dim)", replace='key = (place["pp"],)'),
    # TODO 3: the process groups
    Mutant(todo=3, what="each rank creates only its own groups (torch: every rank waits forever)",
           find="            group = new_group(ranks)\n            if rank in ranks:\n",
           replace="            if rank in ranks:\n                group = new_group(ranks)\n"),
    Mutant(todo=3, what="keeps the last group created, not the one it belongs to",
           find="            if rank in ranks:\n                groups[dim], members[dim] = group, ranks",
           replace="            groups[dim], members[dim] = group, ranks"),
    # TODO 4: the replica's share of the batch
    Mutant(todo=4, what="slices by the TP coordinate: TP shards of one replica read different sequences",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]',
           replace='return batch.chunk(grid.layout.dp)[grid.coords["tp"] % grid.layout.dp]'),
    Mutant(todo=4, what="every replica reads the whole global batch",
           find='return batch.chunk(grid.layout.dp)[grid.coords["dp"]]', replace="return batch"),
    # TODO 5: a pipeline neighbour's global rank
    Mutant(todo=5, what="the stage number taken as the global rank (lesson 05's one stage per rank)",
           find='return grid.members["pp"][stage]', replace="return stage"),
    Mutant(todo=5, what="the neighbour's rank without this rank's replica (always replica 0)",
           find='return grid.members["pp"][stage]',
           replace='return stage * grid.layout.dp * grid.layout.tp + grid.coords["tp"]'),
    # TODO 6: the data-parallel gradient average
    Mutant(todo=6, what="sums the gradients without dividing by the group's size",
           find="    flat /= dist.get_world_size(group)\n", replace=""),
    Mutant(todo=6, what="divides by the world size instead of the DP group's",
           find="flat /= dist.get_world_size(group)", replace="flat /= dist.get_world_size()"),
    Mutant(todo=6, what="averages the buffer but never copies it back into the gradients",
           find="        gradient.copy_(average.view_as(gradient))",
           replace="        gradient = average.view_as(gradient)"),
    # TODO 7: the built-in composition
    Mutant(todo=7, what="only the stage is wrapped: no per-block FSDP units",
           find="    for block in stage.blocks.values():\n        fully_shard(block, mesh=mesh[\"dp\"])\n",
           replace=""),
    Mutant(todo=7, what="no tensor parallelism: every TP rank holds whole projections",
           find='    tensor_parallel.apply_tensor_parallel(model, mesh["tp"])\n', replace=""),
    Mutant(todo=7, what="the stage root is not wrapped: embeddings and head are never averaged over dp",
           find='    fully_shard(stage, mesh=mesh["dp"])\n    return stage', replace="    return stage"),
]  # fmt: skip
