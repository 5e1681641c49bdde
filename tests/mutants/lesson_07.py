"""Lesson 07's mutants: plausible learner mistakes, one per entry, each of which a TODO's tests must catch."""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {
    "dist": "torch.distributed, the module every lesson's collectives come from",
    "torch": "the library itself",
}

# TODO 6's solution, line by line
SHARED_SEED = (
    "    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)  # every rank draws the same positions\n"
)
RANDPERM_K = "    return torch.randperm(numel, generator=generator)[:k]\n"

MUTANTS = [
    Mutant(
        todo=1,
        what="waits for the all-reduce inside the hook (a Future already done: no overlap with backward)",
        find="    return future.then(lambda fut: fut.value()[0].div_(n))\n",
        replace="    averaged = future.then(lambda fut: fut.value()[0].div_(n))\n    averaged.wait()\n"
        "    return averaged\n",
        shows=("already done", "waited"),
    ),
    # TODO 1: the all-reduce hook
    Mutant(
        todo=1,
        what="returns the sum, not the average (no division by the group size)",
        find="    return future.then(lambda fut: fut.value()[0].div_(n))",
        replace="    return future.then(lambda fut: fut.value()[0])",
        shows=("not divided by 2",),
    ),
    Mutant(
        todo=1,
        what="averages twice: ReduceOp.AVG, then divides by n again",
        find="    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()",
        replace="    future = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()",
        shows=("averaged twice",),
    ),
    Mutant(
        todo=1,
        what="the callback returns the Future's list of tensors, not the one tensor DDP expects",
        find="    return future.then(lambda fut: fut.value()[0].div_(n))",
        replace="    return future.then(lambda fut: [t.div_(n) for t in fut.value()])",
        shows=("a list",),
    ),
    # TODO 2: top-k with error feedback
    Mutant(
        todo=2,
        what="no error feedback: what was not sent is forgotten",
        find="    corrected = grad + state.error_of(bucket)",
        replace="    corrected = grad.clone()",
        shows=("nothing was kept back",),
    ),
    Mutant(
        todo=2,
        what="the k largest values instead of the k largest magnitudes (negative gradients never go out)",
        find="    indices = corrected.abs().topk(k, sorted=False).indices",
        replace="    indices = corrected.topk(k, sorted=False).indices",
        shows=("largest values were taken, not the largest magnitudes",),
    ),
    Mutant(
        todo=2,
        what="the sent entries stay in the error: they are sent again at the next step",
        find="    corrected[indices] = 0\n",
        replace="",
        shows=("stayed in the error and was sent again",),
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
        shows=("kept by bucket and position, not per parameter",),
    ),
    Mutant(
        todo=2,
        what="decode ignores the collectives' futures: a failed all-gather decodes an unfilled buffer",
        find="        torch.futures.wait_all(collected.value())  # raises if a collective failed",
        replace="        pass",
        shows=("the all-gather failed", "nobody filled"),
    ),
    Mutant(
        todo=2,
        what="averages twice: each rank's values divided by n before they are sent, and the sum divided again",
        find="    values = corrected[indices]\n",
        replace="    values = corrected[indices] / n\n",
        shows=("averaged twice",),
    ),
    Mutant(
        todo=2,
        what="the gathered values are summed, not averaged",
        find="        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values).div_(n)",
        replace="        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values)",
        shows=("summed, not averaged",),
    ),
    Mutant(
        todo=2,
        what="the positions sent as int64: 12 bytes an entry instead of 8",
        find=(
            "    all_indices = torch.empty(n * k, dtype=torch.int32, device=grad.device)\n"
            "    futures = [\n"
            "        dist.all_gather_single(all_values, values, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_single(all_indices, indices.int(), group=state.group, async_op=True).get_future(),"
        ),
        replace=(
            "    all_indices = torch.empty(n * k, dtype=torch.int64, device=grad.device)\n"
            "    futures = [\n"
            "        dist.all_gather_single(all_values, values, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_single(all_indices, indices, group=state.group, async_op=True).get_future(),"
        ),
        shows=("positions went as int64",),
    ),
    # TODO 3: stochastic rounding
    Mutant(
        todo=3,
        what="rounds to the nearest level (biased: small gradients always become 0)",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = scaled - low >= 0.5",
        shows=("rounded to the nearest level",),
    ),
    Mutant(
        todo=3,
        what="scale = max|x| instead of max|x| / L: only the levels -1, 0, 1 are used",
        find="    scale = top / levels if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)",
        replace="    scale = top if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)",
        shows=("as if scale = max|x|",),
    ),
    Mutant(
        todo=3,
        what="draws from the global random generator instead of `generator`",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = torch.rand(x.shape, device=x.device, dtype=x.dtype) < scaled - low",
        shows=("seeded alike", "global random generator"),
    ),
    Mutant(
        todo=3,
        what="the comparison inverted: rounds up with probability 1 - the fractional part (biased)",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) > scaled - low",
        shows=("1 - the fractional part",),
    ),
    Mutant(
        todo=3,
        what="truncates towards zero instead of flooring: negative entries never round down (biased)",
        find="    low = scaled.floor()\n",
        replace="    low = scaled.trunc()\n",
        shows=("truncated towards zero",),
    ),
    Mutant(
        todo=3,
        what="int8 codes at every width: 16-bit codes do not fit in a byte",
        find="    codes = (low + up).clamp_(-levels, levels).to(torch.int8 if bits <= 8 else torch.int16)",
        replace="    codes = (low + up).clamp_(-levels, levels).to(torch.int8)",
        shows=("16-bit codes travel as torch.int16",),
    ),
    # TODO 4: the quantized exchange
    Mutant(
        todo=4,
        what="decodes every rank's codes with rank 0's scale",
        find="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)",
        replace="        return dequantize(all_codes, all_scales[0]).sum(0).div_(n)",
        shows=("rank 0's scale",),
    ),
    Mutant(
        todo=4,
        what="decode ignores the collectives' futures: a failed all-gather decodes an unfilled buffer",
        find="        torch.futures.wait_all(collected.value())  # raises the collectives' errors",
        replace="        pass",
        shows=("the all-gather failed", "unfilled buffers"),
    ),
    Mutant(
        todo=4,
        what="the decoded rows are summed, not averaged",
        find="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)",
        replace="        return dequantize(all_codes, all_scales.view(n, 1)).sum(0)",
        shows=("summed, not averaged",),
    ),
    Mutant(
        todo=4,
        what="sends the codes in their own dtype: gloo has no int16 collective, 2- and 4-bit codes go unpacked",
        find="    data = to_bytes(codes, state.bits)",
        replace="    data = codes.reshape(-1)",
        shows=("went unpacked",),
    ),
    # TODO 5: the Local SGD average
    Mutant(
        todo=5,
        what="sums the parameters instead of averaging them",
        find="        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)",
        replace="        vector_to_parameters(flat, params)",
        shows=("not divided by 2",),
    ),
    Mutant(
        todo=5,
        what="averages into the flat copy but never writes it back into the model",
        find="        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)",
        replace="        flat.div_(dist.get_world_size(group))",
        shows=("never went back",),
    ),
    Mutant(
        todo=5,
        what="one all-reduce per parameter tensor: the same bytes, each tensor paying the link's latency",
        find="        flat = parameters_to_vector(params)\n        dist.all_reduce(flat, group=group)\n"
        "        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)",
        replace="        for p in params:\n            dist.all_reduce(p, group=group)\n"
        "            p.div_(dist.get_world_size(group))",
        shows=("one collective, not one per tensor",),
    ),
    # TODO 6: the lab, random-k positions
    Mutant(
        todo=6,
        what="seeded from the seed only: the same positions on every rank, but also at every step",
        find=SHARED_SEED,
        replace="    generator = torch.Generator().manual_seed(seed)\n",
        shows=("same k positions", "never train"),
    ),
    Mutant(
        todo=6,
        what="no generator: the global one, seeded differently on each rank (as for dropout)",
        find=RANDPERM_K,
        replace="    return torch.randperm(numel)[:k]\n",
        shows=("other positions than rank 0",),
    ),
    Mutant(
        todo=6,
        what="k positions drawn with replacement (randint): some entries sent twice",
        find=RANDPERM_K,
        replace="    return torch.randint(numel, (k,), generator=generator)\n",
        shows=("repeats positions",),
    ),
    Mutant(
        todo=6,
        what="seeded from the seed and the rank, once per rank (not per step)",
        find=SHARED_SEED,
        replace="    generator = torch.Generator().manual_seed(seed + rank)\n",
        shows=("other positions than rank 0",),
    ),
]

