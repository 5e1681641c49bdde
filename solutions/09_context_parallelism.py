"""Lesson 09: long sequences. Context parallelism, ring attention and Ulysses from scratch, then torch's built-in.

A sequence whose activations do not fit on one rank is cut over N ranks; each rank embeds, projects and predicts its
own tokens. Attention is the one place where a token needs the others, and there are two ways to bring them:
- ring attention (--impl ring): the keys and values travel around a ring of ranks while each rank folds every block
  it receives into its queries' running softmax; backward runs the ring again, each block's gradient one hop behind.
- Ulysses (--impl ulysses): an all-to-all turns the split of the sequence into a split of the heads, attention runs
  on whole sequences of H/N heads, and a second all-to-all turns it back.
Every rank holds the whole model: the parameters' gradients are averaged as in lesson 02.

    torchrun --nproc_per_node=4 solutions/09_context_parallelism.py --impl ring --cp-split zigzag
    torchrun --nproc_per_node=4 solutions/09_context_parallelism.py --impl ulysses
    torchrun --nproc_per_node=4 solutions/09_context_parallelism.py --impl builtin   # torch's, on GPUs
"""

import math
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from utils.collective_counter import CollectiveCounter
from utils.course.compat import configure_context_parallel
from utils.data import load_token_dataset
from utils.distributed_utils import destroy_process_group, print0, run_main, save0, setup
from utils.lesson_09.measure import per_rank, run_measurements
from utils.lesson_09.options import add_options, check_run
from utils.lesson_09.ring import Ring, context_summary
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    batches,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
)

# The split of the sequence, and one block of attention with the online softmax. TODOs 1-3.


def chunk_positions(seq_len: int, rank: int, world_size: int, split: str) -> torch.Tensor:
    """The places in the sequence (0 .. seq_len - 1) of the tokens rank `rank` holds, in increasing order."""
    # TODO 1: the split of the sequence. "contiguous": each rank keeps one of N equal chunks. "zigzag": two of 2N,
    #   one from each end, so that under the causal mask every rank gets the same work.
    # HINT 1: Under the causal mask, a query's work grows with its place in the sequence. Which two chunks of 2N add up
    #   to the same work for every rank?
    # HINT 2: Chunks of seq_len / N tokens (contiguous) or seq_len / 2N (zigzag). Contiguous: chunk number `rank`.
    #   Zigzag: chunk `rank` from the start and the chunk as far from the end, the two joined in increasing order.
    # HINT 3: "contiguous": cut 0 .. seq_len - 1 into world_size equal chunks and keep chunk `rank`. "zigzag": cut it
    #   into 2 x world_size equal chunks and keep chunks `rank` and 2 x world_size - 1 - rank (torch.arange for each,
    #   torch.cat to join them).
    # BEGIN SOLUTION
    if split == "contiguous":
        size = seq_len // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq_len // (2 * world_size)
    mirror = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * size, (rank + 1) * size), torch.arange(mirror * size, (mirror + 1) * size)])
    # END SOLUTION


def pieces(positions: torch.Tensor) -> list[slice]:
    """A rank's tokens as two pieces, slices of `positions` (its two chunks with zigzag, the two halves of its chunk
    when contiguous): the unit of the ring's work. A block of a piece of queries against a piece of keys is in the
    past (computed whole), on the diagonal (computed with the mask) or in the future (skipped)."""
    half = len(positions) // 2
    return [piece for piece in (slice(0, half), slice(half, len(positions))) if piece.stop > piece.start]


