"""Lesson 03's mutants: plausible mistakes in each TODO, which `make check LESSON=03` must blame on that TODO;
VARIANTS: correct answers written another way, which every TODO's tests must accept; and the names its TODO
comments may use (COMMENT_MAY_NAME, for tests/harness/todo_comments.py)."""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {
    "fully_shard": "FSDP2's API, which TODO 7 must call; the notebook introduces it in sections 0 and 5",
    "_unsafe_preserve_version_counter": "a private autograd API nobody could guess, which TODO 4 must call and the "
    "notebook's section 3 names (refilling gathered parameters that autograd saved, as FSDP2 does)",
}

MUTANTS = [
    # TODO 1: the shard of the optimizer state
    Mutant(todo=1, what="floor instead of ceil: the last elements of a bucket belong to no rank",
           find="shard_numel = math.ceil(numel / self.world_size)",
           replace="shard_numel = numel // self.world_size",
           shows=("rank 0 owns", "rounded down")),
    Mutant(todo=1, what="the slice is not clipped to the bucket: the last rank's [lo, hi) runs past its end",
           find="lo, hi = min(self.rank * shard_numel, numel), min((self.rank + 1) * shard_numel, numel)",
           replace="lo, hi = self.rank * shard_numel, (self.rank + 1) * shard_numel",
           shows=("rank 2 owns", "not clipped")),
    Mutant(todo=1, what="the inner optimizer gets the whole buffer: every rank keeps state for everything",
           find="shard = flat[lo:hi]",
           replace="shard = flat",
           shows=("whole bucket",)),
    # TODO 2: the ZeRO-1 step
    Mutant(todo=2, what="every rank steps the first slice of the averaged gradient, not its own",
           find='flat["shard"].grad = full[flat["lo"] : flat["hi"]]',
           replace='flat["shard"].grad = full[: flat["hi"] - flat["lo"]]',
           shows=("first slice",)),
    Mutant(todo=2, what="sums the gradients instead of averaging them (all-reduce with SUM)",
           find="all_reduce(full, self.group)",
           replace="all_reduce(full, self.group, op=dist.ReduceOp.SUM)",
           shows=("summed",)),
    # Not listed: all-reducing in ZeRO-2's step too (its gradients were freed: the shard steps on zeros). The mistake
    # is in TODO 2's code but shows only in ZeRO-2, whose parity is TODO 3's check: it fails there, not in TODO 2.
    Mutant(todo=2, what="no all-gather after the step: each rank repeats its own slice",
           find="all_gather(gathered, mine, self.group)",
           replace="gathered = mine.repeat(self.world_size)",
           shows=("not all-gathered",)),
    # TODO 3: ZeRO-2's reduce-scatter
    Mutant(todo=3, what="the full gradients are never freed: ZeRO-2 holds as much as ZeRO-1",
           find='        for p in flat["params"]:\n            p.grad = None\n        mine',
           replace='        for p in flat["params"]:\n            pass\n        mine',
           shows=("never freed",)),
    Mutant(todo=3, what="sums instead of averaging (reduce-scatter with the default SUM)",
           find="reduce_scatter(reduced, full, self.group)",
           replace="dist.reduce_scatter_single(reduced, full, group=self.group)",
           shows=("summed",)),
    Mutant(todo=3, what="all-reduces the bucket and keeps the first slice on every rank",
           find="reduce_scatter(reduced, full, self.group)",
           replace='all_reduce(full, self.group)\n        reduced = full[: flat["shard_numel"]].clone()',
           shows=("first slice",)),
    # TODO 4: the all-gather of a unit
    Mutant(todo=4, what="scales the gathered parameters (full.mul_(0.5) after the all-gather)",
           find="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)",
           replace="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)\n"
                   "            self.full.mul_(0.5)",
           shows=("0.50 x",)),
    Mutant(todo=4, what="no all-gather: every rank's buffer repeats its own shard",
           find="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)",
           replace="            self.full.copy_(self.shard.detach().repeat(dist.get_world_size(self.group)))",
           shows=("not all-gathered",)),
    Mutant(todo=4, what="gathers fp32 shards into the compute-dtype buffer without a cast",
           find="self.shard.detach().to(self.full.dtype)",
           replace="self.shard.detach()",
           shows=("not cast",)),
    # TODO 5: the reduce-scatter of a unit's gradients
    Mutant(todo=5, what="never frees the gathered parameters in backward",
           find="        self.free()\n        self.awaiting_gradients = False",
           replace="        self.awaiting_gradients = False",
           shows=("still allocated",)),
    Mutant(todo=5, what="sums instead of averaging (reduce-scatter with the default SUM)",
           find="reduce_scatter(shard_grad, full, self.group)",
           replace="dist.reduce_scatter_single(shard_grad, full, group=self.group)",
           shows=("summed",)),
    Mutant(todo=5, what="reduces in the compute dtype (bf16) instead of fp32",
           find="full = torch.zeros(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)",
           replace="full = torch.zeros(self.full.numel(), dtype=self.full.dtype, device=self.shard.device)",
           shows=("buffer of the compute dtype",)),
    Mutant(todo=5, what="the unit still awaits gradients: the end of backward reduce-scatters zeros for it again",
           find="        self.awaiting_gradients = False\n        return shard_grad",
           replace="        return shard_grad",
           shows=("still awaits",)),
    # TODO 6: the schedule after a unit's forward
    Mutant(todo=6, what="never frees a unit after its forward",
           find="        if self.reshards(unit):\n            unit.free()",
           replace="        if self.reshards(unit):\n            pass",
           shows=("no unit is freed",)),
    Mutant(todo=6, what="frees the root after forward too (backward gathers it again at once)",
           find="        if self.reshards(unit):\n            unit.free()",
           replace="        if self.reshard_after_forward:\n            unit.free()",
           shows=("root is freed",)),
    Mutant(todo=6, what="no hook on the output: backward never gathers a freed unit again",
           find="                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit, grad))",
           replace="                pass",
           shows=("freed buffer", "not gathered again")),
    # TODO 7: FSDP2
    Mutant(todo=7, what="only the root is sharded: one unit, gathered whole",
           find="    for block in model.blocks:\n        fully_shard(block,",
           replace="    for block in []:\n        fully_shard(block,",
           shows=("only the root is sharded",)),
    Mutant(todo=7, what="the root is resharded after forward and gathered again at once for backward",
           find="fully_shard(model, mesh=mesh, mp_policy=mp_policy)",
           replace="fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)",
           shows=("root reshards",)),
    Mutant(todo=7, what="the blocks ignore the mixed-precision policy: they gather fp32 in a bf16 run",
           find="fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)",
           replace="fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)",
           shows=("same dtype", "needs mp_policy")),
    # TODO 8: lab, a unit never gathered again
    Mutant(todo=8, what="iterates the dict itself, which gives its keys: no tensor found, no hook on the block",
           find="output = list(output.values())",
           replace="output = list(output)",
           shows=("keys",)),
    Mutant(todo=8, what="only a dict's first value is hooked: the router's loss reaches the freed unit first",
           find="output = list(output.values())",
           replace="output = list(output.values())[:1]",
           shows=("first value",)),
    Mutant(todo=8, what="a dict's own tensors only: tensors nested in its tuples, lists or dicts get no hook",
           find="output = list(output.values())",
           replace="return [value for value in output.values() if torch.is_tensor(value)]",
           shows=("directly in a dict",)),
]  # fmt: skip

