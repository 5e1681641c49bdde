"""Lesson 04's mutants: plausible mistakes in each TODO of solutions/04_tensor_parallel.py, each of which
`make check LESSON=04` must show as that TODO failing, with a cause that points at the mistake."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the conjugate pair f and g
    Mutant(todo=1, what="f all-reduces in forward (g's job) as well as in backward, instead of being the identity",
           find="        return _all_reduce(x, group) if backward else x.view_as(x)",
           replace="        return _all_reduce(x, group)",
           shows=("sums over the 2 ranks in forward",)),
    Mutant(todo=1, what="f's backward passes the gradient through: each rank keeps a partial input gradient",
           find="        return _all_reduce(x, group) if backward else x.view_as(x)",
           replace="        return x.view_as(x)",
           shows=("keeps this rank's own gradient",)),
    Mutant(todo=1, what="g without its all-reduce: each rank keeps its partial sum",
           find="    return x.view_as(x) if backward else _all_reduce(x, group)",
           replace="    return x.view_as(x)",
           shows=("partial outputs are not summed",)),
    Mutant(todo=1, what="g all-reduces in backward too: the whole output gradient is summed, N times too large",
           find="    return x.view_as(x) if backward else _all_reduce(x, group)",
           replace="    return _all_reduce(x, group)",
           shows=("2 x too large",)),
    Mutant(todo=1, what="f and g swapped: the input summed in forward, the output left a partial sum",
           find='    if which == "f":  # entering: the input is whole',
           replace='    if which == "g":  # entering: the input is whole',
           shows=("sums over the 2 ranks in forward",)),
    # TODO 2: the column-parallel forward
    Mutant(todo=2, what="the bias left out of the local linear",
           find="        y = F.linear(x, self.weight, self.bias)\n        return Gather.apply",
           replace="        y = F.linear(x, self.weight)\n        return Gather.apply",
           shows=("bias is missing",)),
    Mutant(todo=2, what="no f on the input: the input gradient stays partial",
           find="        if self.copy_input:\n            x = CopyToParallelRegion.apply(x, self.group)\n",
           replace="",
           shows=("partial one", "f is not applied")),
    Mutant(todo=2, what="the output slices gathered along the batch dimension instead of the features",
           find="return Gather.apply(y, -1, self.group) if self.gather_output else y",
           replace="return Gather.apply(y, 0, self.group) if self.gather_output else y",
           shows=("along dim 0",)),
    # TODO 3: the row-parallel forward
    Mutant(todo=3, what="the bias added on every rank before the sum: N times the bias",
           find="        y = self.leave.apply(F.linear(x, self.weight), self.group)\n        return y + self.bias",
           replace="        return self.leave.apply(F.linear(x, self.weight, self.bias), self.group)",
           shows=("bias is added 2 times",)),
    Mutant(todo=3, what="a whole input not split: multiplied by this rank's columns it has the wrong width",
           find="        if not self.input_is_parallel:\n            x = Split.apply(x, -1, self.group)\n",
           replace="",
           shows=("not split",)),
    # TODO 4: a tensor-parallel block
    Mutant(todo=4, what="f applied by q, k and v each as well as by the hook: the gradient is summed twice",
           find='setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group, copy_input=False))',
           replace='setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))',
           shows=("attn_norm", "summed over the ranks twice")),
    Mutant(todo=4, what="the MLP enters its region without f (no pre-hook on mlp)",
           find="    for module in (attention, mlp):\n        module.register_forward_pre_hook",
           replace="    for module in (attention,):\n        module.register_forward_pre_hook",
           shows=("mlp_norm", "does not pass through f")),
    Mutant(todo=4, what="sequence_parallel not passed on to the MLP's row-parallel layer",
           find="mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel=sequence_parallel)",
           replace="mlp.down_proj = RowParallelLinear(mlp.down_proj, group)",
           shows=("does not reduce-scatter",)),
    # TODO 5: the sequence-parallel pair
    Mutant(todo=5, what="SP's f sums nothing in backward: it keeps this rank's slice of its own partial gradient",
           find="        return _reduce_scatter(x, 1, group) if backward else",
           replace="        return _split(x, 1, group) if backward else",
           shows=("not summed (reduce-scatter)",)),
    Mutant(todo=5, what="SP's g all-reduces and splits nothing: the whole sequence stays on every rank",
           find="if backward else _reduce_scatter(x, 1, group)",
           replace="if backward else _all_reduce(x, group)",
           shows=("not split along dim 1",)),
    Mutant(todo=5, what="SP's f gathers along the batch (dim 0) instead of the sequence",
           find="if backward else _all_gather(x, 1, group)",
           replace="if backward else _all_gather(x, 0, group)",
           shows=("along dim 0",)),
    # TODO 6: sequence-parallel gradients
    Mutant(todo=6, what="the partial gradients averaged over the ranks instead of summed",
           find="    dist.all_reduce(flat, group=group)\n",
           replace="    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n",
           shows=("averaged",)),
    Mutant(todo=6, what="the sums never copied back into the gradients",
           find="        p.grad.copy_(summed.view_as(p.grad))",
           replace="        summed.view_as(p.grad)",
           shows=("partial gradient", "not summed into it")),
    # TODO 7: the same layout with DTensor
    Mutant(todo=7, what="o leaves its region Replicate() with SP: the stream is not split again after attention",
           find='"attention.o_proj": RowwiseParallel(output_layouts=stream)',
           replace='"attention.o_proj": RowwiseParallel()',
           shows=("must match the size", "not split back along the sequence")),
    Mutant(todo=7, what="the regions' input handed to q, k and v as a local tensor: three backward all-reduces",
           find="desired_input_layouts=Replicate(), use_local_output=False)",
           replace="desired_input_layouts=Replicate(), use_local_output=True)",
           shows=("8 all_reduces", "q, k and v each")),
    Mutant(todo=7, what="the norms left out of the SP plan",
           find='            plan["attn_norm"] = SequenceParallel()\n            plan["mlp_norm"] = SequenceParallel()',
           replace="            pass",
           shows=("largest difference is on a norm",)),
    # TODO 8: lab, ranks that train without an error and disagree
    Mutant(todo=8, what="f and g swapped: the input summed over the ranks in forward, the output left a partial sum",
           find="CopyToParallelRegion.apply(h, group), up_weight, up_bias))  # f: h's gradient summed\n"
                "        y = h + ReduceFromParallelRegion.apply(",
           replace="ReduceFromParallelRegion.apply(h, group), up_weight, up_bias))  # f: h's gradient summed\n"
                   "        y = h + CopyToParallelRegion.apply(",
           shows=("from step 1", "partial sum (no g)")),
    Mutant(todo=8, what="g added, f dropped: embed's gradient stays partial and the ranks drift apart from step 2",
           find="        hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias))  # f",
           replace="        hidden = F.gelu(F.linear(h, up_weight, up_bias))  # f",
           shows=("drift apart", "does not pass through f")),
    Mutant(todo=8, what="the bias added on every rank before g: N times the bias, the ranks agree and are wrong",
           find="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_bias",
           replace="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight, down_bias), group)",
           shows=("bias is added 2 times",)),
    Mutant(todo=8, what="g averages the partial outputs (as DDP averages gradients) instead of summing them",
           find="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_bias",
           replace="ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) / n + down_bias",
           shows=("averages the 2 partial outputs",)),
]  # fmt: skip

# Names a TODO comment may use: the PyTorch APIs the learner must call, which the notebook introduces.
COMMENT_MAY_NAME = {
    "register_forward_pre_hook": "TODO 4's way into a region once per module: notebook section 3's forward pre-hook",
    "parallelize_module": "the DTensor entry point TODO 7 calls: notebook section 3",
    "ColwiseParallel": "TODO 7's style for a column-parallel layer: notebook section 3",
    "RowwiseParallel": "TODO 7's style for a row-parallel layer: notebook section 3",
    "PrepareModuleInput": "TODO 7's style for a region's input: notebook section 3",
    "SequenceParallel": "TODO 7's style for the norms with SP: notebook section 5",
}

VARIANTS = [  # correct answers, written another way: every TODO's check must pass them
    # TODO 1: the four cases as one condition; the sum through dist.all_reduce directly, asynchronously
    Mutant(todo=1, what='one condition for the identity cases; the all-reduce written out, async_op=True then wait()',
           find='    if which == "f":  # entering: the input is whole on every rank, its gradient a partial sum\n'
                '        return _all_reduce(x, group) if backward else x.view_as(x)\n'
                '    return x.view_as(x) if backward else _all_reduce(x, group)  # leaving: the reverse\n',
           replace='    if (which == "f") != backward:  # f forward, g backward: whole already\n'
                   '        return x.view_as(x)\n'
                   '    summed = x.contiguous().clone()\n'
                   '    dist.all_reduce(summed, group=group, async_op=True).wait()\n'
                   '    return summed\n'),
    Mutant(todo=1, what='a set of the cases that sum; the identity as a copy (clone) instead of a view',
           find='    if which == "f":  # entering: the input is whole on every rank, its gradient a partial sum\n'
                '        return _all_reduce(x, group) if backward else x.view_as(x)\n'
                '    return x.view_as(x) if backward else _all_reduce(x, group)  # leaving: the reverse\n',
           replace='    partial = {("f", True), ("g", False)}  # the cases where a rank holds a share of a sum\n'
                   '    return _all_reduce(x, group) if (which, backward) in partial else x.clone()\n'),
    Mutant(todo=1, what="the identity written as the input itself (autograd.Function makes it a view)",
           find='    if which == "f":  # entering: the input is whole on every rank, its gradient a partial sum\n'
                '        return _all_reduce(x, group) if backward else x.view_as(x)\n'
                '    return x.view_as(x) if backward else _all_reduce(x, group)  # leaving: the reverse\n',
           replace='    if which == "f":\n'
                   '        return _all_reduce(x, group) if backward else x\n'
                   '    return x if backward else _all_reduce(x, group)\n'),
    # TODO 2: the matrix product written out; the gather's dimension counted from the front
    Mutant(todo=2, what='x @ weight.T + bias, not F.linear; Gather along y.dim() - 1; f in a conditional expression',
           find='        if self.copy_input:\n'
                '            x = CopyToParallelRegion.apply(x, self.group)\n'
                '        y = F.linear(x, self.weight, self.bias)\n'
                '        return Gather.apply(y, -1, self.group) if self.gather_output else y\n',
           replace='        x = CopyToParallelRegion.apply(x, self.group) if self.copy_input else x\n'
                   '        y = x @ self.weight.T + self.bias\n'
                   '        if self.gather_output:\n'
                   '            y = Gather.apply(y, y.dim() - 1, self.group)\n'
                   '        return y\n'),
    # TODO 3: the product written out, the bias added with torch.add, Split along x.dim() - 1
    Mutant(todo=3, what='x @ weight.T, Split along x.dim() - 1, the bias added with torch.add after leaving',
           find='        if not self.input_is_parallel:\n'
                '            x = Split.apply(x, -1, self.group)\n'
                '        y = self.leave.apply(F.linear(x, self.weight), self.group)\n'
                '        return y + self.bias\n',
           replace='        x = x if self.input_is_parallel else Split.apply(x, x.dim() - 1, self.group)\n'
                   '        return torch.add(self.leave.apply(x @ self.weight.T, self.group), self.bias)\n'),
    # TODO 4: assignments written out, the MLP first, a named hook that returns a tensor (not a tuple)
    Mutant(todo=4, what='each projection assigned by name, the MLP first; one named pre-hook returning a tensor',
           find='    attention, mlp = block.attention, block.mlp\n'
                '    for name in ("q_proj", "k_proj", "v_proj"):\n'
                '        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group, copy_'
                'input=False))\n'
                '    attention.o_proj = RowParallelLinear(attention.o_proj, group, sequence_parallel=sequence'
                '_parallel)\n'
                '    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group, copy_input=False)\n'
                '    mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel=sequence_parallel)\n'
                '    for module in (attention, mlp):\n'
                '        module.register_forward_pre_hook(lambda module, args: (enter.apply(args[0], group),))\n',
           replace='    block.mlp.up_proj = ColumnParallelLinear(block.mlp.up_proj, group, copy_input=False)\n'
                   '    block.mlp.down_proj = RowParallelLinear(block.mlp.down_proj, group, True, sequence_pa'
                   'rallel)\n'
                   '    block.attention.q_proj = ColumnParallelLinear(block.attention.q_proj, group, copy_inp'
                   'ut=False)\n'
                   '    block.attention.k_proj = ColumnParallelLinear(block.attention.k_proj, group, copy_inp'
                   'ut=False)\n'
                   '    block.attention.v_proj = ColumnParallelLinear(block.attention.v_proj, group, copy_inp'
                   'ut=False)\n'
                   '    block.attention.o_proj = RowParallelLinear(block.attention.o_proj, group, True, seque'
                   'nce_parallel)\n'
                   '\n'
                   '    def enter_region(module, args):\n'
                   '        return enter.apply(args[0], group)  # one tensor: PyTorch makes it the 1-tuple of'
                   ' arguments\n'
                   '\n'
                   '    block.mlp.register_forward_pre_hook(enter_region)\n'
                   '    block.attention.register_forward_pre_hook(enter_region)\n'),
    # TODO 5: the all-gather written with dist.all_gather into a list, then torch.cat
    Mutant(todo=5, what='the gathering cases through dist.all_gather into a list and torch.cat, one condition',
           find='    if which == "f":  # entering: every token needed; the gradients coming back are partial sums\n'
                '        return _reduce_scatter(x, 1, group) if backward else _all_gather(x, 1, group)\n'
                '    return _all_gather(x, 1, group) if backward else _reduce_scatter(x, 1, group)  # leaving'
                ': the reverse\n',
           replace='    if (which == "f") == backward:  # f backward, g forward: partial sums of every token\n'
                   '        return _reduce_scatter(x, 1, group)\n'
                   '    x = x.contiguous()\n'
                   '    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]\n'
                   '    dist.all_gather(pieces, x, group=group)\n'
                   '    return torch.cat(pieces, dim=1)\n'),
    # TODO 6: narrow instead of split, reshape instead of flatten, the all-reduce asynchronous
    Mutant(todo=6, what='reshape(-1) and narrow at running offsets; the all-reduce async_op=True then wait()',
           find='    flat = torch.cat([p.grad.flatten() for p in params])\n'
                '    dist.all_reduce(flat, group=group)\n'
                '    for p, summed in zip(params, flat.split([p.numel() for p in params])):\n'
                '        p.grad.copy_(summed.view_as(p.grad))\n',
           replace='    flat = torch.cat([p.grad.reshape(-1) for p in params])\n'
                   '    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()\n'
                   '    offset = 0\n'
                   '    for p in params:\n'
                   '        p.grad.copy_(flat.narrow(0, offset, p.numel()).view_as(p.grad))\n'
                   '        offset += p.numel()\n'),
    Mutant(todo=6, what="each gradient replaced by its view of the summed buffer instead of copied into",
           find="        p.grad.copy_(summed.view_as(p.grad))",
           replace="        p.grad = summed.view_as(p.grad)"),
    # TODO 7: one plan for the whole model (paths blocks.i.<submodule>), applied in one call
    Mutant(todo=7, what='one plan for the whole model, keyed blocks.i.<path>, one parallelize_module call',
           find="    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout "
                'between the regions\n'
                '    enter = PrepareModuleInput(input_layouts=stream, desired_input_layouts=Replicate(), use_'
                'local_output=False)\n'
                '    for block in model.blocks:\n'
                '        plan = {\n'
                '            "attention": enter,\n'
                '            "attention.q_proj": ColwiseParallel(),\n'
                '            "attention.k_proj": ColwiseParallel(),\n'
                '            "attention.v_proj": ColwiseParallel(),\n'
                '            "attention.o_proj": RowwiseParallel(output_layouts=stream),\n'
                '            "mlp": enter,\n'
                '            "mlp.up_proj": ColwiseParallel(),\n'
                '            "mlp.down_proj": RowwiseParallel(output_layouts=stream),\n'
                '        }\n'
                '        if sequence_parallel:\n'
                '            plan["attn_norm"] = SequenceParallel()\n'
                '            plan["mlp_norm"] = SequenceParallel()\n'
                '        parallelize_module(block, tp_mesh, plan)\n'
                '    if sequence_parallel:\n'
                '        plan = {\n'
                '            "blocks.0": PrepareModuleInput(\n'
                '                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True\n'
                '            ),\n'
                '            "norm": SequenceParallel(),\n'
                '            "head": PrepareModuleInput(\n'
                '                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True\n'
                '            ),\n'
                '        }\n'
                '        parallelize_module(model, tp_mesh, plan)\n',
           replace='    stream = Shard(1) if sequence_parallel else Replicate()\n'
                   '    plan = {}\n'
                   '    for i in range(len(model.blocks)):\n'
                   '        into_region = PrepareModuleInput(input_layouts=stream, desired_input_layouts=Repl'
                   'icate(), use_local_output=False)\n'
                   '        plan[f"blocks.{i}.attention"] = plan[f"blocks.{i}.mlp"] = into_region\n'
                   '        for path in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.up_'
                   'proj"):\n'
                   '            plan[f"blocks.{i}.{path}"] = ColwiseParallel()\n'
                   '        for path in ("attention.o_proj", "mlp.down_proj"):\n'
                   '            plan[f"blocks.{i}.{path}"] = RowwiseParallel(output_layouts=stream)\n'
                   '        if sequence_parallel:\n'
                   '            plan[f"blocks.{i}.attn_norm"] = plan[f"blocks.{i}.mlp_norm"] = SequenceParallel()\n'
                   '    if sequence_parallel:\n'
                   '        plan["blocks.0"] = PrepareModuleInput(input_layouts=Replicate(), desired_input_la'
                   'youts=Shard(1), use_local_output=True)\n'
                   '        plan["norm"] = SequenceParallel()\n'
                   '        plan["head"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=R'
                   'eplicate(), use_local_output=True)\n'
                   '    parallelize_module(model, tp_mesh, plan)\n'),
    # TODO 8: f applied through @ and the adds in another order
    Mutant(todo=8, what='the MLP written with @; the bias and the residual added in another order after g',
           find='        hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias)) '
                " # f: h's gradient summed\n"
                '        y = h + ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_'
                'bias  # g, then the bias\n',
           replace='        hidden = F.gelu(CopyToParallelRegion.apply(h, group) @ up_weight.T + up_bias)\n'
                   '        y = down_bias + ReduceFromParallelRegion.apply(hidden @ down_weight.T, group) + h\n'),
]  # fmt: skip
