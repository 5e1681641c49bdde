"""Lesson 09 (context parallelism): the mistakes a learner makes, each of which its TODO's test must catch, and
correct answers written another way, which every check must accept."""

from tests.mutants import Mutant

POST = "ring.start(kv, send_to=next_rank, receive_from=previous_rank)"
SKIP = (
    "                if k_positions[ks][0] > positions[qs][-1]:\n"
    "                    continue  # every key of this piece comes after every query: nothing to see\n"
)  # TODO 4's (TODO 5's has no comment after `continue`)
FORWARD_STEP = (  # TODO 4, from the post of the next block to the end of the step
    f"            pending = {POST}\n"
    "        k_positions = all_positions[owner]\n"
    "        for qs in pieces(positions):\n"
    "            for ks in pieces(k_positions):\n"
    + SKIP
    + "                ring.count(positions[qs], k_positions[ks])\n"
    "                block = block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], positions[qs],\n"
    "                                        k_positions[ks])  # fmt: skip\n"
    "                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], *block)\n"
    "        if step < ring.size - 1:\n"
    "            kv = pending.wait()\n"
    "    # END SOLUTION\n"
    "    return out, lse"
)
ONE_BLOCK_FORWARD = (  # one masked block per step: the whole chunks, skipped only when entirely in the future
    f"            pending = {POST}\n"
    "        k_positions = all_positions[owner]\n"
    "        if k_positions.min() <= positions.max():\n"
    "            ring.count(positions, k_positions)\n"
    "            out, lse = merge(out, lse, *block_attention(q, kv[0], kv[1], positions, k_positions))\n"
    "        if step < ring.size - 1:\n"
    "            kv = pending.wait()\n"
    "    # END SOLUTION\n"
    "    return out, lse"
)
TWO_MESSAGES_FORWARD = FORWARD_STEP.replace(
    f"            pending = {POST}\n",
    "            pending = [ring.start(kv[i], send_to=next_rank, receive_from=previous_rank) for i in range(2)]\n",
).replace("            kv = pending.wait()\n", "            kv = torch.stack([p.wait() for p in pending])\n")
BACKWARD_BLOCKS = (  # TODO 5, the blocks of one step
    "        for qs in pieces(positions):\n"
    "            for ks in pieces(k_positions):\n"
    "                if k_positions[ks][0] > positions[qs][-1]:\n"
    "                    continue\n"
    "                ring.count(positions[qs], k_positions[ks])\n"
    "                d_q_piece, d_k_piece, d_v_piece = block_attention_backward(\n"
    "                    q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], out[..., qs, :], d_out[..., qs, :],\n"
    "                    lse[..., qs], positions[qs], k_positions[ks],\n"
    "                )  # fmt: skip\n"
    "                d_q[..., qs, :] += d_q_piece\n"
    "                d_kv[0][..., ks, :] += d_k_piece\n"
    "                d_kv[1][..., ks, :] += d_v_piece\n"
)
ONE_BLOCK_BACKWARD = (
    "        if k_positions.min() <= positions.max():\n"
    "            ring.count(positions, k_positions)\n"
    "            d_q_block, d_k_block, d_v_block = block_attention_backward(\n"
    "                q, kv[0], kv[1], out, d_out, lse, positions, k_positions\n"
    "            )\n"
    "            d_q += d_q_block\n"
    "            d_kv[0] += d_k_block\n"
    "            d_kv[1] += d_v_block\n"
)
GRADIENT_HOP = (  # TODO 5: the asynchronous gradient hop, to the end of the step and the final wait
    "        if travelling is not None:\n"
    "            d_kv += travelling.wait()  # the earlier ranks' shares, sent while this rank computed\n"
    "        travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)\n"
    "        if step < ring.size - 1:\n"
    "            kv = pending.wait()\n"
    "    d_kv = travelling.wait()  # this rank's own block, back from its last visit: every rank's share\n"
)
D_KV = "        d_kv = torch.zeros_like(kv)  # this rank's share of the held block's gradient\n"
BACKWARD_STEP = (  # TODO 5, from the post of the next block to the end
    f"            pending = {POST}\n"
    + D_KV
    + "        k_positions = all_positions[owner]\n"
    + BACKWARD_BLOCKS
    + GRADIENT_HOP
)
SYNCHRONOUS_HOP = (  # the gradient of the held block summed in one buffer, passed on and waited for at once
    "        if step < ring.size - 1:\n"
    "            kv = pending.wait()\n"
    "        d_kv = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank).wait()\n"
)
LSE = "    lse = torch.logsumexp(scores, dim=-1)\n"
MASK = '    scores = scores.masked_fill(hidden, float("-inf"))\n'
ORDERED = "q[..., order, :], k[..., order, :], v[..., order, :], is_causal=True"