ZERO1_REDUCE = """                full = self._padded_gradients(flat)
                all_reduce(full, self.group)
                flat["shard"].grad = full[flat["lo"] : flat["hi"]]
"""
ZERO1_GATHER = (
    """            mine = torch.zeros(flat["shard_numel"], dtype=flat["flat"].dtype, device=flat["flat"].device)\n"""
    """            mine[: flat["hi"] - flat["lo"]] = flat["shard"]\n"""
    """            gathered = torch.empty(flat["shard_numel"] * self.world_size, dtype=mine.dtype, """
    """device=mine.device)\n"""
    """            all_gather(gathered, mine, self.group)\n"""
    """            flat["flat"].copy_(gathered[: flat["flat"].numel()])\n"""
)
ZERO2_REDUCE = """        reduce_scatter(reduced, full, self.group)
"""
ZERO3_COPY = """        full = torch.zeros(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)
        offset = 0
        for grad, shape in zip(grads, self.shapes):
            if grad is not None:
                full[offset : offset + math.prod(shape)].copy_(grad.reshape(-1))
            offset += math.prod(shape)
"""
AFTER_FORWARD = """        if self.reshards(unit):
            unit.free()
        for tensor in self.output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit, grad))
"""
OUTPUT_TENSORS = """    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in output_tensors(item)]
    return [output] if torch.is_tensor(output) else []
"""