VARIANTS = [  # correct answers written another way: each TODO's tests must accept them
    # TODO 1
    Mutant(
        todo=1,
        what="ReduceOp.AVG averages in the collective: nothing left to divide",
        find=(
            "    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()\n"
            "    return future.then(lambda fut: fut.value()[0].div_(n))"
        ),
        replace=(
            "    future = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()\n"
            "    return future.then(lambda fut: fut.value()[0])"
        ),
    ),
    Mutant(
        todo=1,
        what="divides each rank's gradients before the sum; the callback returns the bucket's own tensor",
        find=(
            "    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()\n"
            "    return future.then(lambda fut: fut.value()[0].div_(n))"
        ),
        replace=(
            "    work = dist.all_reduce(buffer.div_(n), group=group, async_op=True)\n"
            "    return work.get_future().then(lambda _: buffer)"
        ),
    ),
    # TODO 2
    Mutant(
        todo=2,
        what="all-gathers under torch < 2.13's name, all_gather_into_tensor (deprecated in 2.13)",
        find=(
            "        dist.all_gather_single(all_values, values, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_single(all_indices, indices.int(), group=state.group, "
            "async_op=True).get_future(),\n"
        ),
        replace=(
            "        dist.all_gather_into_tensor(all_values, values, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_into_tensor(all_indices, indices.int(), state.group, "
            "async_op=True).get_future(),\n"
        ),
    ),
    Mutant(
        todo=2,
        what="waits for both all-gathers in the hook (torch.futures.wait_all) and returns a completed Future",
        find=(
            "    return torch.futures.collect_all(futures).then(decode)\n"
            '    # EXERCISE\n    # raise NotImplementedError("TODO 2'
        ),
        replace=(
            "    torch.futures.wait_all(futures)  # raises if a collective failed\n"
            "    done = torch.futures.Future()\n"
            "    done.set_result(torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values).div_(n))\n"
            '    return done\n    # EXERCISE\n    # raise NotImplementedError("TODO 2'
        ),
    ),
    Mutant(
        todo=2,
        what="decode asks each collective's Future for its value (raises if it failed); index_put_ accumulates",
        find=(
            "        torch.futures.wait_all(collected.value())  # raises if a collective failed\n"
            "        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values).div_(n)"
        ),
        replace=(
            "        for gathered in collected.value():\n"
            "            gathered.value()\n"
            "        summed = torch.zeros_like(grad).index_put_((all_indices.long(),), all_values, accumulate=True)\n"
            "        return summed / n"
        ),
    ),
    Mutant(
        todo=2,
        what="sorted top-k through torch.topk, the values taken with index_select",
        find=("    indices = corrected.abs().topk(k, sorted=False).indices\n    values = corrected[indices]\n"),
        replace=(
            "    indices = torch.topk(corrected.abs(), k).indices\n    values = corrected.index_select(0, indices)\n"
        ),
    ),
    # TODO 3
    Mutant(
        todo=3,
        what="floor(x / scale + uniform): up with probability = the fractional part, in one expression",
        find=(
            "    low = scaled.floor()\n"
            "    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low\n"
            "    codes = (low + up).clamp_(-levels, levels).to(torch.int8 if bits <= 8 else torch.int16)"
        ),
        replace=(
            "    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)\n"
            "    codes = torch.floor(scaled + noise).clamp(-levels, levels)\n"
            "    codes = codes.to(torch.int8) if bits <= 8 else codes.to(torch.int16)"
        ),
    ),
    Mutant(
        todo=3,
        what="round(x / scale + uniform - 1/2), amax for the largest magnitude",
        find=(
            "    top = x.abs().max()\n"
            "    scale = top / levels if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)\n"
            "    scaled = x / scale\n"
            "    low = scaled.floor()\n"
            "    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low\n"
            "    codes = (low + up).clamp_(-levels, levels).to(torch.int8 if bits <= 8 else torch.int16)"
        ),
        replace=(
            "    top = x.abs().amax()\n"
            "    scale = top / levels if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)\n"
            "    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)\n"
            "    codes = torch.round(x / scale + noise - 0.5).clamp_(-levels, levels)\n"
            "    codes = codes.to(torch.int8 if bits <= 8 else torch.int16)"
        ),
    ),
    Mutant(
        todo=3,
        what="the upward step drawn with torch.bernoulli from `generator`",
        find="    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low",
        replace="    up = torch.bernoulli(scaled - low, generator=generator)",
    ),
    # TODO 4
    Mutant(
        todo=4,
        what="waits for both all-gathers in the hook (torch.futures.wait_all) and returns a completed Future",
        find=(
            "    def decode(collected):\n"
            "        torch.futures.wait_all(collected.value())  # raises the collectives' errors\n"
            "        all_codes = from_bytes(all_data.view(n, -1), state.bits, grad.numel())\n"
            "        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)\n"
            "\n"
            "    return torch.futures.collect_all(futures).then(decode)"
        ),
        replace=(
            "    torch.futures.wait_all(futures)\n"
            "    all_codes = from_bytes(all_data.view(n, -1), state.bits, grad.numel())\n"
            "    done = torch.futures.Future()\n"
            "    done.set_result(dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n))\n"
            "    return done"
        ),
    ),
    Mutant(
        todo=4,
        what="the scales gathered first, each row scaled by broadcasting and averaged with mean",
        find=(
            "    futures = [\n"
            "        dist.all_gather_single(all_data, data, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_single(all_scales, scale.reshape(1), group=state.group, async_op=True)"
            ".get_future(),\n"
            "    ]\n"
            "\n"
            "    def decode(collected):\n"
            "        torch.futures.wait_all(collected.value())  # raises the collectives' errors\n"
            "        all_codes = from_bytes(all_data.view(n, -1), state.bits, grad.numel())\n"
            "        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)"
        ),
        replace=(
            "    futures = [\n"
            "        dist.all_gather_single(all_scales, scale.view(1), group=state.group, async_op=True)"
            ".get_future(),\n"
            "        dist.all_gather_single(all_data, data, group=state.group, async_op=True).get_future(),\n"
            "    ]\n"
            "\n"
            "    def decode(collected):\n"
            "        for gathered in collected.value():\n"
            "            gathered.wait()\n"
            "        rows = from_bytes(all_data.view(n, -1), state.bits, grad.numel()).to(all_scales.dtype)\n"
            "        return (rows * all_scales[:, None]).mean(0)"
        ),
    ),
    # TODO 5
    Mutant(
        todo=5,
        what="ReduceOp.AVG: the collective averages, the vector goes back as it comes",
        find=(
            "        dist.all_reduce(flat, group=group)\n"
            "        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)"
        ),
        replace=(
            "        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n"
            "        vector_to_parameters(flat, params)"
        ),
    ),
    Mutant(
        todo=5,
        what="flattened with torch.cat and copied back piece by piece",
        find=(
            "        flat = parameters_to_vector(params)\n"
            "        dist.all_reduce(flat, group=group)\n"
            "        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)"
        ),
        replace=(
            "        flat = torch.cat([p.reshape(-1) for p in params])\n"
            "        dist.all_reduce(flat, group=group)\n"
            "        flat /= dist.get_world_size(group)\n"
            "        for p, piece in zip(params, flat.split([p.numel() for p in params])):\n"
            "            p.copy_(piece.view_as(p))"
        ),
    ),
    # TODO 6: the lab
    Mutant(
        todo=6,
        what="rank 0 draws from the global generator and broadcasts its positions",
        find=SHARED_SEED + RANDPERM_K,
        replace="    positions = torch.randperm(numel)[:k]\n"
        "    dist.broadcast(positions, src=0)\n"
        "    return positions\n",
    ),
    Mutant(
        todo=6,
        what="the k largest of uniform draws from a shared generator (seed + step), sorted",
        find=SHARED_SEED + RANDPERM_K,
        replace="    shared = torch.Generator().manual_seed(seed + step)\n"
        "    return torch.rand(numel, generator=shared).topk(k).indices.sort().values\n",
    ),
    Mutant(
        todo=6,
        what="multinomial without replacement from a shared generator",
        find=RANDPERM_K,
        replace="    return torch.multinomial(torch.ones(numel), k, replacement=False, generator=generator)\n",
    ),
    Mutant(
        todo=4,
        what="the list form, dist.all_gather, into one tensor per rank, then concatenated",
        find=(
            "    all_data = data.new_empty(n * data.numel())\n"
            "    all_scales = scale.new_empty(n)\n"
            "    futures = [\n"
            "        dist.all_gather_single(all_data, data, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather_single(all_scales, scale.reshape(1), group=state.group, "
            "async_op=True).get_future(),\n"
            "    ]\n"
            "\n"
            "    def decode(collected):\n"
            "        torch.futures.wait_all(collected.value())  # raises the collectives' errors\n"
        ),
        replace=(
            "    datas = [data.new_empty(data.numel()) for _ in range(n)]\n"
            "    scales = [scale.new_empty(1) for _ in range(n)]\n"
            "    futures = [\n"
            "        dist.all_gather(datas, data, group=state.group, async_op=True).get_future(),\n"
            "        dist.all_gather(scales, scale.reshape(1), group=state.group, async_op=True).get_future(),\n"
            "    ]\n"
            "\n"
            "    def decode(collected):\n"
            "        torch.futures.wait_all(collected.value())  # raises the collectives' errors\n"
            "        all_data, all_scales = torch.cat(datas), torch.cat(scales)\n"
        ),
    ),
]