# TODO 9's solution, line by line (the lab's hop)
POST_SEND = (
    "    sending = dist.isend(block, dst=(rank + 1) % world_size)  # posted, not waited for: on to the receive\n"
)
RECEIVE = "    dist.recv(received, src=(rank - 1) % world_size)\n"
HOP = POST_SEND + RECEIVE + "    sending.wait()\n"
NEXT, PREVIOUS = "(rank + 1) % world_size", "(rank - 1) % world_size"

MUTANTS = [
    # TODO 1: the split of the sequence
    Mutant(todo=1, what="zigzag pairs chunk r with chunk N - 1 - r (of 2N): both chunks from the first half",
           find="mirror = 2 * world_size - 1 - rank", replace="mirror = world_size - 1 - rank",
           shows=("place 3 is 0, want 3", "back from the middle")),
    Mutant(todo=1, what="zigzag chunks of T / N tokens instead of T / 2N",
           find="size = seq_len // (2 * world_size)", replace="size = seq_len // world_size",
           shows=("12 places, want 6", "twice the zigzag chunk")),
    Mutant(todo=1, what="contiguous: every rank numbers its chunk from 0 (local places, not the sequence's)",
           find="        return torch.arange(rank * size, (rank + 1) * size)\n",
           replace="        return torch.arange(size)\n",
           shows=("rank 1, place 0 is 0, want 6", "numbered from 0")),
    Mutant(todo=1, what="zigzag pairs chunk r with chunk N + r (a shift, not the mirror): still unbalanced",
           find="mirror = 2 * world_size - 1 - rank", replace="mirror = world_size + rank",
           shows=("place 3 is 6, want 9", "a shift, not the mirror")),
    # TODO 2: one block's attention with its log-sum-exp
    Mutant(todo=2, what="masks by the places inside the block instead of the global positions",
           find="hidden = k_positions[None, :] > q_positions[:, None]",
           replace="hidden = torch.arange(k.shape[-2])[None, :] > torch.arange(q.shape[-2])[:, None]",
           shows=('place 20', 'places inside the block')),
    Mutant(todo=2, what="forgets the 1 / sqrt(d) scaling of the scores",
           find="scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])",
           replace="scores = q @ k.transpose(-2, -1)",
           shows=('want', 'not scaled by 1 / sqrt(d)')),
    Mutant(todo=2, what="the running maximum taken for the log-sum-exp (the softmax is never normalised)",
           find="lse = torch.logsumexp(scores, dim=-1)", replace="lse = scores.amax(dim=-1)",
           shows=('want', 'largest score')),
    Mutant(todo=2, what="hides the query's own position too (>= instead of >)",
           find="hidden = k_positions[None, :] > q_positions[:, None]",
           replace="hidden = k_positions[None, :] >= q_positions[:, None]",
           shows=('place 8', "query's own place")),
    Mutant(todo=2, what="the log-sum-exp taken before the mask (over every key of the block, later ones too)",
           find=MASK + LSE, replace=LSE + MASK,
           shows=('place 8', 'counts the hidden keys')),
    Mutant(todo=2, what="log(sum(exp(scores))) written out: overflows for large scores (and float16's tens)",
           find=LSE, replace="    lse = scores.exp().sum(dim=-1).log()\n",
           shows=('scores in the hundreds', 'overflow float32')),
    Mutant(todo=2, what="hides later keys with -1e4 instead of -inf: wrong for a row that sees nothing or scores lower",
           find=MASK, replace="    scores = scores.masked_fill(hidden, -1e4)\n",
           shows=('place 0', 'finite score, not -inf')),
    Mutant(todo=2, what="exp(scores - lse) without the guard: a query that sees no key of the block gets nan",
           find="return torch.exp(scores - shift[..., None]) @ v, lse",
           replace="return torch.exp(scores - lse[..., None]) @ v, lse",
           shows=('is nan, want 0', 'log-sum-exp is -inf')),
    # TODO 3: merging a block into the running output
    Mutant(todo=3, what="forgets to rescale the running output",
           find="out = out * torch.exp(lse - shift)[..., None] + block_out",
           replace="out = out + block_out",
           shows=('place 5', 'running output is not rescaled')),
    Mutant(todo=3, what="keeps the running maximum instead of the log-sum-exp",
           find="new_lse = torch.logaddexp(lse, block_lse)", replace="new_lse = torch.maximum(lse, block_lse)",
           shows=('place 5', 'the larger of the two')),
    Mutant(todo=3, what="log(exp + exp) written out: overflows to inf for scores in the hundreds",
           find="new_lse = torch.logaddexp(lse, block_lse)",
           replace="new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))",
           shows=('scores x 400', 'overflow before the sum')),
    Mutant(todo=3, what="returns the old log-sum-exp: the next block is weighed against a stale normaliser",
           find="    return out, new_lse\n", replace="    return out, lse\n",
           shows=('place 0', 'old log-sum-exp is returned')),
    Mutant(todo=3, what="no guard: a query that has seen no key in either gets exp(-inf - -inf) = nan",
           find="out = out * torch.exp(lse - shift)[..., None] + block_out * torch.exp(block_lse - shift)[..., None]",
           replace="out = out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)"
           "[..., None]",
           shows=('got [nan', 'both log-sum-exps are -inf')),
    # TODO 4: the ring forward
    Mutant(todo=4, what="sends to rank - 1 while receiving from rank - 1 (the ring never closes)",
           find=FORWARD_STEP,
           replace=FORWARD_STEP.replace(f"pending = {POST}", "pending = ring.start(kv, send_to=previous_rank, "
                                        "receive_from=previous_rank)", 1),
           shows=('rank 0 waited', 'sends to the rank it receives from')),
    Mutant(todo=4, what="takes the block it holds at step s for rank + s's (the ring turns the other way)",
           find=f"        owner = (ring.rank - step) % ring.size\n        if step < ring.size - 1:\n"
                f"            pending = {POST}\n        k_positions",
           replace=f"        owner = (ring.rank + step) % ring.size\n        if step < ring.size - 1:\n"
                   f"            pending = {POST}\n        k_positions",
           shows=('rank 1', 'place 2', 'taken for rank r + s')),
    Mutant(todo=4, what="computes the blocks entirely in the future too (no causal skip)",
           find=SKIP, replace="",
           shows=('places [4, 5, 6, 7]', 'all come after its queries')),
    Mutant(todo=4, what="no overlap: computes, then posts the exchange and waits for it at once",
           find=FORWARD_STEP,
           replace=FORWARD_STEP.replace(f"            pending = {POST}\n", "            pass\n")
           .replace("kv = pending.wait()", f"kv = {POST}.wait()"),
           shows=('no block computed since it was posted',)),
    Mutant(todo=4, what="forwards its own keys and values at every hop, not the block it holds",
           find=FORWARD_STEP, replace=FORWARD_STEP.replace(f"pending = {POST}", f"pending = {POST}".replace(
               "ring.start(kv,", "ring.start(torch.stack([k, v]),")),
           shows=('place 10', 'own keys and values')),
    Mutant(todo=4, what="skips a block when its first key is not before the last query (>=): loses the diagonal",
           find=SKIP, replace=SKIP.replace("> positions[qs][-1]", ">= positions[qs][-1]"),
           shows=('place 0', 'it holds the diagonal')),
    Mutant(todo=4, what="never calls ring.count: the work per rank is not recorded",
           find="                ring.count(positions[qs], k_positions[ks])\n                block = block_attention(",
           replace="                block = block_attention(",
           shows=('counted 0 blocks',)),
    # TODO 5: the ring backward
    Mutant(todo=5, what="the keys' and values' gradients never travel: each rank keeps the last block's share",
           find=GRADIENT_HOP,
           replace="        if step < ring.size - 1:\n            kv = pending.wait()\n",
           shows=("keys' gradient", 'key at place 0', 'never travel')),
    Mutant(todo=5, what="the gradients travel the other way round the ring from their blocks",
           find="        travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)\n",
           replace="        travelling = ring.start(d_kv, send_to=previous_rank, receive_from=next_rank)\n",
           shows=("keys' gradient", 'rank 0', 'other way round')),
    Mutant(todo=5, what="no last hop: each rank ends with its neighbour's gradients, not its own",
           find="    d_kv = travelling.wait()  # this rank's own block",
           replace="    d_kv = d_kv + 0 * travelling.wait()  # this rank's own block",
           shows=("keys' gradient", 'want', 'no last hop')),
    Mutant(todo=5, what="waits for the previous rank's share of the held block but does not add it",
           find="            d_kv += travelling.wait()", replace="            travelling.wait()",
           shows=("keys' gradient", "only the previous rank's share comes home")),
    Mutant(todo=5, what="one gradient buffer for every step: the held block's gradient carries the previous block's",
           find="        d_kv = torch.zeros_like(kv)  # this rank's share of the held block's gradient\n",
           replace="        d_kv = torch.zeros_like(kv) if step == 0 else d_kv.clone()\n",
           shows=("keys' gradient", "starts from the previous block's")),
    Mutant(todo=5, what="each block's query gradient overwrites the previous ones instead of adding",
           find="d_q[..., qs, :] += d_q_piece", replace="d_q[..., qs, :] = d_q_piece",
           shows=("queries' gradient", 'place 4', "replaces the previous blocks'")),
    Mutant(todo=5, what="each block's key gradient overwrites what the other query piece added",
           find="d_kv[0][..., ks, :] += d_k_piece", replace="d_kv[0][..., ks, :] = d_k_piece",
           shows=("keys' gradient", "only the last query piece's share")),
    Mutant(todo=5, what="skips a block when its first key is not before the last query (>=): loses the diagonal",
           find="                if k_positions[ks][0] > positions[qs][-1]:\n                    continue\n",
           replace="                if k_positions[ks][0] >= positions[qs][-1]:\n                    continue\n",
           shows=("queries' gradient", 'place 3', 'it holds the diagonal')),
    # TODO 6: the sequence split becomes a head split
    Mutant(todo=6, what="cuts the batch axis instead of moving the head groups first (block j is not rank j's)",
           find="blocks = x.reshape(batch, world_size, heads // world_size, tokens, head_dim).transpose(0, 1)",
           replace="blocks = x.reshape(world_size, batch, heads // world_size, tokens, head_dim)",
           shows=('rank 0', 'batch 1, head 0, token 0', 'cut from the batch axis')),
    Mutant(todo=6, what="deals the heads round-robin (head h to rank h mod N) instead of in groups",
           find="blocks = x.reshape(batch, world_size, heads // world_size, tokens, head_dim).transpose(0, 1)",
           replace="blocks = x.reshape(batch, heads // world_size, world_size, tokens, head_dim)"
                   ".permute(2, 0, 1, 3, 4)",
           shows=('rank 0', 'head 1, token 0', 'dealt round-robin')),
    Mutant(todo=6, what="merges the received tokens token by token, not rank by rank (interleaves the ranks)",
           find="return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * tokens, ",
           replace="return received.permute(1, 2, 3, 0, 4).reshape(batch, heads // world_size, world_size * tokens, ",
           shows=('rank 0', 'token 1', 'interleaved token by token')),
    # TODO 7: the head split becomes the sequence split again
    Mutant(todo=7, what="sends its tokens back cut token by token (round-robin), not in the ranks' chunks",
           find="blocks = y.reshape(batch, heads, world_size, tokens // world_size, head_dim).permute(2, 0, 1, 3, 4)",
           replace="blocks = y.reshape(batch, heads, tokens // world_size, world_size, head_dim)"
                   ".permute(3, 0, 1, 2, 4)",
           shows=('rank 0', 'token 1', 'cut round-robin')),
    Mutant(todo=7, what="merges the received heads head by head, not rank by rank (interleaves the ranks' heads)",
           find="return received.transpose(0, 1).reshape(batch, world_size * heads, tokens // world_size, head_dim)",
           replace="return received.permute(1, 2, 0, 3, 4).reshape(batch, world_size * heads, tokens // world_size, "
                   "head_dim)",
           shows=('rank 0', 'head 1, token 0', 'interleaved head by head')),
    # TODO 8: Ulysses attention
    Mutant(todo=8, what="causal attention on the tokens in rank order (right for contiguous, wrong for zigzag)",
           find=ORDERED, replace="q, k, v, is_causal=True",
           shows=('rank 0', 'place 6', 'in rank order, not in sequence order')),
    Mutant(todo=8, what="forgets to put the output back in rank order",
           find="heads_to_sequence(out[..., torch.argsort(order), :], world_size, all_to_all)",
           replace="heads_to_sequence(out, world_size, all_to_all)",
           shows=('rank 0', 'place 6', 'not put back in rank order')),
    Mutant(todo=8, what="puts the output back with the same permutation instead of its inverse",
           find="heads_to_sequence(out[..., torch.argsort(order), :], world_size, all_to_all)",
           replace="heads_to_sequence(out[..., order, :], world_size, all_to_all)",
           shows=('rank 0', 'place 6', 'same permutation, not its inverse')),
    Mutant(todo=8, what="no causal mask: every token sees the whole sequence",
           find=ORDERED, replace=ORDERED.replace("is_causal=True", "is_causal=False"),
           shows=('rank 0', 'place 0', 'no causal mask')),
    Mutant(todo=8, what="indexes the gathered tokens by their places (the inverse permutation) instead of sorting them",
           find="    order = torch.argsort(torch.cat(all_positions))  # the gathered",
           replace="    order = torch.cat(all_positions)  # the gathered",
           shows=('rank 0', 'place 6', 'indexed by their places')),
    # more mistakes, by TODO
    Mutant(todo=2, what="the mask broadcast the wrong way round (keys as rows, queries as columns)",
           find="hidden = k_positions[None, :] > q_positions[:, None]",
           replace="hidden = k_positions[:, None] > q_positions[None, :]",
           shows=('raised', 'tensor a (5) must match the size of tensor b (7)')),
    Mutant(todo=2, what="the log-sum-exp taken over the queries (dim=-2) instead of the keys",
           find=LSE, replace="    lse = torch.logsumexp(scores, dim=-2)\n",
           shows=('raised', 'tensor a (5) must match the size of tensor b (7)')),
    Mutant(todo=3, what="each part weighted by the other's share of the normaliser",
           find="out = out * torch.exp(lse - shift)[..., None] + block_out * torch.exp(block_lse - shift)[..., None]",
           replace="out = out * torch.exp(block_lse - shift)[..., None] + block_out * torch.exp(lse - shift)"
                   "[..., None]",
           shows=('place 0', "the other part's share")),
    Mutant(todo=4, what="posts the exchange and waits for it at once, then computes: nothing travels meanwhile",
           find=FORWARD_STEP,
           replace=FORWARD_STEP.replace(f"            pending = {POST}\n",
                                        f"            pending = {POST}\n            arrived = pending.wait()\n")
           .replace("            kv = pending.wait()\n", "            kv = arrived\n"),
           shows=('no block computed since it was posted',)),
    Mutant(todo=4, what="posts an exchange at the last step too: N hops of keys and values instead of N - 1",
           find="        if step < ring.size - 1:\n" + FORWARD_STEP,
           replace=f"        pending = {POST}\n"
                   + FORWARD_STEP.split("\n", 1)[1].replace("        if step < ring.size - 1:\n            kv = "
                                                              "pending.wait()\n", "        kv = pending.wait()\n"),
           shows=('sent 8192 bytes', 'the last step sends a block')),
    Mutant(todo=5, what="posts the held block's gradient before adding the earlier ranks' shares to it",
           find="        if travelling is not None:\n"
                "            d_kv += travelling.wait()  # the earlier ranks' shares, sent while this rank computed\n"
                "        travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)\n",
           replace="        sent = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)\n"
                   "        if travelling is not None:\n"
                   "            d_kv = d_kv + travelling.wait()\n"
                   "        travelling = sent\n",
           shows=("keys' gradient", "only the previous rank's share comes home")),
    Mutant(todo=5, what="adds the gradient coming home to the share of the last block it held",
           find="    d_kv = travelling.wait()  # this rank's own block",
           replace="    d_kv += travelling.wait()  # this rank's own block",
           shows=("keys' gradient", "added to the last held block's")),
    # TODO 9: the lab, one hop of the ring by hand
    Mutant(todo=9, what="every rank sends first (a blocking send), then receives",
           find=HOP, replace=f"    dist.send(block, dst={NEXT})\n" + RECEIVE,
           shows=("every rank waits in send for a rank that is itself waiting in send",)),
    Mutant(todo=9, what="the send made non-blocking, but posted after the blocking receive",
           find=HOP, replace=RECEIVE + f"    sending = dist.isend(block, dst={NEXT})\n    sending.wait()\n",
           shows=("every rank waits in recv for a rank that is itself waiting in recv",)),
    Mutant(todo=9, what="receives from the rank it sends to (rank + 1)",
           find=RECEIVE, replace=f"    dist.recv(received, src={NEXT})\n",
           shows=("waits for a block from rank 1, which sent its own to rank 2",)),
    Mutant(todo=9, what="a batch_isend_irecv whose send and receive both name rank + 1",
           find=HOP,
           replace=f"    ops = [dist.P2POp(dist.isend, block, {NEXT}), dist.P2POp(dist.irecv, received, {NEXT})]\n"
                   "    for work in dist.batch_isend_irecv(ops):\n"
                   "        work.wait()\n",
           shows=("which sent its own to rank",)),
    Mutant(todo=9, what="the ring turned the other way: sends to rank - 1, receives from rank + 1",
           find=POST_SEND + RECEIVE,
           replace=f"    sending = dist.isend(block, dst={PREVIOUS})\n    dist.recv(received, src={NEXT})\n",
           shows=("the blocks go round the ring the other way", "where the forward folds rank r - s")),
    Mutant(todo=9, what="returns the block it sent, not the one it received",
           find="    sending.wait()\n    return received\n", replace="    sending.wait()\n    return block\n",
           shows=("returned the block it was given",)),
]  # fmt: skip

