"""Lesson 03's mutants: plausible mistakes in each TODO, which `make check LESSON=03` must blame on that TODO."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the shard of the optimizer state
    Mutant(todo=1, what="floor instead of ceil: the last elements of a bucket belong to no rank",
           find="shard_numel = math.ceil(numel / self.world_size)",
           replace="shard_numel = numel // self.world_size"),
    Mutant(todo=1, what="the slice is not clipped to the bucket: the last rank's [lo, hi) runs past its end",
           find="lo, hi = min(self.rank * shard_numel, numel), min((self.rank + 1) * shard_numel, numel)",
           replace="lo, hi = self.rank * shard_numel, (self.rank + 1) * shard_numel"),
    Mutant(todo=1, what="the inner optimizer gets the whole buffer: every rank keeps state for everything",
           find="shard = flat[lo:hi]",
           replace="shard = flat"),
    # TODO 2: the ZeRO-1 step
    Mutant(todo=2, what="every rank steps the first slice of the averaged gradient, not its own",
           find='flat["shard"].grad = full[flat["lo"] : flat["hi"]]',
           replace='flat["shard"].grad = full[: flat["hi"] - flat["lo"]]'),
    Mutant(todo=2, what="no all-gather after the step: each rank repeats its own slice",
           find="all_gather(gathered, mine, self.group)",
           replace="gathered = mine.repeat(self.world_size)"),
    # TODO 3: ZeRO-2's reduce-scatter
    Mutant(todo=3, what="the full gradients are never freed: ZeRO-2 holds as much as ZeRO-1",
           find='        for p in flat["params"]:\n            p.grad = None\n        mine',
           replace='        for p in flat["params"]:\n            pass\n        mine'),
    Mutant(todo=3, what="sums instead of averaging (reduce-scatter with the default SUM)",
           find="reduce_scatter(reduced, full, self.group)",
           replace="dist.reduce_scatter_single(reduced, full, group=self.group)"),
    Mutant(todo=3, what="all-reduces the bucket and keeps the first slice on every rank",
           find="reduce_scatter(reduced, full, self.group)",
           replace='all_reduce(full, self.group)\n        reduced = full[: flat["shard_numel"]].clone()'),
    # TODO 4: the all-gather of a unit
    Mutant(todo=4, what="scales the gathered parameters (full.mul_(0.5) after the all-gather)",
           find="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)",
           replace="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)\n"
                   "            self.full.mul_(0.5)"),
    Mutant(todo=4, what="no all-gather: every rank's buffer repeats its own shard",
           find="            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)",
           replace="            self.full.copy_(self.shard.detach().repeat(dist.get_world_size(self.group)))"),
    Mutant(todo=4, what="gathers fp32 shards into the compute-dtype buffer without a cast",
           find="self.shard.detach().to(self.full.dtype)",
           replace="self.shard.detach()"),
    # TODO 5: the reduce-scatter of a unit's gradients
    Mutant(todo=5, what="never frees the gathered parameters in backward",
           find="        self.free()\n        self.awaiting_gradients = False",
           replace="        self.awaiting_gradients = False"),
    Mutant(todo=5, what="sums instead of averaging (reduce-scatter with the default SUM)",
           find="reduce_scatter(shard_grad, full, self.group)",
           replace="dist.reduce_scatter_single(shard_grad, full, group=self.group)"),
    Mutant(todo=5, what="reduces in the compute dtype (bf16) instead of fp32",
           find="full = torch.zeros(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)",
           replace="full = torch.zeros(self.full.numel(), dtype=self.full.dtype, device=self.shard.device)"),
    # TODO 6: the schedule after a unit's forward
    Mutant(todo=6, what="never frees a unit after its forward",
           find="        if self.reshards(unit):\n            unit.free()",
           replace="        if self.reshards(unit):\n            pass"),
    Mutant(todo=6, what="frees the root after forward too (backward gathers it again at once)",
           find="        if self.reshards(unit):\n            unit.free()",
           replace="        if self.reshard_after_forward:\n            unit.free()"),
    Mutant(todo=6, what="no hook on the output: backward never gathers a freed unit again",
           find="                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit, grad))",
           replace="                pass"),
    # TODO 7: FSDP2
    Mutant(todo=7, what="only the root is sharded: one unit, gathered whole",
           find="    for block in model.blocks:\n        fully_shard(block,",
           replace="    for block in []:\n        fully_shard(block,"),
    Mutant(todo=7, what="the root is resharded after forward and gathered again at once for backward",
           find="fully_shard(model, mesh=mesh, mp_policy=mp_policy)",
           replace="fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)"),
    Mutant(todo=7, what="the blocks ignore the mixed-precision policy: they gather fp32 in a bf16 run",
           find="fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)",
           replace="fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)"),
]  # fmt: skip
