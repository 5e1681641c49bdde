"""Lesson 07's mutants: plausible learner mistakes, one per entry, each of which a TODO's tests must catch."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the all-reduce hook
    Mutant(
        todo=1,
        what="returns the sum, not the average (no division by the group size)",
        find="    return future.then(lambda fut: fut.value()[0].div_(n))",
        replace="    return future.then(lambda fut: fut.value()[0])",
    ),
    Mutant(
        todo=1,
        what="averages twice: ReduceOp.AVG, then divides by n again",
        find="    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()",
        replace="    future = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()",
    ),
    # TODO 2: top-k with error feedback
    Mutant(
        todo=2,
        what="no error feedback: what was not sent is forgotten",
        find="    corrected = grad + state.error_of(bucket)",
        replace="    corrected = grad.clone()",
    ),
    Mutant(
        todo=2,
        what="the k largest values instead of the k largest magnitudes (negative gradients never go out)",
        find="    indices = corrected.abs().topk(k, sorted=False).indices",
        replace="    indices = corrected.topk(k, sorted=False).indices",
    ),
    Mutant(
        todo=2,
        what="the sent entries stay in the error: they are sent again at the next step",
        find="    corrected[indices] = 0\n",
        replace="",
    ),
    Mutant(
        todo=2,
        what="the error kept per bucket index: after DDP rebuilds its buckets it lands on other parameters",
        find=(
            "    corrected = grad + state.error_of(bucket)\n"
            "    indices = corrected.abs().topk(k, sorted=False).indices\n"
            "    values = corrected[indices]\n"
            "    corrected[indices] = 0\n"
            "    state.keep(bucket, corrected)"
        ),
        replace=(
            "    error = state.errors.get(bucket.index())\n"
            "    corrected = grad + error if error is not None and error.numel() == grad.numel() else grad.clone()\n"
            "    indices = corrected.abs().topk(k, sorted=False).indices\n"
            "    values = corrected[indices]\n"
            "    corrected[indices] = 0\n"
            "    state.errors[bucket.index()] = corrected"
        ),
    ),
    Mutant(
        todo=2,
        what="decode ignores the collectives' futures: a failed all-gather decodes an unfilled buffer",
        find="        torch.futures.wait_all(collected.value())  # raises if a collective failed",
        replace="        pass",
    ),
    Mutant(
        todo=2,
        what="the gathered values are summed, not averaged",
        find="        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values).div_(n)",
        replace="        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values)",
    ),
    # TODO 3: stochastic rounding
    Mutant(
        todo=3,
        what="rounds to the nearest level (biased: small gradients always become 0)",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = scaled - low >= 0.5",
    ),
    Mutant(
        todo=3,
        what="scale = max|x| instead of max|x| / L: only the levels -1, 0, 1 are used",
        find="    scale = top / levels if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)",
        replace="    scale = top if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)",
    ),
    Mutant(
        todo=3,
        what="draws from the global random generator instead of `generator`",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = torch.rand(x.shape, device=x.device, dtype=x.dtype) < scaled - low",
    ),
    # TODO 4: the quantized exchange
    Mutant(
        todo=4,
        what="decodes every rank's codes with rank 0's scale",
        find="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)",
        replace="        return dequantize(all_codes, all_scales[0]).sum(0).div_(n)",
    ),
    Mutant(
        todo=4,
        what="decode ignores the collectives' futures: a failed all-gather decodes an unfilled buffer",
        find="        torch.futures.wait_all(collected.value())  # raises the collectives' errors",
        replace="        pass",
    ),
    Mutant(
        todo=4,
        what="the decoded rows are summed, not averaged",
        find="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)",
        replace="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0)",
    ),
    Mutant(
        todo=4,
        what="sends the codes in their own dtype: gloo has no int16 collective, 2- and 4-bit codes go unpacked",
        find="    data = to_bytes(codes, state.bits)",
        replace="    data = codes.reshape(-1)",
    ),
    # TODO 5: the Local SGD average
    Mutant(
        todo=5,
        what="sums the parameters instead of averaging them",
        find="        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)",
        replace="        vector_to_parameters(flat, params)",
    ),
    Mutant(
        todo=5,
        what="averages into the flat copy but never writes it back into the model",
        find="        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)",
        replace="        flat.div_(dist.get_world_size(group))",
    ),
]