VARIANTS = [  # correct answers written another way: every TODO's tests must accept them
    # TODO 1: S rounded up, this rank's [lo, hi), a view of it
    Mutant(todo=1, what="S by negated floor division (-(-numel // N)), the end of the slice from its start",
           find="""                shard_numel = math.ceil(numel / self.world_size)
                lo, hi = min(self.rank * shard_numel, numel), min((self.rank + 1) * shard_numel, numel)
""",
           replace="""                shard_numel = -(-numel // self.world_size)
                lo = min(self.rank * shard_numel, numel)
                hi = min(lo + shard_numel, numel)
"""),
    Mutant(todo=1, what="the shard cut out with torch.tensor_split at [lo, hi) (a view, like the slice)",
           find="                shard = flat[lo:hi]\n",
           replace="                shard = torch.tensor_split(flat, [lo, hi])[1]\n"),
    Mutant(todo=1, what="the shard as flat.narrow(0, lo, hi - lo), S by divmod",
           find="""                shard_numel = math.ceil(numel / self.world_size)
                lo, hi = min(self.rank * shard_numel, numel), min((self.rank + 1) * shard_numel, numel)
                shard = flat[lo:hi]
""",
           replace="""                whole, rest = divmod(numel, self.world_size)
                shard_numel = whole + (rest > 0)
                lo, hi = (min(r * shard_numel, numel) for r in (self.rank, self.rank + 1))
                shard = flat.narrow(0, lo, hi - lo)
"""),
    # TODO 2: the ZeRO-1 step
    Mutant(todo=2, what="ZeRO-1 reduce-scatters the padded gradient (its own slice is all it needs), not all-reduce",
           find=ZERO1_REDUCE,
           replace="""                full = self._padded_gradients(flat)
                reduced = torch.empty(flat["shard_numel"], dtype=full.dtype, device=full.device)
                reduce_scatter(reduced, full, self.group)
                flat["shard"].grad = reduced[: flat["hi"] - flat["lo"]]
"""),
    Mutant(todo=2, what="all-reduces the sum, then divides by the world size",
           find=ZERO1_REDUCE,
           replace="""                full = self._padded_gradients(flat)
                all_reduce(full, self.group, op=dist.ReduceOp.SUM)
                full /= self.world_size
                flat["shard"].grad = full[flat["lo"] : flat["hi"]]
"""),
    Mutant(todo=2, what="pads this rank's slice with torch.nn.functional.pad, copies back with narrow",
           find=ZERO1_GATHER,
           replace="""            padding = flat["shard_numel"] - flat["shard"].numel()
            mine = torch.nn.functional.pad(flat["shard"].detach(), (0, padding))
            gathered = mine.new_empty(flat["shard_numel"] * self.world_size)
            all_gather(gathered, mine, self.group)
            flat["flat"].copy_(gathered.narrow(0, 0, flat["flat"].numel()))
"""),
    # TODO 3: ZeRO-2's reduce-scatter
    Mutant(todo=3, what="reduce-scatters the sum, then divides by the world size",
           find=ZERO2_REDUCE,
           replace="""        reduce_scatter(reduced, full, self.group, op=dist.ReduceOp.SUM)
        reduced.div_(self.world_size)
"""),
    Mutant(todo=3, what="accumulates into the shard's gradient in place, frees the full gradients last",
           find="""        for p in flat["params"]:
            p.grad = None
        mine = reduced[: flat["hi"] - flat["lo"]]
        shard = flat["shard"]
        shard.grad = mine if shard.grad is None else shard.grad + mine
""",
           replace="""        shard, mine = flat["shard"], reduced[: flat["hi"] - flat["lo"]]
        if shard.grad is None:
            shard.grad = mine.clone()
        else:
            shard.grad.add_(mine)
        for p in flat["params"]:
            p.grad = None
"""),
    # TODO 4: the all-gather of a unit
    Mutant(todo=4, what="the two context managers in the other order, the cast with .to(dtype=...) on .data",
           find="""        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)
""",
           replace="""        with torch.autograd._unsafe_preserve_version_counter(self.full), torch.no_grad():
            piece = self.shard.data.to(dtype=self.full.dtype)
            all_gather(self.full, piece, self.group)
"""),
    # TODO 5: the reduce-scatter of a unit's gradients
    Mutant(todo=5, what="the flat buffer by torch.cat (zeros for missing gradients), padded by torch.nn.functional.pad",
           find=ZERO3_COPY,
           replace="""        flat = torch.cat([
            (grad if grad is not None else self.shard.new_zeros(shape)).reshape(-1).to(self.shard.dtype)
            for grad, shape in zip(grads, self.shapes)
        ])
        full = torch.nn.functional.pad(flat, (0, self.full.numel() - flat.numel()))
"""),
    Mutant(todo=5, what="reduce-scatters the sum, then divides by the world size",
           find="""        reduce_scatter(shard_grad, full, self.group)
""",
           replace="""        reduce_scatter(shard_grad, full, self.group, op=dist.ReduceOp.SUM)
        shard_grad /= dist.get_world_size(self.group)
"""),
    # TODO 6: the schedule after a unit's forward
    Mutant(todo=6, what="hooks the outputs first, frees afterwards; the hook is a functools.partial",
           find=AFTER_FORWARD,
           replace="""        import functools

        for tensor in self.output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._before_backward, unit))
        if self.reshards(unit):
            unit.free()
"""),
    Mutant(todo=6, what="only the tensors that require grad, collected first; resharding decided without reshards()",
           find=AFTER_FORWARD,
           replace="""        needing = [tensor for tensor in self.output_tensors(output) if tensor.requires_grad]
        for tensor in needing:
            tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit, grad))
        if self.reshard_after_forward and unit is not self.root:
            unit.free()
"""),
    # TODO 7: FSDP2
    Mutant(todo=7, what="keyword arguments in another order",
           find="fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)",
           replace="fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, mesh=mesh)"),
    Mutant(todo=7, what="the root's reshard_after_forward explicitly False (what its default does)",
           find="fully_shard(model, mesh=mesh, mp_policy=mp_policy)",
           replace="fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)"),
    Mutant(todo=7, what="the blocks sharded from the last to the first",
           find="    for block in model.blocks:\n        fully_shard(block,",
           replace="    for block in reversed(model.blocks):\n        fully_shard(block,"),
    # TODO 8: the lab
    Mutant(todo=8, what="torch.utils._pytree.tree_leaves, keeping the tensors",
           find=OUTPUT_TENSORS,
           replace="""    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(output) if torch.is_tensor(leaf)]
"""),
    Mutant(todo=8, what="any Mapping, recursing into each value",
           find=OUTPUT_TENSORS,
           replace="""    from collections.abc import Mapping

    if torch.is_tensor(output):
        return [output]
    items = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else []
    return [tensor for item in items for tensor in output_tensors(item)]
"""),
    Mutant(todo=8, what="a stack instead of recursion: every tensor once, in another order (Zero3 hooks each alike)",
           find=OUTPUT_TENSORS,
           replace="""    found, stack = [], [output]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return found
"""),
]  # fmt: skip
