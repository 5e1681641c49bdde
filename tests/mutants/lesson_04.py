"""Lesson 04's mutants: plausible mistakes in each TODO of solutions/04_tensor_parallel.py, each of which
`make check LESSON=04` must show as that TODO failing, with a cause that points at the mistake."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the conjugate pair f and g
    Mutant(todo=1, what="f all-reduces in forward (g's job) as well as in backward, instead of being the identity",
           find="        return _all_reduce(x, group) if backward else x.view_as(x)",
           replace="        return _all_reduce(x, group)"),
    Mutant(todo=1, what="f's backward passes the gradient through: each rank keeps a partial input gradient",
           find="        return _all_reduce(x, group) if backward else x.view_as(x)",
           replace="        return x.view_as(x)"),
    Mutant(todo=1, what="g without its all-reduce: each rank keeps its partial sum",
           find="    return x.view_as(x) if backward else _all_reduce(x, group)",
           replace="    return x.view_as(x)"),
    Mutant(todo=1, what="f and g swapped: the input summed in forward, the output left a partial sum",
           find='    if which == "f":  # entering: the input is whole',
           replace='    if which == "g":  # entering: the input is whole'),
    # TODO 2: the column-parallel forward
    Mutant(todo=2, what="the bias left out of the local linear",
           find="        y = F.linear(x, self.weight, self.bias)\n        return Gather.apply",
           replace="        y = F.linear(x, self.weight)\n        return Gather.apply"),
    Mutant(todo=2, what="no f on the input: the input gradient stays partial",
           find="        if self.copy_input:\n            x = CopyToParallelRegion.apply(x, self.group)\n",
           replace=""),
    Mutant(todo=2, what="the output slices gathered along the batch dimension instead of the features",
           find="return Gather.apply(y, -1, self.group) if self.gather_output else y",
           replace="return Gather.apply(y, 0, self.group) if self.gather_output else y"),
    # TODO 3: the row-parallel forward
    Mutant(todo=3, what="the bias added on every rank before the sum: N times the bias",
           find="        y = self.leave.apply(F.linear(x, self.weight), self.group)\n        return y + self.bias",
           replace="        return self.leave.apply(F.linear(x, self.weight, self.bias), self.group)"),
    Mutant(todo=3, what="a whole input not split: multiplied by this rank's columns it has the wrong width",
           find="        if not self.input_is_parallel:\n            x = Split.apply(x, -1, self.group)\n",
           replace=""),
    # TODO 4: a tensor-parallel block
    Mutant(todo=4, what="f applied by q, k and v each as well as by the hook: the gradient is summed twice",
           find='setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group, copy_input=False))',
           replace='setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))'),
    Mutant(todo=4, what="the MLP enters its region without f (no pre-hook on mlp)",
           find="    for module in (attention, mlp):\n        module.register_forward_pre_hook",
           replace="    for module in (attention,):\n        module.register_forward_pre_hook"),
    Mutant(todo=4, what="sequence_parallel not passed on to the MLP's row-parallel layer",
           find="mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel=sequence_parallel)",
           replace="mlp.down_proj = RowParallelLinear(mlp.down_proj, group)"),
    # TODO 5: the sequence-parallel pair
    Mutant(todo=5, what="SP's f sums nothing in backward: it keeps this rank's slice of its own partial gradient",
           find="        return _reduce_scatter(x, 1, group) if backward else",
           replace="        return _split(x, 1, group) if backward else"),
    Mutant(todo=5, what="SP's g all-reduces and splits nothing: the whole sequence stays on every rank",
           find="if backward else _reduce_scatter(x, 1, group)",
           replace="if backward else _all_reduce(x, group)"),
    Mutant(todo=5, what="SP's f gathers along the batch (dim 0) instead of the sequence",
           find="if backward else _all_gather(x, 1, group)",
           replace="if backward else _all_gather(x, 0, group)"),
    # TODO 6: sequence-parallel gradients
    Mutant(todo=6, what="the partial gradients averaged over the ranks instead of summed",
           find="    dist.all_reduce(flat, group=group)\n",
           replace="    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n"),
    Mutant(todo=6, what="the sums never copied back into the gradients",
           find="        p.grad.copy_(summed.view_as(p.grad))",
           replace="        summed.view_as(p.grad)"),
    # TODO 7: the same layout with DTensor
    Mutant(todo=7, what="o leaves its region Replicate() with SP: the stream is not split again after attention",
           find='"attention.o_proj": RowwiseParallel(output_layouts=stream)',
           replace='"attention.o_proj": RowwiseParallel()'),
    Mutant(todo=7, what="the regions' input handed to q, k and v as a local tensor: three backward all-reduces",
           find="desired_input_layouts=Replicate(), use_local_output=False)",
           replace="desired_input_layouts=Replicate(), use_local_output=True)"),
    Mutant(todo=7, what="the norms left out of the SP plan",
           find='            plan["attn_norm"] = SequenceParallel()\n            plan["mlp_norm"] = SequenceParallel()',
           replace="            pass"),
    # TODO 8: lab, ranks that train without an error and disagree
    Mutant(todo=8, what="f and g swapped: the input summed over the ranks in forward, the output left a partial sum",
           find="CopyToParallelRegion.apply(h, group), up_weight, up_bias))  # f: h's gradient summed\n"
                "        y = h + ReduceFromParallelRegion.apply(",
           replace="ReduceFromParallelRegion.apply(h, group), up_weight, up_bias))  # f: h's gradient summed\n"
                   "        y = h + CopyToParallelRegion.apply("),
    Mutant(todo=8, what="g added, f dropped: embed's gradient stays partial and the ranks drift apart from step 2",
           find="        hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias))  # f",
           replace="        hidden = F.gelu(F.linear(h, up_weight, up_bias))  # f"),
    Mutant(todo=8, what="the bias added on every rank before g: N times the bias, the ranks agree and are wrong",
           find="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_bias",
           replace="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight, down_bias), group)"),
    Mutant(todo=8, what="g averages the partial outputs (as DDP averages gradients) instead of summing them",
           find="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_bias",
           replace="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) / n + down_bias"),
]  # fmt: skip
