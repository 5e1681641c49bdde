"""Lesson 05's mutants: the mistakes a learner makes in each TODO, each of which its test must catch."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: balanced partition
    Mutant(todo=1, what="drops the remainder: n_layers % n_stages blocks belong to no stage",
           find="end = start + base + (1 if stage < extra else 0)", replace="end = start + base"),
    Mutant(todo=1, what="the last stage takes the whole remainder (unbalanced)",
           find="end = start + base + (1 if stage < extra else 0)",
           replace="end = start + base if stage < n_stages - 1 else n_layers"),
    # TODO 2: GPipe
    Mutant(todo=2, what="backwards in reverse micro-batch order",
           find='[("B", mb) for mb in range(n_microbatches)]',
           replace='[("B", mb) for mb in reversed(range(n_microbatches))]'),
    Mutant(todo=2, what="each forward followed at once by its backward (no pipelining)",
           find='return [("F", mb) for mb in range(n_microbatches)] + [("B", mb) for mb in range(n_microbatches)]',
           replace='return [step for mb in range(n_microbatches) for step in (("F", mb), ("B", mb))]'),
    # TODO 3: 1F1B
    Mutant(todo=3, what="one warm-up forward too many (p - r instead of p - r - 1)",
           find="warmup = min(n_stages - rank - 1, n_microbatches)",
           replace="warmup = min(n_stages - rank, n_microbatches)"),
    Mutant(todo=3, what="warm-up not capped by m (fewer micro-batches than stages breaks)",
           find="warmup = min(n_stages - rank - 1, n_microbatches)", replace="warmup = n_stages - rank - 1"),
    Mutant(todo=3, what="the steady phase runs the backward of the newest micro-batch, not the oldest",
           find='steps += [("F", warmup + i), ("B", i)]', replace='steps += [("F", warmup + i), ("B", warmup + i)]'),
    # TODO 4: the point-to-point plan
    Mutant(todo=4, what="wrong peer: gradients received from the previous stage",
           find='source, target = (previous, following) if kind == "F" else (following, previous)',
           replace="source, target = (previous, following)"),
    Mutant(todo=4, what="sends a result in the step's own batch, before computing it",
           find="batches[i + 1].append((\"send\", target, what, mb))",
           replace="batches[i].append((\"send\", target, what, mb))"),
    Mutant(todo=4, what="gradients labelled as activations",
           find='what = "activation" if kind == "F" else "gradient"', replace='what = "activation"'),
    # TODO 5: one micro-batch's forward
    Mutant(todo=5, what="loss not divided by the number of micro-batches",
           find="output = loss_fn(output, target) / n_microbatches", replace="output = loss_fn(output, target)"),
    Mutant(todo=5, what="loss divided by 2m (a uniform scaling bug: parity with itself would miss it)",
           find="output = loss_fn(output, target) / n_microbatches",
           replace="output = loss_fn(output, target) / (2 * n_microbatches)"),
    Mutant(todo=5, what="the received activation is not made a leaf that requires grad",
           find="        x.requires_grad_()\n", replace="        pass\n"),
    # TODO 6: one micro-batch's backward
    Mutant(todo=6, what="backward without the received gradient",
           find="torch.autograd.backward(output, output_gradient)", replace="output.sum().backward()"),
    Mutant(todo=6, what="sends back the gradient it received instead of its input's",
           find="return stage_input.grad", replace="return output_gradient"),
    Mutant(todo=6, what="only the input's gradient: the parameters get none",
           find="torch.autograd.backward(output, output_gradient)",
           replace="torch.autograd.backward(output, output_gradient, inputs=[stage_input])"),
    # TODO 7: the built-in pipeline
    Mutant(todo=7, what="divides the loss by m although the schedule already averages the gradients",
           find="n_microbatches, loss_fn=loss)",
           replace="n_microbatches, loss_fn=lambda output, target: loss(output, target) / n_microbatches)"),
    Mutant(todo=7, what="sums the micro-batches' gradients (scale_grads=False)",
           find="n_microbatches, loss_fn=loss)", replace="n_microbatches, loss_fn=loss, scale_grads=False)"),
    # TODO 8: the lab, capped warm-ups
    Mutant(todo=8, what="caps the warm-up at max_in_flight, not max_in_flight - 1 (the first stage holds one too many)",
           find="max_in_flight - 1, n_microbatches)", replace="max_in_flight, n_microbatches)"),
    Mutant(todo=8, what="no warm-up on any rank: deadlock-free, but no micro-batches overlap",
           find="return min(n_stages - rank - 1, max_in_flight - 1, n_microbatches)", replace="return 0"),
    Mutant(todo=8, what="warm-up counted from the wrong end of the pipeline (rank instead of p - rank - 1)",
           find="min(n_stages - rank - 1, max_in_flight - 1,", replace="min(rank, max_in_flight - 1,"),
    Mutant(todo=8, what="not capped by m: more warm-up forwards than micro-batches when m is small",
           find="max_in_flight - 1, n_microbatches)", replace="max_in_flight - 1)"),
]  # fmt: skip