def block_attention(q, k, v, q_positions, k_positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q [..., n, d] on ONE block of keys and values k, v [..., m, d]: the block's
    output [..., n, d] (the softmax over this block's keys only) and its log-sum-exp [..., n] (the log of what that
    softmax divided by), all the next blocks need to correct it. A query that sees no key of the block gets the
    output 0 and the log-sum-exp -inf: it has seen nothing yet."""
    # TODO 2: one block's attention with its log-sum-exp. The block's causal attention alone and the log of its
    #   softmax's normaliser, the mask comparing places in the whole sequence, computed without overflow; seeing no key
    #   gives 0 and -inf.
    # HINT 1: What must a later block know to correct this one's softmax? And which keys does a query see, when its
    #   block holds places from anywhere in the sequence?
    # HINT 2: Scale the scores by 1 / sqrt(d); hide every key whose place is after the query's; take the log-sum-exp
    #   of each row in a form that never overflows; weight the values by exp(scores - lse). Guard the rows that see
    #   no key: -inf - -inf is nan.
    # HINT 3: Scores q @ k^T / sqrt(d); hidden = k_positions > q_positions (broadcast to [n, m]) gets -inf;
    #   lse = torch.logsumexp of the scores over the keys; the output is exp(scores - lse) @ v, subtracting 0 where
    #   lse = -inf (exp(-inf) = 0 then gives the output 0).
    # BEGIN SOLUTION
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    hidden = k_positions[None, :] > q_positions[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = lse.masked_fill(lse == float("-inf"), 0.0)  # a row that sees no key: every weight exp(-inf) = 0
    return torch.exp(scores - shift[..., None]) @ v, lse
    # END SOLUTION


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: fold one block's (output, log-sum-exp) into the running ones of the same queries.

    out is a softmax-weighted mean over the keys merged so far, normalised by exp(lse); block_out the same over the
    block's keys. Over both, the normaliser is exp(lse) + exp(block_lse), so each part is re-weighted by its share.
    The running state starts at out = 0, lse = -inf (no keys yet), and a query that has seen no key in either
    stays there."""
    # TODO 3: merging a block into the running output. The output and log-sum-exp of both parts together: each
    #   part weighs its normaliser's share of their sum, without overflow; a query that saw nothing stays at 0, -inf.
    # HINT 1: out is normalised by exp(lse), block_out by exp(block_lse). Over both, what is the normaliser, and what
    #   fraction of it does each part bring?
    # HINT 2: The new log-sum-exp is the log of the sum of the two exponentials (torch has it without overflow).
    #   Re-weight out and block_out by exp(their lse - the new one), broadcast over the last axis, and add them.
    #   Where the new one is -inf, subtract 0 instead, as in TODO 2.
    # HINT 3: new_lse = torch.logaddexp of the two; out = out * exp(lse - new_lse)[..., None] + block_out *
    #   exp(block_lse - new_lse)[..., None], with new_lse replaced by 0 where it is -inf. Return (out, new_lse).
    # BEGIN SOLUTION
    new_lse = torch.logaddexp(lse, block_lse)
    shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # nothing seen yet: both shares exp(-inf) = 0
    out = out * torch.exp(lse - shift)[..., None] + block_out * torch.exp(block_lse - shift)[..., None]
    return out, new_lse
    # END SOLUTION


# Ring attention, forward and backward. TODOs 4-5.


def ring_attention_forward(q, k, v, positions, all_positions, ring: Ring):
    """Causal attention of this rank's queries q [B, H, n, d] on the whole sequence's keys and values, which the
    ranks hold in pieces: k, v are this rank's, all_positions[s] the places of rank s's tokens (positions is
    all_positions[ring.rank]). Returns (out [B, H, n, d], lse [B, H, n]), what one process's attention gives for
    these queries. `ring` (utils/lesson_09/ring.py): ring.rank, ring.size; ring.start(tensor, send_to,
    receive_from) posts an isend/irecv pair and returns at once, .wait() on its result gives the received tensor;
    ring.count(q_positions, k_positions) records a block about to be computed (the work per rank)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])  # one message a hop: keys and values travel together
    next_rank, previous_rank = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    # TODO 4: the ring forward. Pass the blocks of keys and values round the ring (ring.start, then .wait), folding
    #   each into the queries' running softmax; post each exchange before computing, so that it travels meanwhile.
    #   ring.count every block computed.
    # HINT 1: At step s, whose block does this rank hold? Which pairs of a query piece and a key piece have nothing to
    #   compute under the causal mask? What can travel while this rank computes?
    # HINT 2: N steps; the block held at step s is rank (r - s)'s. Each step: post the exchange of the block held
    #   (to r + 1, from r - 1) unless it is the last step; for each piece of queries and of the owner's keys, skip the
    #   pair if its first key is after its last query, else count it, compute it (TODO 2) and merge it (TODO 3) into
    #   out and lse at the queries' piece; then wait for the next block.
    # HINT 3: For step in range(ring.size): owner = (ring.rank - step) % ring.size; unless last, FIRST
    #   pending = ring.start(kv, send_to=next_rank, receive_from=previous_rank). Then, with k_positions =
    #   all_positions[owner], for qs in pieces(positions), ks in pieces(k_positions): continue when
    #   k_positions[ks][0] > positions[qs][-1]; else ring.count(the pieces' positions), block_attention on the pieces,
    #   merge into out[..., qs, :], lse[..., qs]. At the end of the step, unless last, kv = pending.wait().
    # BEGIN SOLUTION
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        if step < ring.size - 1:
            pending = ring.start(kv, send_to=next_rank, receive_from=previous_rank)
        k_positions = all_positions[owner]
        for qs in pieces(positions):
            for ks in pieces(k_positions):
                if k_positions[ks][0] > positions[qs][-1]:
                    continue  # every key of this piece comes after every query: nothing to see
                ring.count(positions[qs], k_positions[ks])
                block = block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], positions[qs],
                                        k_positions[ks])  # fmt: skip
                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], *block)
        if step < ring.size - 1:
            kv = pending.wait()
    # END SOLUTION
    return out, lse


def block_attention_backward(q, k, v, out, d_out, lse, q_positions, k_positions):
    """What one block contributes to the gradients of q, k and v, given the FINAL out and lse of the queries
    (after every block was merged): exp(scores - lse) is then the block's share of the true softmax, and
    delta = sum(d_out * out) is the softmax's correction term, the same for every block."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    probabilities = torch.exp(scores - lse[..., None])
    d_v = probabilities.transpose(-2, -1) @ d_out
    delta = (d_out * out).sum(dim=-1, keepdim=True)
    d_scores = probabilities * (d_out @ v.transpose(-2, -1) - delta)
    return d_scores @ k * scale, d_scores.transpose(-2, -1) @ q * scale, d_v


def ring_attention_backward(d_out, q, k, v, out, lse, positions, all_positions, ring: Ring):
    """The gradients of this rank's q, k, v, given d_out (the gradient of its output). The keys and values travel
    the ring again; each block's gradient (dK, dV) follows it one hop behind, each rank adding its queries' share,
    until it has visited every rank and comes home to the block's owner."""
    kv = torch.stack([k, v])
    d_q, d_kv = torch.zeros_like(q), torch.zeros_like(kv)  # d_kv: a held block's gradient; at the end, this rank's
    next_rank, previous_rank = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    # TODO 5: the ring backward and its gradient hop. This rank's q, k, v gradients: blocks travel as in TODO 4;
    #   each block's gradient follows one hop behind, gathering every rank's share, and ends at its owner. Waited for
    #   later, a hop overlaps the next block.
    # HINT 1: Each rank computes only its queries' share of a block's gradient. How does the sum of every rank's share
    #   reach the block's owner, and can it travel while the next block is computed?
    # HINT 2: The same steps and skipped pairs as TODO 4, each block giving block_attention_backward's pieces: add the
    #   queries' into d_q and the keys' and values' into a fresh gradient of the held block. From step 1 on, add the
    #   sum the previous rank sent for the same block (wait for it only now), then post the sum to the next rank. At
    #   the end, the last gradient received is this rank's own (or keep its own share home: one hop fewer).
    # HINT 3: Each step, after TODO 4's owner and pending = ring.start(kv, ...): d_kv = zeros like kv; for each pair,
    #   block_attention_backward(its q, k, v, out, d_out, lse, positions) -> add into d_q[..., qs, :],
    #   d_kv[0][..., ks, :], d_kv[1][..., ks, :]. If a gradient is travelling: d_kv += travelling.wait(). Then
    #   travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank); unless last,
    #   kv = pending.wait(). After the loop: d_kv = travelling.wait().
    # BEGIN SOLUTION
    travelling = None  # the gradient hop in flight: the previous step's, posted and not yet waited for
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        if step < ring.size - 1:
            pending = ring.start(kv, send_to=next_rank, receive_from=previous_rank)
        d_kv = torch.zeros_like(kv)  # this rank's share of the held block's gradient
        k_positions = all_positions[owner]
        for qs in pieces(positions):
            for ks in pieces(k_positions):
                if k_positions[ks][0] > positions[qs][-1]:
                    continue
                ring.count(positions[qs], k_positions[ks])
                d_q_piece, d_k_piece, d_v_piece = block_attention_backward(
                    q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], out[..., qs, :], d_out[..., qs, :],
                    lse[..., qs], positions[qs], k_positions[ks],
                )  # fmt: skip
                d_q[..., qs, :] += d_q_piece
                d_kv[0][..., ks, :] += d_k_piece
                d_kv[1][..., ks, :] += d_v_piece
        if travelling is not None:
            d_kv += travelling.wait()  # the earlier ranks' shares, sent while this rank computed
        travelling = ring.start(d_kv, send_to=next_rank, receive_from=previous_rank)
        if step < ring.size - 1:
            kv = pending.wait()
    d_kv = travelling.wait()  # this rank's own block, back from its last visit: every rank's share
    # END SOLUTION
    return d_q, d_kv[0], d_kv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as one autograd operation: forward is TODO 4's ring; it saves only this rank's q, k, v, out
    and lse, and backward runs the ring again (TODO 5). Autograd through the ring would keep every block's scores
    and every block received (the whole sequence's keys and values on every rank: what CP is there to split), and
    could not send a block's gradient back to the rank that owns it."""

    @staticmethod
    def forward(ctx, q, k, v, positions, all_positions, ring):
        with ring.timed("forward"):  # its counts, seconds and timeline (utils/lesson_09/ring.py)
            out, lse = ring_attention_forward(q, k, v, positions, all_positions, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.all_positions, ctx.ring = positions, all_positions, ring
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        with ctx.ring.timed("backward"):
            grads = ring_attention_backward(d_out.contiguous(), q, k, v, out, lse, ctx.positions, ctx.all_positions,
                                            ctx.ring)  # fmt: skip
        return *grads, None, None, None


# Ulysses: two all-to-alls turn the sequence split into a head split and back. TODOs 6-8.


class AllToAll(torch.autograd.Function):
    """blocks [N, ...] -> [N, ...] over the ranks of `group`: block j goes to rank j, and block j of the result came
    from rank j (all_to_all_single, equal splits). Its gradient takes the same exchange: moving block j of rank i to
    block i of rank j is a permutation that is its own transpose."""

    @staticmethod
    def forward(ctx, blocks, group):
        ctx.group = group
        received = torch.empty_like(blocks, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, blocks.contiguous(), group=group)
        return received

    @staticmethod
    def backward(ctx, gradient):
        return AllToAll.forward(ctx, gradient, ctx.group), None


def sequence_to_heads(x: torch.Tensor, world_size: int, all_to_all) -> torch.Tensor:
    """[B, H, n, d]: this rank's n tokens of every head -> [B, H/N, N n, d]: every rank's tokens (rank 0's, then
    rank 1's, ...) of this rank's H/N heads (rank r's are heads r H/N to (r+1) H/N - 1). all_to_all(blocks [N, ...])
    sends block j to rank j and returns [N, ...], block j from rank j."""
    # TODO 6: the sequence split becomes a head split. Return every rank's tokens of this rank's heads, rank by rank:
    #   arrange the heads so that block j of one all_to_all is what rank j needs, then join what arrives.
    # HINT 1: Rank j will hold heads j H/N .. (j+1) H/N - 1 of every token. Which part of this rank's [B, H, n, d] must
    #   go to rank j, and along which axis do the received blocks line up?
    # HINT 2: Cut the head axis into N groups of H/N and make the group axis the first, [N, B, H/N, n, d]; exchange;
    #   block j that comes back is rank j's n tokens: join the blocks along the tokens, rank 0's first.
    # HINT 3: x.reshape(B, N, H/N, n, d).transpose(0, 1) -> all_to_all -> [N, B, H/N, n, d]; move the rank axis next
    #   to the tokens (permute(1, 2, 0, 3, 4)) and merge them: reshape to [B, H/N, N n, d].
    # BEGIN SOLUTION
    batch, heads, tokens, head_dim = x.shape
    blocks = x.reshape(batch, world_size, heads // world_size, tokens, head_dim).transpose(0, 1)
    received = all_to_all(blocks)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * tokens, head_dim)
    # END SOLUTION


def heads_to_sequence(y: torch.Tensor, world_size: int, all_to_all) -> torch.Tensor:
    """The way back: [B, H/N, N n, d], every rank's tokens of this rank's heads -> [B, H, n, d], this rank's tokens
    of every head (sequence_to_heads undone)."""
    # TODO 7: the head split becomes the sequence split again. Undo TODO 6: send each rank its own tokens of this
    #   rank's heads, and join what comes back head group by head group.
    # HINT 1: The N n tokens are every rank's, in rank order. Which of them belong to rank j, and where do rank j's
    #   heads go in this rank's [B, H, n, d]?
    # HINT 2: Cut the tokens into N chunks of n and make that axis the first, [N, B, H/N, n, d]; exchange; block j that
    #   comes back holds this rank's tokens of rank j's heads: join the blocks along the heads, rank 0's first.
    # HINT 3: y.reshape(B, H/N, N, n, d).permute(2, 0, 1, 3, 4) -> all_to_all -> [N, B, H/N, n, d]; then
    #   transpose(0, 1) and reshape to [B, H, n, d].
    # BEGIN SOLUTION
    batch, heads, tokens, head_dim = y.shape
    blocks = y.reshape(batch, heads, world_size, tokens // world_size, head_dim).permute(2, 0, 1, 3, 4)
    received = all_to_all(blocks)
    return received.transpose(0, 1).reshape(batch, world_size * heads, tokens // world_size, head_dim)
    # END SOLUTION


def ulysses_attention(q, k, v, all_positions, all_to_all) -> torch.Tensor:
    """Causal attention of this rank's tokens q, k, v [B, H, n, d] (at the places all_positions[rank]) on the whole
    sequence, by Ulysses: out [B, H, n, d], what one process's attention gives for them."""
    world_size = len(all_positions)
    # TODO 8: Ulysses attention. Causal attention for this rank's tokens, by attending over whole sequences of this
    #   rank's heads between TODOs 6 and 7. The tokens gathered arrive in rank order: with zigzag, not the sequence's.
    # HINT 1: After TODO 6 each rank holds every token of H/N heads, rank 0's tokens first. Where does each sit in the
    #   sequence, and what does the causal mask need?
    # HINT 2: Turn q, k and v into head splits. Either put the tokens in sequence order (sort by their places), run
    #   causal attention and undo the permutation, or keep rank order and build the mask from the places. Then back to
    #   this rank's tokens of every head.
    # HINT 3: order = torch.argsort(torch.cat(all_positions)); out = F.scaled_dot_product_attention(q[..., order, :],
    #   k[..., order, :], v[..., order, :], is_causal=True); return heads_to_sequence(out[..., torch.argsort(order), :],
    #   world_size, all_to_all).
    # BEGIN SOLUTION
    q, k, v = (sequence_to_heads(t, world_size, all_to_all) for t in (q, k, v))
    order = torch.argsort(torch.cat(all_positions))  # the gathered tokens, rank by rank -> sequence order
    out = F.scaled_dot_product_attention(q[..., order, :], k[..., order, :], v[..., order, :], is_causal=True)
    return heads_to_sequence(out[..., torch.argsort(order), :], world_size, all_to_all)
    # END SOLUTION


# The model, the built-in, and training


class ContextParallelAttention(nn.Module):
    """The course model's attention layer (the same projection modules, so the same parameters and names) with
    `attend(q, k, v)` (ring attention or Ulysses on this rank's tokens) where it called
    F.scaled_dot_product_attention(is_causal=True) on the whole sequence."""

    def __init__(self, attention: nn.Module, attend):
        super().__init__()
        self.head_dim, self.attend = attention.head_dim, attend
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(projection):  # [B, n, H*hd] -> [B, H, n, hd]
            return projection.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        out = self.attend(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


def builtin_step(model, inputs, targets, mesh, split: str) -> torch.Tensor:
    """torch's context_parallel (GPU only): inside it, each rank keeps its share of the buffers (cut in place along
    their sequence dimension, head-tail for zigzag) and every F.scaled_dot_product_attention becomes a ring
    attention over the mesh, the keys and values passed block by block."""
    from torch.distributed.tensor.experimental import context_parallel

    configure_context_parallel(load_balance=split == "zigzag", rotate_method="alltoall")
    positions = torch.arange(inputs.shape[1], device=inputs.device)
    buffers = [inputs, targets, positions]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
        loss = loss_fn(model(inputs, positions), targets)
        loss.backward()
    return loss


def average_gradients(model: nn.Module):
    """Every rank holds the whole model and the gradient of its own tokens' loss: average them, as in lesson 02.
    (Each rank's loss is the mean over its B x T/N tokens, so the mean of the N losses is the whole batch's.)"""
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in gradients])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
        gradient.copy_(average.view_as(gradient))


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is exact
    add_options(parser)  # --impl, --cp-split (utils/lesson_09/options.py)
    args = parse_args(parser)
    _, rank, device, world_size = setup(args.seed)
    check_run(args, world_size, device)  # one line for what cannot run (a split, the heads, the built-in on CPU)
    all_positions = [chunk_positions(args.seq_len, r, world_size, args.cp_split).to(device) for r in range(world_size)]
    positions = all_positions[rank]
    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    ring = Ring(rank, world_size)
    attend = {
        "ring": lambda q, k, v: RingAttention.apply(q, k, v, positions, all_positions, ring),
        "ulysses": lambda q, k, v: ulysses_attention(q, k, v, all_positions, lambda b: AllToAll.apply(b, None)),
    }
    if args.impl in attend:
        for block in model.blocks:
            block.attention = ContextParallelAttention(block.attention, attend[args.impl])
    else:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("cp",))
    optimizer = build_optimizer(model.parameters(), args)
    print0(
        f"{world_size} ranks, each with {len(positions)} of every sequence's {args.seq_len} tokens (--cp-split "
        f"{args.cp_split}: rank 0 holds places {context_summary(positions.cpu())}) | --impl {args.impl} | batch "
        f"{args.batch_size} | model: {count_parameters(config):,} parameters | device {device.type}"
    )

    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args)  # every rank reads the same sequences: the batch is --batch-size
    generator = torch.Generator().manual_seed(args.seed)  # lesson 00's order of batches
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=generator)  # fmt: skip
    logger, throughput, losses = Logger(args, total_steps=args.steps), Throughput(device), []
    counter = CollectiveCounter() if args.impl == "ulysses" else None  # the all-to-alls' bytes (slow: one step)
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches(loader)):  # epoch after epoch
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        with counter.phase("step") if counter and step == 1 else nullcontext():
            if args.impl == "builtin":
                loss = builtin_step(model, inputs, targets, mesh, args.cp_split)
            else:  # this rank's tokens of every sequence, at their places in it
                loss = loss_fn(model(inputs[:, positions], positions), targets[:, positions])
                loss.backward()
        average_gradients(model)
        optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean over every token of the batch
        losses.append(loss.item())
        throughput.step(args.batch_size * args.seq_len)  # (the built-in cuts `inputs` in place)
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    if args.checkpoint:
        save0({"model": model.state_dict(), "config": vars(config)}, args.checkpoint)
        print0(f"saved the model to {args.checkpoint}")
    measured = run_measurements(args, ring, counter, RingAttention.apply, chunk_positions, device)
    # measured: the ring's work, bytes, time, timeline and memory, or Ulysses' bytes (utils/lesson_09/measure.py)
    write_metrics(args.metrics_out, final_loss=losses[-1], losses=losses, steps=len(losses),
                  tokens_per_s=throughput.tokens_per_s, param_checksum=param_checksum(model),
                  bytes_per_rank=per_rank(state_bytes(model, optimizer)), batch_size=args.batch_size,
                  seq_len=args.seq_len, impl=args.impl, cp_split=args.cp_split, optimizer=args.optimizer,
                  dataset=args.dataset, positions=[p.tolist() for p in all_positions], **measured)  # fmt: skip
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    del optimizer, model
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: a ring step that never ends (TODO 9; the notebook's last section, `make check LESSON=09`)
# --------------------------------------------------------------------------------------------------


def pass_block(block: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """One hop of the ring written with torch.distributed's own send and receive calls (send, recv, isend, irecv),
    where Ring.start posts a batch_isend_irecv: `block`, the keys and values this rank holds, goes on round the ring,
    and the block that arrives is returned. ring_attention_forward folds rank (rank - s)'s block at step s: each
    block comes from the rank before. utils/lesson_09/lab.py runs the lesson's ring attention with this hop."""
    # TODO 9: lab, a ring step that never ends. With the exercise's hop, ring attention on three live ranks raises
    #   nothing for 5 s, then gloo's timeout on every rank. Fix it so that the step ends and every rank's attention
    #   equals one process's.
    # HINT 1: Take the call each rank waits in: which rank must act for it to complete, and what is that rank doing
    #   at that moment?
    # HINT 2: A blocking send or receive waits for its partner's matching call. Post the send without waiting for it
    #   (isend), then receive, then wait for the send; or break the symmetry (even ranks send first, odd ranks receive
    #   first). Each block goes to rank + 1 and comes from rank - 1, modulo the ranks.
    # HINT 3: received = torch.empty_like(block); sending = dist.isend(block, dst=(rank + 1) % world_size);
    #   dist.recv(received, src=(rank - 1) % world_size); sending.wait(); return received.
    # BEGIN SOLUTION
    received = torch.empty_like(block)
    sending = dist.isend(block, dst=(rank + 1) % world_size)  # posted, not waited for: on to the receive
    dist.recv(received, src=(rank - 1) % world_size)
    sending.wait()
    return received
    # EXERCISE
    # received = torch.empty_like(block)
    # dist.recv(received, src=(rank - 1) % world_size)  # the block from the rank before first,
    # dist.send(block, dst=(rank + 1) % world_size)  # then this rank's to the next
    # return received
    # END SOLUTION


if __name__ == "__main__":
    run_main(main)
