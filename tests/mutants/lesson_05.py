"""Lesson 05's mutants: the mistakes a learner makes in each TODO, each of which its test must catch; its
VARIANTS: correct answers written another way, which every TODO's tests must accept; and the API names its TODO
comments may use (COMMENT_MAY_NAME, for tests/harness/todo_comments.py)."""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {
    "PipelineStage": "the built-in's stage wrapper that TODO 7 must call, introduced in the notebook's section 2",
    "pipelining": "torch.distributed.pipelining, the built-in module the notebook introduces in section 2",
}

MUTANTS = [
    # TODO 1: balanced partition
    Mutant(todo=1, what="drops the remainder: n_layers % n_stages blocks belong to no stage",
           find="end = start + base + (1 if stage < extra else 0)", replace="end = start + base",
           shows=("ends at 2, want 3", "belonged to no stage")),
    Mutant(todo=1, what="the last stage takes the whole remainder (unbalanced)",
           find="end = start + base + (1 if stage < extra else 0)",
           replace="end = start + base if stage < n_stages - 1 else n_layers",
           shows=("sizes [1, 1, 3]", "the last stage took every spare block")),
    # TODO 2: GPipe
    Mutant(todo=2, what="backwards in reverse micro-batch order",
           find='[("B", mb) for mb in range(n_microbatches)]',
           replace='[("B", mb) for mb in reversed(range(n_microbatches))]',
           shows=("step 2 is ('B', 1), want ('B', 0)", "newest micro-batch first")),
    Mutant(todo=2, what="each forward followed at once by its backward (no pipelining)",
           find='return [("F", mb) for mb in range(n_microbatches)] + [("B", mb) for mb in range(n_microbatches)]',
           replace='return [step for mb in range(n_microbatches) for step in (("F", mb), ("B", mb))]',
           shows=("step 1 is ('B', 0), want ('F', 1)", "followed at once by its backward")),
    # TODO 3: 1F1B
    Mutant(todo=3, what="one warm-up forward too many (p - r instead of p - r - 1)",
           find="warmup = min(n_stages - rank - 1, n_microbatches)",
           replace="warmup = min(n_stages - rank, n_microbatches)",
           shows=("step 1 is ('F', 1), want ('B', 0)", "one forward too many")),
    Mutant(todo=3, what="warm-up not capped by m (fewer micro-batches than stages breaks)",
           find="warmup = min(n_stages - rank - 1, n_microbatches)", replace="warmup = n_stages - rank - 1",
           shows=("('F', 1)", "not limited to the m micro-batches")),
    Mutant(todo=3, what="the steady phase runs the backward of the newest micro-batch, not the oldest",
           find='steps += [("F", warmup + i), ("B", i)]', replace='steps += [("F", warmup + i), ("B", warmup + i)]',
           shows=("step 2 is ('B', 1), want ('B', 0)", "newest micro-batch, not the oldest")),
    # TODO 4: the point-to-point plan
    Mutant(todo=4, what="wrong peer: gradients received from the previous stage",
           find='source, target = (previous, following) if kind == "F" else (following, previous)',
           replace="source, target = (previous, following)",
           shows=("receive gradient 0 from rank 1", "as activations do")),
    Mutant(todo=4, what="sends a result in the step's own batch, before computing it",
           find="batches[i + 1].append((\"send\", target, what, mb))",
           replace="batches[i].append((\"send\", target, what, mb))",
           shows=("batch 0", "before the step that computes it")),
    Mutant(todo=4, what="gradients labelled as activations",
           find='what = "activation" if kind == "F" else "gradient"', replace='what = "activation"',
           shows=("labelled as activations",)),
    # TODO 5: one micro-batch's forward
    Mutant(todo=5, what="loss not divided by the number of micro-batches",
           find="output = loss_fn(output, target) / n_microbatches", replace="output = loss_fn(output, target)",
           shows=("want", "not divided by m")),
    Mutant(todo=5, what="loss divided by 2m (a uniform scaling bug: parity with itself would miss it)",
           find="output = loss_fn(output, target) / n_microbatches",
           replace="output = loss_fn(output, target) / (2 * n_microbatches)",
           shows=("want", "divided by 2m")),
    Mutant(todo=5, what="the received activation is not made a leaf that requires grad",
           find="        x.requires_grad_()\n", replace="        pass\n",
           shows=("requires_grad=False", "used as it came")),
    # TODO 6: one micro-batch's backward
    Mutant(todo=6, what="backward without the received gradient",
           find="torch.autograd.backward(output, output_gradient)", replace="output.sum().backward()",
           shows=("token_embedding.weight.grad", "from its output's sum")),
    Mutant(todo=6, what="sends back the gradient it received instead of its input's",
           find="return stage_input.grad", replace="return output_gradient",
           shows=("returned None", "the gradient it received")),
    Mutant(todo=6, what="only the input's gradient: the parameters get none",
           find="torch.autograd.backward(output, output_gradient)",
           replace="torch.autograd.backward(output, output_gradient, inputs=[stage_input])",
           shows=("grad is None", "only the input's gradient")),
    # TODO 7: the built-in pipeline
    Mutant(todo=7, what="divides the loss by m although the schedule already averages the gradients",
           find="n_microbatches, loss_fn=loss)",
           replace="n_microbatches, loss_fn=lambda output, target: loss(output, target) / n_microbatches)",
           shows=("norm ratio 0.50", "divided by m twice")),
    Mutant(todo=7, what="sums the micro-batches' gradients (scale_grads=False)",
           find="n_microbatches, loss_fn=loss)", replace="n_microbatches, loss_fn=loss, scale_grads=False)",
           shows=("norm ratio 2.00", "summed over the micro-batches")),
    Mutant(todo=7, what="the stages talk over the default group, not the pipeline's (right only when pp is the world)",
           find="n_stages, device, group=pp_group)\n",
           replace="n_stages, device)\n",
           shows=("without the pipeline's group",)),
    # TODO 8: the lab, capped warm-ups
    Mutant(todo=8, what="caps the warm-up at max_in_flight, not max_in_flight - 1 (the first stage holds one too many)",
           find="max_in_flight - 1, n_microbatches)", replace="max_in_flight, n_microbatches)",
           shows=("rank 0 holds 3", "not the forward that follows them")),
    Mutant(todo=8, what="no warm-up on any rank: deadlock-free, but no micro-batches overlap",
           find="return min(n_stages - rank - 1, max_in_flight - 1, n_microbatches)", replace="return 0",
           shows=("rank 0 warms up 0, the cap allows 1", "no rank warmed up")),
    Mutant(todo=8, what="warm-up counted from the wrong end of the pipeline (rank instead of p - rank - 1)",
           find="min(n_stages - rank - 1, max_in_flight - 1,", replace="min(rank, max_in_flight - 1,",
           shows=("deadlock", "wrong end of the pipeline")),
    Mutant(todo=8, what="not capped by m: more warm-up forwards than micro-batches when m is small",
           find="max_in_flight - 1, n_microbatches)", replace="max_in_flight - 1)",
           shows=("returned 2", "not limited to the m micro-batches")),
]  # fmt: skip

