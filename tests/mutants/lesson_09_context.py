"""Lesson 09, context parallelism (TODOs 1-5): the mistakes a learner makes, each of which its test must catch."""

from tests.mutants import Mutant

NEXT = "send_to=(ring.rank + 1) % ring.size, receive_from=(ring.rank - 1) % ring.size"
POST = f"        if step < ring.size - 1:\n            pending = ring.start(kv, {NEXT})\n"
SKIP = (
    "                if k_positions[ks][0] > positions[qs][-1]:\n"
    "                    continue  # every key of this piece comes after every query: nothing to see\n"
)  # TODO 4's (TODO 5's has no comment after `continue`)
VISIT = (
    "        k_positions = all_positions[owner]\n"
    "        for qs in pieces(positions):\n"
    "            for ks in pieces(k_positions):\n" + SKIP
)
COMPUTE = (
    "                ring.count(qs.stop - qs.start, ks.stop - ks.start)\n"
    "                block = block_attention(\n"
    "                    q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], positions[qs], k_positions[ks]\n"
    "                )\n"
    "                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], *block)\n"
)
WAIT = "        if step < ring.size - 1:\n            kv = pending.wait()\n    # END SOLUTION\n    return out, lse"
MASK = '    scores = scores.masked_fill(hidden, float("-inf"))\n'
LSE = "    lse = torch.logsumexp(scores, dim=-1)\n"
GRADIENT_HOP = f"        d_kv = ring.start(d_kv, {NEXT}).wait()"

MUTANTS = [
    # TODO 1: the split of the sequence
    Mutant(todo=1, what="zigzag pairs chunk r with chunk N - 1 - r (of 2N): both chunks from the first half",
           find="mirror = 2 * world_size - 1 - rank", replace="mirror = world_size - 1 - rank"),
    Mutant(todo=1, what="zigzag chunks of T / N tokens instead of T / 2N",
           find="size = seq_len // (2 * world_size)", replace="size = seq_len // world_size"),
    Mutant(todo=1, what="contiguous: every rank numbers its chunk from 0 (local places, not the sequence's)",
           find="        return torch.arange(rank * size, (rank + 1) * size)\n",
           replace="        return torch.arange(size)\n"),
    # TODO 1 (more)
    Mutant(todo=1, what="zigzag pairs chunk r with chunk N + r (a shift, not the mirror): still unbalanced",
           find="mirror = 2 * world_size - 1 - rank", replace="mirror = world_size + rank"),
    # TODO 2: one block's attention with its log-sum-exp
    Mutant(todo=2, what="masks by the places inside the block instead of the global positions",
           find="hidden = k_positions[None, :] > q_positions[:, None]",
           replace="hidden = torch.arange(k.shape[-2])[None, :] > torch.arange(q.shape[-2])[:, None]"),
    Mutant(todo=2, what="forgets the 1 / sqrt(d) scaling of the scores",
           find="scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])",
           replace="scores = q @ k.transpose(-2, -1)"),
    Mutant(todo=2, what="the running maximum taken for the log-sum-exp (the softmax is never normalised)",
           find="lse = torch.logsumexp(scores, dim=-1)", replace="lse = scores.amax(dim=-1)"),
    Mutant(todo=2, what="hides the query's own position too (>= instead of >)",
           find="hidden = k_positions[None, :] > q_positions[:, None]",
           replace="hidden = k_positions[None, :] >= q_positions[:, None]"),
    Mutant(todo=2, what="the log-sum-exp taken before the mask (over every key of the block, later ones too)",
           find=MASK + LSE, replace=LSE + MASK),
    # TODO 3: merging a block into the running output
    Mutant(todo=3, what="forgets to rescale the running output",
           find="out = out * torch.exp(lse - new_lse)[..., None] + block_out",
           replace="out = out + block_out"),
    Mutant(todo=3, what="keeps the running maximum instead of the log-sum-exp",
           find="new_lse = torch.logaddexp(lse, block_lse)", replace="new_lse = torch.maximum(lse, block_lse)"),
    Mutant(todo=3, what="log(exp + exp) written out: overflows to inf for scores in the hundreds",
           find="new_lse = torch.logaddexp(lse, block_lse)",
           replace="new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))"),
    Mutant(todo=3, what="returns the old log-sum-exp: the next block is weighed against a stale normaliser",
           find="    return out, new_lse\n", replace="    return out, lse\n"),
    # TODO 4: the ring forward
    Mutant(todo=4, what="sends to rank - 1 while receiving from rank - 1 (the ring never closes)",
           find=POST + VISIT,
           replace=POST.replace("send_to=(ring.rank + 1)", "send_to=(ring.rank - 1)") + VISIT),
    Mutant(todo=4, what="takes the block it holds at step s for rank + s's (the ring turns the other way)",
           find="        owner = (ring.rank - step) % ring.size\n" + POST + VISIT,
           replace="        owner = (ring.rank + step) % ring.size\n" + POST + VISIT),
    Mutant(todo=4, what="computes the blocks entirely in the future too (no causal skip)",
           find=VISIT, replace=VISIT.replace(SKIP, "")),
    Mutant(todo=4, what="no overlap: computes, then posts the exchange and waits for it at once",
           find=POST + VISIT + COMPUTE + WAIT,
           replace=VISIT + COMPUTE + WAIT.replace("pending.wait()", f"ring.start(kv, {NEXT}).wait()")),
    Mutant(todo=4, what="forwards its own keys and values at every hop, not the block it holds",
           find=POST + VISIT + COMPUTE,
           replace=POST.replace("ring.start(kv,", "ring.start(torch.stack([k, v]),") + VISIT + COMPUTE),
    Mutant(todo=4, what="skips a block when its first key is not before the last query (>=): loses the diagonal",
           find=SKIP, replace=SKIP.replace("> positions[qs][-1]", ">= positions[qs][-1]")),
    # TODO 5: the ring backward
    Mutant(todo=5, what="the keys' and values' gradients stay on the rank that computed them (never travel)",
           find=GRADIENT_HOP, replace="        pass"),
    Mutant(todo=5, what="the gradients travel the other way round the ring from their blocks",
           find=GRADIENT_HOP,
           replace="        d_kv = ring.start(d_kv, send_to=(ring.rank - 1) % ring.size, "
           "receive_from=(ring.rank + 1) % ring.size).wait()"),
    Mutant(todo=5, what="no last hop: each rank ends with its neighbour's gradients, not its own",
           find=GRADIENT_HOP, replace="        if step < ring.size - 1:\n    " + GRADIENT_HOP),
    Mutant(todo=5, what="each block's query gradient overwrites the previous ones instead of adding",
           find="d_q[..., qs, :] += d_q_piece", replace="d_q[..., qs, :] = d_q_piece"),
    Mutant(todo=5, what="each block's key gradient overwrites what the other query piece added",
           find="d_kv[0][..., ks, :] += d_k_piece", replace="d_kv[0][..., ks, :] = d_k_piece"),
    Mutant(todo=5, what="skips a block when its first key is not before the last query (>=): loses the diagonal",
           find="                if k_positions[ks][0] > positions[qs][-1]:\n                    continue\n",
           replace="                if k_positions[ks][0] >= positions[qs][-1]:\n                    continue\n"),
]  # fmt: skip