OWN_SHARE_AT_HOME = (  # TODO 5 with N - 1 gradient hops: the owner keeps its share, the others' come to it
    "        if step == 0:\n"
    "            own = d_kv  # this rank's share of its own block stays home\n"
    "        else:\n"
    "            if travelling is not None:\n"
    "                d_kv += travelling.wait()\n"
    "            travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)\n"
    "        if step < ring.size - 1:\n"
    "            kv = pending.wait()\n"
    "    d_kv = own if travelling is None else own + travelling.wait()\n"
)
SPLIT = (  # TODO 1, from the contiguous chunk to the end
    "        size = seq_len // world_size\n"
    "        return torch.arange(rank * size, (rank + 1) * size)\n"
    "    size = seq_len // (2 * world_size)\n"
    "    mirror = 2 * world_size - 1 - rank\n"
    "    return torch.cat([torch.arange(rank * size, (rank + 1) * size), "
    "torch.arange(mirror * size, (mirror + 1) * size)])\n"
)
TO_SEQUENCE = (  # TODO 7
    "    blocks = y.reshape(batch, heads, world_size, tokens // world_size, head_dim).permute(2, 0, 1, 3, 4)\n"
    "    received = all_to_all(blocks)\n"
    "    return received.transpose(0, 1).reshape(batch, world_size * heads, tokens // world_size, head_dim)\n"
)
MERGE_SHARES = (
    '    shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # nothing seen yet: both shares exp(-inf) = 0\n'
    "    out = out * torch.exp(lse - shift)[..., None] + block_out * torch.exp(block_lse - shift)[..., None]\n"
)
INVERSE = "    return heads_to_sequence(out[..., torch.argsort(order), :], world_size, all_to_all)\n"