PARTITION = """    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
"""
ONE_F_ONE_B = """    steps = [("F", mb) for mb in range(warmup)]
    for i in range(n_microbatches - warmup):
        steps += [("F", warmup + i), ("B", i)]
    steps += [("B", mb) for mb in range(n_microbatches - warmup, n_microbatches)]
    return steps
"""
P2P = """    for i, (kind, mb) in enumerate(steps):
        source, target = (previous, following) if kind == "F" else (following, previous)
        what = "activation" if kind == "F" else "gradient"
        if source is not None:
            batches[i].append(("recv", source, what, mb))
        if target is not None:
            batches[i + 1].append(("send", target, what, mb))
"""
BUILTIN = """    stages = [
        pipelining.PipelineStage(module, index, n_stages, device, group=pp_group)
        for module, index in zip(stage_modules, stage_indices)
    ]
"""

VARIANTS = [  # correct answers written another way: every TODO's tests must accept them
    # TODO 1: any balanced contiguous cut
    Mutant(todo=1, what="cut points by arithmetic: stage s starts at s * base + min(s, extra)", find=PARTITION,
           replace="""    base, extra = divmod(n_layers, n_stages)
    return [(s * base + min(s, extra), (s + 1) * base + min(s + 1, extra)) for s in range(n_stages)]
"""),
    Mutant(todo=1, what="cut points by floor division: stage s starts at n_layers * s // n_stages", find=PARTITION,
           replace="""    cuts = [n_layers * s // n_stages for s in range(n_stages + 1)]
    return list(zip(cuts, cuts[1:]))
"""),
    Mutant(todo=1, what="the spare blocks on the last stages instead of the first (as balanced)",
           find="end = start + base + (1 if stage < extra else 0)",
           replace="end = start + base + (1 if stage >= n_stages - extra else 0)"),
    Mutant(todo=1, what="ranges as lists [start, end]", find="ranges.append((start, end))",
           replace="ranges.append([start, end])"),
    # TODO 2: GPipe
    Mutant(todo=2, what="one comprehension over the kinds, then the micro-batches",
           find='return [("F", mb) for mb in range(n_microbatches)] + [("B", mb) for mb in range(n_microbatches)]',
           replace='return [(kind, mb) for kind in ("F", "B") for mb in range(n_microbatches)]'),
    Mutant(todo=2, what="steps as lists [kind, mb], appended in a loop",
           find='return [("F", mb) for mb in range(n_microbatches)] + [("B", mb) for mb in range(n_microbatches)]',
           replace="""steps = []
    for kind in "FB":
        for mb in range(n_microbatches):
            steps.append([kind, mb])
    return steps"""),
    # TODO 3: 1F1B
    Mutant(todo=3, what="forwards and backwards as two queues, zipped in the steady phase", find=ONE_F_ONE_B,
           replace="""    forwards = [("F", mb) for mb in range(n_microbatches)]
    backwards = [("B", mb) for mb in range(n_microbatches)]
    steps = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        steps += [forward, backward]
    return steps + backwards[n_microbatches - warmup :]
"""),
    Mutant(todo=3, what="a loop that runs a forward while fewer than warm-up + 1 are in flight, else a backward",
           find=ONE_F_ONE_B, replace="""    steps, next_forward, next_backward = [], 0, 0
    while next_backward < n_microbatches:
        if next_forward < n_microbatches and next_forward - next_backward <= warmup:
            steps.append(("F", next_forward))
            next_forward += 1
        else:
            steps.append(("B", next_backward))
            next_backward += 1
    return steps
"""),
    Mutant(todo=3, what="the warm-up written as a conditional instead of min()",
           find="warmup = min(n_stages - rank - 1, n_microbatches)",
           replace="warmup = n_stages - rank - 1 if n_stages - rank - 1 < n_microbatches else n_microbatches"),
    # TODO 4: the point-to-point plan
    Mutant(todo=4, what="one branch per kind, neighbours tested by rank rather than None", find=P2P, replace="""\
    for i, (kind, mb) in enumerate(steps):
        if kind == "F":
            if rank > 0:
                batches[i].append(("recv", rank - 1, "activation", mb))
            if rank < n_stages - 1:
                batches[i + 1].append(("send", rank + 1, "activation", mb))
        else:
            if rank < n_stages - 1:
                batches[i].append(("recv", rank + 1, "gradient", mb))
            if rank > 0:
                batches[i + 1].append(("send", rank - 1, "gradient", mb))
"""),
    Mutant(todo=4, what="each batch's receive placed before the previous step's send",
           find='batches[i].append(("recv", source, what, mb))',
           replace='batches[i].insert(0, ("recv", source, what, mb))'),
    Mutant(todo=4, what="operations as lists [op, peer, what, mb]",
           find='batches[i + 1].append(("send", target, what, mb))',
           replace='batches[i + 1].append(["send", target, what, mb])'),
    # TODO 5: one micro-batch's forward
    Mutant(todo=5, what="a detached copy of the received activation that requires grad (returned as the input)",
           find="        x.requires_grad_()\n", replace="        x = x.detach().requires_grad_()\n"),
    Mutant(todo=5, what="requires_grad set as an attribute", find="        x.requires_grad_()\n",
           replace="        x.requires_grad = True\n"),
    Mutant(todo=5, what="the loss scaled with Tensor.div", find="output = loss_fn(output, target) / n_microbatches",
           replace="output = loss_fn(output, target).div(n_microbatches)"),
    # TODO 6: one micro-batch's backward
    Mutant(todo=6, what="Tensor.backward with the received gradient",
           find="torch.autograd.backward(output, output_gradient)", replace="output.backward(output_gradient)"),
    Mutant(todo=6, what="grad_tensors by keyword, in lists",
           find="torch.autograd.backward(output, output_gradient)",
           replace="torch.autograd.backward([output], grad_tensors=[output_gradient])"),
    Mutant(todo=6, what="None returned explicitly for an input that needs no gradient (tokens)",
           find="return stage_input.grad", replace="return stage_input.grad if stage_input.requires_grad else None"),
    # TODO 7: the built-in pipeline
    Mutant(todo=7, what="the stages built in a loop, with PipelineStage's keyword names", find=BUILTIN, replace="""\
    stages = []
    for module, index in zip(stage_modules, stage_indices):
        stages.append(
            pipelining.PipelineStage(
                submodule=module, stage_index=index, num_stages=n_stages, device=device, group=pp_group
            )
        )
"""),
    Mutant(todo=7, what="one stage or a list chosen by how many this rank holds; scale_grads=True spelt out",
           find="return built_in(stages if schedule in MULTI_STAGE else stages[0], n_microbatches, loss_fn=loss)",
           replace="return built_in(stages if len(stages) > 1 else stages[0], n_microbatches, loss_fn=loss, "
                   "scale_grads=True)"),
    # TODO 8: the lab
    Mutant(todo=8, what="the exercise's code with the cap applied on every rank, not on rank 0 only",
           find="    return min(n_stages - rank - 1, max_in_flight - 1, n_microbatches)  # the cap holds all along",
           replace="""    warmup = min(n_microbatches, n_stages - rank - 1)
    return min(warmup, max_in_flight - 1)  # the cap holds all along"""),
]  # fmt: skip