VARIANTS = [  # correct answers, written another way: every TODO's check must pass them
    Mutant(todo=1, what="the places cut with tensor_split (contiguous) and chunk (zigzag)",
           find=SPLIT,
           replace="        return torch.arange(seq_len).tensor_split(world_size)[rank]\n"
                   "    chunks = torch.arange(seq_len).chunk(2 * world_size)\n"
                   "    return torch.cat([chunks[rank], chunks[-1 - rank]])\n"),
    Mutant(todo=3, what="the two shares as a softmax over the two log-sum-exps",
           find=MERGE_SHARES,
           replace="    shares = torch.softmax(torch.stack([lse, block_lse]), dim=0).nan_to_num(0.0)[..., None]\n"
                   "    out = out * shares[0] + block_out * shares[1]\n"),
    Mutant(todo=4, what="a pair skipped when its earliest key is after its latest query (min / max)",
           find=SKIP, replace=SKIP.replace("k_positions[ks][0] > positions[qs][-1]",
                                           "k_positions[ks].min() > positions[qs].max()")),
    Mutant(todo=5, what="N - 1 gradient hops: each rank keeps its own block's share at home (no last hop)",
           find=GRADIENT_HOP, replace=OWN_SHARE_AT_HOME),
    Mutant(todo=7, what="the tokens cut with chunk and stacked, the heads joined with cat",
           find=TO_SEQUENCE,
           replace="    received = all_to_all(torch.stack(y.chunk(world_size, dim=2)))\n"
                   "    return torch.cat(received.unbind(0), dim=1)\n"),
    Mutant(todo=8, what="the inverse permutation written by scattering positions instead of a second argsort",
           find=INVERSE,
           replace="    inverse = torch.empty_like(order)\n"
                   "    inverse[order] = torch.arange(len(order), device=order.device)\n"
                   "    return heads_to_sequence(out[..., inverse, :], world_size, all_to_all)\n"),
    Mutant(todo=2, what="the softmax itself, its nan (a row that sees nothing) made 0",
           find="    shift = lse.masked_fill(lse == float(\"-inf\"), 0.0)  # a row that sees no key: every weight "
                "exp(-inf) = 0\n    return torch.exp(scores - shift[..., None]) @ v, lse\n",
           replace="    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v, lse\n"),
    Mutant(todo=2, what="the log-sum-exp written out around each row's maximum",
           find=LSE + "    shift = lse.masked_fill(lse == float(\"-inf\"), 0.0)",
           replace="    top = scores.amax(dim=-1).clamp(min=torch.finfo(scores.dtype).min)\n"
                   "    lse = top + torch.exp(scores - top[..., None]).sum(dim=-1).log()\n"
                   "    shift = torch.where(torch.isinf(lse), 0.0, lse)"),
    Mutant(todo=3, what="the running output moved towards the block's by the block's share (a sigmoid)",
           find="    shift = new_lse.masked_fill(new_lse == float(\"-inf\"), 0.0)  # nothing seen yet: both shares "
                "exp(-inf) = 0\n    out = out * torch.exp(lse - shift)[..., None] + block_out * torch.exp(block_lse "
                "- shift)[..., None]\n",
           replace="    share = torch.sigmoid(block_lse - lse).nan_to_num(0.0)[..., None]  # nan: neither saw a key\n"
                   "    out = out + share * (block_out - out)\n"),
    Mutant(todo=4, what="keys and values as two messages a hop",
           find=FORWARD_STEP, replace=TWO_MESSAGES_FORWARD),
    Mutant(todo=4, what="one masked block per step (the whole chunks) instead of 2 x 2 pieces",
           find=FORWARD_STEP, replace=ONE_BLOCK_FORWARD),
    Mutant(todo=5, what="the gradient hop waited for at once (synchronous), the held block's gradient in one buffer",
           find=BACKWARD_STEP,
           replace=BACKWARD_STEP.replace(D_KV, "        d_kv = torch.zeros_like(kv) if step == 0 else d_kv\n")
           .replace(GRADIENT_HOP, SYNCHRONOUS_HOP)),
    Mutant(todo=5, what="one masked block per step (the whole chunks) instead of 2 x 2 pieces",
           find=BACKWARD_BLOCKS, replace=ONE_BLOCK_BACKWARD),
    Mutant(todo=5, what="keys and values as two messages a hop",
           find=BACKWARD_STEP,
           replace=BACKWARD_STEP.replace(
               f"            pending = {POST}\n",
               "            pending = [ring.start(kv[i], send_to=next_rank, receive_from=previous_rank)"
               " for i in range(2)]\n",
           ).replace("            kv = pending.wait()\n",
                     "            kv = torch.stack([p.wait() for p in pending])\n")),
    Mutant(todo=6, what="the head groups cut with chunk and stacked, the tokens joined with cat",
           find="    blocks = x.reshape(batch, world_size, heads // world_size, tokens, head_dim).transpose(0, 1)\n"
                "    received = all_to_all(blocks)\n"
                "    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * tokens, "
                "head_dim)\n",
           replace="    received = all_to_all(torch.stack(x.chunk(world_size, dim=1)))\n"
                   "    return torch.cat(received.unbind(0), dim=2)\n"),
    Mutant(todo=8, what="a mask from the places instead of putting the tokens in order",
           find="    order = torch.argsort(torch.cat(all_positions))  # the gathered tokens, rank by rank -> sequence "
                "order\n    out = F.scaled_dot_product_attention(" + ORDERED + ")\n"
                "    return heads_to_sequence(out[..., torch.argsort(order), :], world_size, all_to_all)\n",
           replace="    places = torch.cat(all_positions)\n"
                   "    seen = places[None, :] <= places[:, None]\n"
                   "    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)\n"
                   "    return heads_to_sequence(out, world_size, all_to_all)\n"),
    Mutant(todo=8, what="TODO 2's block_attention on the gathered tokens, masked by their places",
           find="    order = torch.argsort(torch.cat(all_positions))  # the gathered tokens, rank by rank -> sequence "
                "order\n    out = F.scaled_dot_product_attention(" + ORDERED + ")\n" + INVERSE,
           replace="    places = torch.cat(all_positions)\n"
                   "    out, _ = block_attention(q, k, v, places, places)\n"
                   "    return heads_to_sequence(out, world_size, all_to_all)\n"),
    Mutant(todo=1, what="zigzag's two chunks picked from a [2N, T/2N] view of the places",
           find="    mirror = 2 * world_size - 1 - rank\n"
                "    return torch.cat([torch.arange(rank * size, (rank + 1) * size), "
                "torch.arange(mirror * size, (mirror + 1) * size)])\n",
           replace="    chunks = torch.arange(seq_len).view(2 * world_size, size)\n"
                   "    return chunks[[rank, 2 * world_size - 1 - rank]].flatten()\n"),
    Mutant(todo=4, what="the key pieces in the outer loop, the query pieces inside",
           find="        for qs in pieces(positions):\n            for ks in pieces(k_positions):\n" + SKIP,
           replace="        for ks in pieces(k_positions):\n            for qs in pieces(positions):\n" + SKIP),
    Mutant(todo=6, what="the head groups split off with unflatten and moved first with movedim",
           find="    blocks = x.reshape(batch, world_size, heads // world_size, tokens, head_dim).transpose(0, 1)\n"
                "    received = all_to_all(blocks)\n"
                "    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * tokens, "
                "head_dim)\n",
           replace="    received = all_to_all(x.unflatten(1, (world_size, -1)).movedim(1, 0))\n"
                   "    return received.movedim(0, 2).flatten(2, 3)\n"),
    Mutant(todo=7, what="the tokens split off with unflatten and moved first with movedim",
           find=TO_SEQUENCE,
           replace="    received = all_to_all(y.unflatten(2, (world_size, -1)).movedim(2, 0))\n"
                   "    return received.movedim(0, 1).flatten(1, 2)\n"),
    # TODO 9: the lab
    Mutant(todo=9, what="the receive posted first (irecv), then a blocking send, then the wait",
           find=HOP,
           replace=f"    receiving = dist.irecv(received, src={PREVIOUS})\n    dist.send(block, dst={NEXT})\n"
                   "    receiving.wait()\n"),
    Mutant(todo=9, what="both posted at once with batch_isend_irecv, as Ring.start does",
           find=HOP,
           replace=f"    ops = [dist.P2POp(dist.isend, block, {NEXT}), dist.P2POp(dist.irecv, received, {PREVIOUS})]\n"
                   "    for work in dist.batch_isend_irecv(ops):\n"
                   "        work.wait()\n"),
    Mutant(todo=9, what="blocking calls, the symmetry broken: even ranks send first, odd ranks receive first",
           find=HOP,
           replace="    if rank % 2 == 0:\n"
                   f"        dist.send(block, dst={NEXT})\n        dist.recv(received, src={PREVIOUS})\n"
                   "    else:\n"
                   f"        dist.recv(received, src={PREVIOUS})\n        dist.send(block, dst={NEXT})\n"),
    Mutant(todo=9, what="the receive from any rank (no src): in a ring only the rank before sends to this one",
           find=RECEIVE, replace="    dist.recv(received)\n"),
    Mutant(todo=9, what="blocking calls, rank 0 sends first and every other rank receives first (a chain)",
           find=HOP,
           replace=f"    if rank == 0:\n        dist.send(block, dst={NEXT})\n"
                   f"    dist.recv(received, src={PREVIOUS})\n"
                   "    if rank != 0:\n"
                   f"        dist.send(block, dst={NEXT})\n"),
]  # fmt: skip
