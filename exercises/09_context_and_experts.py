# Exercise for lesson 09: complete the numbered TODOs. (This file is generated from
# solutions/09_context_and_experts.py by `python -m utils.make_exercises`; course maintainers edit the solution.)
"""Lesson 09: long sequences and mixture of experts. Context parallelism (ring attention) and expert parallelism.

Two more ways to split a Transformer's work across ranks, for what lessons 02-06 cannot split:

- Context parallelism (--parallel cp): one sequence too long for one rank's activations. Each rank holds a chunk
  of every sequence (its queries, keys and values); attention needs every key and value, so they travel around a
  ring of ranks while each rank accumulates its queries' attention block by block (the online softmax).
- Expert parallelism (--parallel ep): a mixture-of-experts MLP whose experts are split across ranks. A router
  picks each token's experts; an all-to-all sends the tokens to the ranks holding them and a second one brings
  the results back in order.

Every rank keeps a full copy of the parameters it does not split, so their gradients are averaged as in lesson 02.

    torchrun --nproc_per_node=2 solutions/09_context_and_experts.py --parallel cp --seq-len 64
    torchrun --nproc_per_node=4 solutions/09_context_and_experts.py --parallel ep --experts 4 --top-k 2
"""

import itertools
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import utils.experts as moe
from utils.collective_counter import CollectiveCounter
from utils.compat import configure_context_parallel
from utils.context_parallel import Ring, context_summary, gather, ring_metrics
from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, destroy_process_group, print0, run_main, save0, setup
from utils.experts import add_expert_options, check_experts
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
)

# --------------------------------------------------------------------------------------------------
# Part 1: context parallelism. TODOs 1-5.
# --------------------------------------------------------------------------------------------------
#
# N ranks split every sequence of the batch into pieces: each rank embeds, projects and predicts its own tokens
# only (the MLP, the norms and the head work token by token). Attention is the one place where a token needs the
# others: rank r's queries must see every earlier key and value. Ring attention passes the keys and values around
# a ring of ranks, N - 1 hops, while each rank folds every block it receives into its queries' running softmax.


def chunk_positions(seq_len: int, rank: int, world_size: int, split: str) -> torch.Tensor:
    """The places in the sequence (0 .. seq_len - 1) of the tokens rank `rank` holds, in increasing order."""
    # TODO 1: the split of the sequence. "contiguous": cut 0 .. seq_len - 1 into world_size equal chunks and keep
    #   chunk `rank`. "zigzag": cut it into 2 x world_size equal chunks and keep chunks `rank` and
    #   2 x world_size - 1 - rank (one from the start, its mirror from the end: under the causal mask, the later
    #   the chunk, the more keys its queries see, so each rank gets one cheap and one expensive chunk).
    raise NotImplementedError("TODO 1: the split of the sequence")


def check_context_split(seq_len: int, world_size: int, split: str):
    """Refuse a sequence that does not cut into equal chunks, in one line, before any rank waits for another."""
    pieces = world_size if split == "contiguous" else 2 * world_size
    if seq_len % pieces:
        fix = seq_len + pieces - seq_len % pieces
        per_rank = "1 chunk" if split == "contiguous" else "2 chunks"
        raise CourseError(
            f"--seq-len {seq_len} does not cut into {pieces} equal chunks (--cp-split {split}: {per_rank} per rank, "
            f"{world_size} ranks): use --seq-len {fix} (a multiple of {pieces}), or another number of ranks"
        )


def pieces(positions: torch.Tensor) -> list[slice]:
    """A rank's tokens as two pieces (its two chunks with zigzag, the two halves of its chunk when contiguous), as
    slices of `positions`: the unit of attention's work. A block of one piece's queries against a piece of keys is
    either entirely in the past (computed whole), on the diagonal (computed with the causal mask) or entirely in
    the future (skipped); pieces of equal size make the work of both splits comparable."""
    half = len(positions) // 2
    return [piece for piece in (slice(0, half), slice(half, len(positions))) if piece.stop > piece.start]


def block_attention(q, k, v, q_positions, k_positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q [..., n, d] on ONE block of keys and values k, v [..., m, d]: the block's
    output [..., n, d] (softmax over this block's keys only) and its log-sum-exp [..., n] (what the softmax
    divided by, as a log), which is all the next blocks need to correct it."""
    # TODO 2: one block's attention with its log-sum-exp. Scores q @ k^T / sqrt(d); a key is hidden from a query
    #   when it comes later in the sequence: compare GLOBAL positions (k_positions > q_positions, broadcast to
    #   [n, m]), not the places inside this block, and fill those scores with -inf. lse = logsumexp of the scores
    #   over the keys; the output is exp(scores - lse) @ v (the softmax, written with lse).
    raise NotImplementedError("TODO 2: one block's attention with its log-sum-exp")


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: fold one block's (output, log-sum-exp) into the running ones of the same queries.

    out is a softmax-weighted mean over the keys seen so far, normalised by exp(lse); block_out the same over the
    block's keys. Over both, the normaliser is exp(lse) + exp(block_lse), so each part is re-weighted by its share.
    The running state starts at out = 0, lse = -inf (no keys yet)."""
    # TODO 3: merging a block into the running output. new_lse = log(exp(lse) + exp(block_lse)), computed without
    #   overflow (torch.logaddexp subtracts the running maximum for you); then
    #   out = out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse) (the shares, as [..., n, 1]).
    #   Return (out, new_lse).
    raise NotImplementedError("TODO 3: merging a block into the running output")


def ring_attention_forward(q, k, v, positions, all_positions, ring: Ring):
    """Causal attention of this rank's queries q [B, H, n, d] on the whole sequence's keys and values, which the
    ranks hold in pieces: k, v are this rank's, all_positions[s] the places of rank s's tokens (positions is
    all_positions[ring.rank]). Returns (out [B, H, n, d], lse [B, H, n]), as one process's attention would give
    for these queries. `ring` (utils/context_parallel.py): ring.rank, ring.size; ring.start(tensor, send_to,
    receive_from) posts an isend/irecv pair and returns at once, .wait() on its result gives the received tensor;
    ring.count(queries, keys) records a computed block (the work per rank in the metrics)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])  # one message a hop: keys and values travel together
    # TODO 4: the ring forward. For step in range(ring.size), this rank holds the block of rank
    #   owner = (ring.rank - step) % ring.size (its own at step 0). Unless it is the last step, FIRST post the next
    #   exchange, pending = ring.start(kv, send_to=next rank, receive_from=previous rank) (ring order: r sends to
    #   r + 1 and receives from r - 1, modulo ring.size), so the transfer runs while this rank computes. Then, for
    #   each query piece qs in pieces(positions) and key piece ks in pieces(all_positions[owner]): skip the pair when
    #   its first key comes after its last query (entirely in the future: no work); else ring.count(its queries,
    #   its keys), block_attention on the pieces, and merge the result into out[..., qs, :] and lse[..., qs].
    #   Last, kv = pending.wait() (the next block) before the next step.
    raise NotImplementedError("TODO 4: the ring forward")
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
    the ring again, each block with the gradient it has collected so far (d_kv), until that gradient has visited
    every rank and comes home to the block's owner."""
    d_q = torch.zeros_like(q)
    kv = torch.stack([k, v])
    d_kv = torch.zeros_like(kv)  # the gradient of the block this rank holds now (not of its own block)
    # TODO 5: the ring backward. The same steps as TODO 4's ring: post the next kv exchange first (unless last
    #   step), and visit the same (query piece, key piece) pairs, skipping those in the future; for each,
    #   ring.count(...) and block_attention_backward(q piece, k piece, v piece, out piece, d_out piece, lse piece,
    #   positions piece, key positions piece) -> (d_q, d_k, d_v) pieces: ADD d_q into d_q[..., qs, :] (this rank's
    #   queries), d_k and d_v into d_kv[0] and d_kv[1] at [..., ks, :] (the visiting block's). After the step's
    #   blocks, kv = pending.wait() (unless last), then pass the block's gradient on along with it:
    #   d_kv = ring.start(d_kv, same direction).wait(). After ring.size hops, d_kv is the gradient of this rank's
    #   own keys and values, summed over every rank's queries.
    raise NotImplementedError("TODO 5: the ring backward")
    return d_q, d_kv[0], d_kv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as one autograd operation. Forward is TODO 4's ring; it saves only this rank's q, k, v, out
    and lse, and backward runs the ring again (TODO 5).

    Why not let autograd differentiate the ring: it would keep every block's score matrix and every block
    received from the other ranks (the whole sequence's keys and values, on every rank), which is the memory
    context parallelism is there to split; and the gradients of a block belong to the rank that owns it, which
    autograd on one process cannot send back."""

    @staticmethod
    def forward(ctx, q, k, v, positions, all_positions, ring):
        with ring.timed("forward"):  # its counts, seconds and timeline (utils/context_parallel.py)
            out, lse = ring_attention_forward(q, k, v, positions, all_positions, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.all_positions, ctx.ring = positions, all_positions, ring
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        with ctx.ring.timed("backward"):
            grads = ring_attention_backward(
                d_out.contiguous(), q, k, v, out, lse, ctx.positions, ctx.all_positions, ctx.ring
            )
        return *grads, None, None, None


class RingSelfAttention(nn.Module):
    """The course model's attention layer (the same projection modules, so the same parameters and names) with
    ring attention where it called F.scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, attention: nn.Module, positions, all_positions, ring: Ring):
        super().__init__()
        self.head_dim = attention.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        )  # fmt: skip
        self.positions, self.all_positions, self.ring = positions, all_positions, ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(projection):  # [B, n, H*hd] -> [B, H, n, hd]
            return projection.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = RingAttention.apply(q, k, v, self.positions, self.all_positions, self.ring)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


def average_cp_gradients(model: nn.Module):
    """Every rank holds the whole model and the gradient of its own tokens' loss: average them, as in lesson 02.
    (Each rank's loss is the mean over its B x T/N tokens, so the mean of the N losses is the global batch's.)"""
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in gradients])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
        gradient.copy_(average.view_as(gradient))


def builtin_context_parallel_step(model, inputs, targets, positions, mesh, split: str) -> torch.Tensor:
    """The built-in (GPU only): inside context_parallel(mesh), each rank keeps its share of the buffers (sharded
    in place along their sequence dimension) and every F.scaled_dot_product_attention becomes a ring attention over
    the mesh. Its zigzag is "load balancing" (head-tail chunks); the keys and values rotate by all-to-all."""
    from torch.distributed.tensor.experimental import context_parallel

    # Pass the blocks around the ring (not all-gathered at once), cut head-tail for zigzag (private switches).
    configure_context_parallel(load_balance=split == "zigzag", rotate_method="alltoall")
    buffers = [inputs, targets, positions]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
        loss = loss_fn(model(inputs, positions), targets)
        loss.backward()
    return loss


def add_context_options(parser):
    """--cp-split and any other option of context parallelism only."""
    parser.add_argument(
        "--cp-split", choices=("contiguous", "zigzag"), default="zigzag",
        help="how each sequence is cut over the ranks (zigzag balances the causal work)",
    )  # fmt: skip


def train_context_parallel(args, rank: int, world_size: int, device: torch.device):
    if args.impl == "builtin" and device.type != "cuda":
        raise CourseError(
            "--impl builtin --parallel cp needs a GPU: torch's context_parallel runs only the fused attention "
            "kernels (flash, efficient, cuDNN), which the CPU lacks (NotImplementedError); use --impl scratch"
        )
    check_context_split(args.seq_len, world_size, args.cp_split)
    all_positions = [chunk_positions(args.seq_len, r, world_size, args.cp_split).to(device) for r in range(world_size)]
    positions = all_positions[rank]
    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    ring = Ring(rank, world_size)
    if args.impl == "scratch":
        for block in model.blocks:
            block.attention = RingSelfAttention(block.attention, positions, all_positions, ring)
    else:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("cp",))
    optimizer = build_optimizer(model.parameters(), args)
    print0(
        f"{world_size} ranks, each with {len(positions)} of every sequence's {args.seq_len} tokens (--cp-split "
        f"{args.cp_split}: rank 0 holds places {context_summary(all_positions[0])}) | batch {args.batch_size} "
        f"| --impl {args.impl} | model: {count_parameters(config):,} parameters | device {device.type}"
    )

    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args)  # every rank reads the same sequences: the global batch is --batch-size
    generator = torch.Generator().manual_seed(args.seed)  # lesson 00's order of batches
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=generator)  # fmt: skip
    logger, throughput = Logger(args, total_steps=args.steps), Throughput(device)
    losses = []
    for step, (inputs, targets) in zip(
        range(1, args.steps + 1), (batch for _ in itertools.count() for batch in loader)
    ):
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        if args.impl == "scratch":
            loss = loss_fn(model(inputs[:, positions], positions), targets[:, positions])  # this rank's tokens
            loss.backward()
        else:
            whole = torch.arange(args.seq_len, device=device)
            loss = builtin_context_parallel_step(model, inputs, targets, whole, mesh, args.cp_split)
        average_cp_gradients(model)
        optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean over every token of the global batch
        losses.append(loss.item())
        throughput.step(inputs.numel())
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    if args.checkpoint:
        save0({"model": model.state_dict(), "config": vars(config)}, args.checkpoint)
        print0(f"saved the model to {args.checkpoint}")
    measured = ring_metrics(ring, RingAttention.apply, chunk_positions, args, device) if args.impl == "scratch" else {}
    held = gather(state_bytes(model, optimizer))
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=param_checksum(model),
        bytes_per_rank=held,
        global_batch=args.batch_size,
        seq_len=args.seq_len,
        parallel=args.parallel,
        impl=args.impl,
        cp_split=args.cp_split,
        optimizer=args.optimizer,
        dataset=args.dataset,
        positions=[p.tolist() for p in all_positions],
        **measured,
    )
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")


# --------------------------------------------------------------------------------------------------
# Part 2: expert parallelism. TODOs 6-10.
# --------------------------------------------------------------------------------------------------
#
# Every block's MLP becomes a mixture of E experts (each an MLP of the course model's shape) and a router (a linear
# layer, dim -> E logits) that sends each token to k of them. Rank r of N holds experts r E/N ... (r+1) E/N - 1 and
# a copy of everything else (the router included), which trains data-parallel on the rank's own batch. In each MoE
# layer, each rank: routes its tokens (TODO 6), drops the choices beyond an expert's capacity (TODO 7), sends each
# kept token to the rank of its expert (TODO 8: the counts first, then the tokens, in one all-to-all), runs its
# experts on what it received, and sends the results back, where each token sums them weighted by its gates
# (TODO 9). After backward, the copies' gradients are averaged and the experts' scaled (TODO 10).


@dataclass
class Routing:
    """The router's decisions for T tokens (one rank's), and the load-balancing loss they cost."""

    experts: torch.Tensor  # [T, k] each token's experts, most probable first
    gates: torch.Tensor  # [T, k] the weights of their outputs; each row sums to 1
    aux_loss: torch.Tensor  # E x sum_e f_e x P_e: 1 if the choices spread evenly, up to E / k if all pick the same k


def route(logits: torch.Tensor, k: int) -> Routing:
    """logits [T, E] (the router's output for T tokens) -> each token's top-k experts, their gates, the loss."""
    # TODO 6: the router: top-k experts, renormalised gates, and the load-balancing loss. Softmax over all E logits
    #   (probs [T, E]); each token's k most probable experts (probs.topk(k): values and indices, largest first); the
    #   gates are those k probabilities divided by their sum, so a token's output is a weighted mean of its experts'.
    #   The Switch Transformer's loss: f_e = the fraction of the T x k choices that picked expert e (a count: no
    #   gradient), P_e = expert e's probability averaged over the T tokens (the router's gradient comes through it);
    #   aux_loss = E x sum_e f_e x P_e.
    raise NotImplementedError("TODO 6: the router: top-k experts, renormalised gates, and the load-balancing loss")


def keep_within_capacity(experts: torch.Tensor, n_experts: int, capacity_factor: float) -> tuple[torch.Tensor, int]:
    """experts [T, k] -> (kept [T, k]: True for the choices within their expert's capacity, the capacity).

    Each rank decides for its own T tokens before any communication, so an expert may receive up to N x capacity
    rows in all. The choices are served in priority order: every token's first choice, then every token's second
    choice, ...; tokens in order. A dropped choice adds nothing to its token (which keeps its residual stream)."""
    # TODO 7: the capacity: each choice's place in its expert's queue, and which fit. capacity = ceil(C x T x k / E)
    #   (math.ceil) for this rank's T tokens. Read the choices in priority order, column by column
    #   (experts.t().flatten()); a choice's position in its expert's queue is how many choices before it picked the
    #   same expert: one-hot [T k, E] (F.one_hot), cumulative sum down the rows, minus 1, read at the choice's own
    #   expert (.gather). Kept where position < capacity; bring the mask back to [T, k].
    raise NotImplementedError("TODO 7: the capacity: each choice's place in its expert's queue, and which fit")


@dataclass
class Plan:
    """How the kept choices travelled in the dispatch, so that the combine can bring their results back."""

    order: torch.Tensor  # [S] the kept choices' indices into the flattened [T k] routing, in the order sent
    send_splits: list[int]  # rows sent to each rank (S in all)
    recv_splits: list[int]  # rows received from each rank
    recv_counts: torch.Tensor  # [N, E / N] rows received from each rank for each of this rank's experts


def dispatch(tokens, routing: Routing, kept, n_experts: int, exchange, group=None) -> tuple[torch.Tensor, Plan]:
    """Send each kept choice's token [D] to the rank holding its expert. Returns the rows this rank's experts
    must process, grouped by source rank and within each by expert (with the plan), as torch's all-to-all
    delivers them. `exchange(rows, output_splits, input_splits, group)` is the differentiable all-to-all."""
    world_size = dist.get_world_size(group)
    k = routing.experts.shape[1]
    # TODO 8: the counts exchange and the dispatch all-to-all (uneven splits). Sort the kept choices by expert:
    #   their flat indices (kept.flatten().nonzero()), reordered by a stable argsort of their experts (ties keep
    #   token order). counts [E] = kept choices per expert (torch.bincount, minlength=E). Expert e lives on rank
    #   e // (E / N): the rows sent to each rank are counts.view(N, E / N).sum(1). Nobody knows yet what it will
    #   receive: exchange the counts first, dist.all_to_all_single(received_counts, counts) (E / N numbers to each
    #   rank), which gives [N, E / N] = for each source rank, the rows for each of this rank's experts. Then send the
    #   tokens of the sorted choices (tokens[order // k]) with exchange(rows, recv_splits, send_splits, group).
    raise NotImplementedError("TODO 8: the counts exchange and the dispatch all-to-all (uneven splits)")


def run_experts(received: torch.Tensor, plan: Plan, experts: nn.ModuleDict, first_expert: int) -> torch.Tensor:
    """Each of this rank's experts on its rows, kept in the order they arrived (the way back is the same)."""
    per_rank = plan.recv_counts.shape[1]
    chunks = received.split(plan.recv_counts.flatten().tolist())  # source 0's rows for each expert, source 1's, ...
    return torch.cat([experts[str(first_expert + i % per_rank)](chunk) for i, chunk in enumerate(chunks)])


def combine(results, plan: Plan, routing: Routing, n_tokens: int, exchange, group=None) -> torch.Tensor:
    """The experts' results [R, D] back to the ranks that sent the rows -> this rank's MoE output [T, D]."""
    k = routing.experts.shape[1]
    # TODO 9: the combine: reverse all-to-all, original order, gate weighting. Send the results back the way the
    #   rows came: exchange(results, send_splits, recv_splits, group) (the dispatch's splits, swapped) returns them in
    #   the order this rank sent the rows (plan.order). Weight each by its choice's gate (the flattened gates, read
    #   at plan.order) and add it to its token's row, order // k, of a [T, D] output of zeros (index_add: a token with
    #   two kept choices gets both; a dropped choice adds nothing).
    raise NotImplementedError("TODO 9: the combine: reverse all-to-all, original order, gate weighting")


def synchronize_gradients(replicated: list, experts: list, group=None):
    """After backward: every rank holds its own loss's gradients (the mean over its tokens). The objective is the
    mean of the ranks' losses (the global batch's mean)."""
    world_size = dist.get_world_size(group)
    # TODO 10: the gradients of the replicated part and of the experts. The replicated parameters (embeddings,
    #   attention, norms, routers, head) have one gradient per rank: average them over the ranks, as in lesson 02
    #   (all-reduce, then divide by N; one flat buffer for all of them). An expert lives on one rank only, and its
    #   gradient there already sums what came back from every rank's tokens, each rank's loss a mean over its
    #   own tokens: that is N times the gradient of the global mean. Divide it by N; never all-reduce it (the
    #   other ranks' tensors at that place are other experts).
    raise NotImplementedError("TODO 10: the gradients of the replicated part and of the experts")


# The all-to-all with uneven splits, differentiable: from scratch, then torch's.


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single as an autograd function: the gradients take the way back (the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        output = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(output, rows.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx, gradient):
        output_splits, input_splits = ctx.splits
        back = gradient.new_empty((sum(input_splits), *gradient.shape[1:]))
        dist.all_to_all_single(back, gradient.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def exchange_scratch(rows, output_splits, input_splits, group=None):
    return AllToAll.apply(rows, output_splits, input_splits, group)


def exchange_builtin(rows, output_splits, input_splits, group=None):
    """torch.distributed.nn.functional.all_to_all_single: torch's autograd form of the same collective."""
    output = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    return distributed_autograd.all_to_all_single(output, rows.contiguous(), output_splits, input_splits, group=group)


EXCHANGES = {"scratch": exchange_scratch, "builtin": exchange_builtin}


class MoEMLP(nn.Module):
    """A block's MLP as a mixture of experts whose experts are split over the ranks of `group` (a drop-in for
    utils.model.MLP: [B, T, D] -> [B, T, D]). After each forward: aux_loss, and the counts the metrics record."""

    def __init__(self, router, experts: dict, n_experts: int, k: int, capacity_factor: float, exchange, group=None):
        super().__init__()
        self.router, self.experts = router, nn.ModuleDict({str(e): expert for e, expert in experts.items()})
        self.first_expert = min(experts)
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        self.exchange, self.group = exchange, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = route(self.router(tokens), self.k)
        kept, self.capacity = keep_within_capacity(routing.experts, self.n_experts, self.capacity_factor)
        received, plan = dispatch(tokens, routing, kept, self.n_experts, self.exchange, self.group)
        results = run_experts(received, plan, self.experts, self.first_expert)
        output = combine(results, plan, routing, tokens.shape[0], self.exchange, self.group)
        self.aux_loss = routing.aux_loss
        self.chosen = torch.bincount(routing.experts.flatten(), minlength=self.n_experts)  # before the capacity
        self.kept = torch.bincount(routing.experts[kept], minlength=self.n_experts)  # after it
        self.splits = (plan.send_splits, plan.recv_splits)  # rows to and from each rank
        return output.view(x.shape)


def build_moe_model(args, group=None):
    """The course model with every block's MLP an MoEMLP holding this rank's experts (utils/experts.py builds each
    expert from its own seed: the rank builds only its own, and one process would build the same)."""
    config, world_size, rank = model_config(args), dist.get_world_size(group), dist.get_rank(group)
    per_rank = args.experts // world_size
    model = build_model(config, seed=args.seed)
    for layer, block in enumerate(model.blocks):
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        experts = {e: moe.build_expert(config, args.seed, layer, e) for e in mine}
        router = moe.build_router(config, args.experts, args.seed, layer)
        block.mlp = MoEMLP(router, experts, args.experts, args.top_k, args.capacity_factor, EXCHANGES[args.impl], group)
    return model


def split_parameters(model) -> tuple[list, list]:
    """(replicated parameters, this rank's experts' parameters)."""
    named = list(model.named_parameters())
    return [p for n, p in named if ".experts." not in n], [p for n, p in named if ".experts." in n]


def train_expert_parallel(args, rank: int, world_size: int, device: torch.device):
    check_experts(args, world_size)
    model = build_moe_model(args).to(device)
    replicated, experts = split_parameters(model)
    optimizer = build_optimizer(model.parameters(), args)
    layers = list(model.blocks)
    print0(
        f"{world_size} ranks x {args.experts // world_size} experts of {args.experts} per layer | top-{args.top_k}, "
        f"capacity factor {args.capacity_factor}, aux-loss weight {args.aux_loss_weight} | --impl {args.impl} | "
        f"global batch {world_size} x {args.batch_size} sequences"
    )

    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, per_step=world_size, what="global batch")
    generator = torch.Generator().manual_seed(args.seed)  # lesson 00's order of batches, N x --batch-size each
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=world_size * args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    counter, record = CollectiveCounter(), moe.ExpertRecord(layers, args.experts)
    logger, throughput = Logger(args, total_steps=args.steps), Throughput(device)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # endless: epoch after epoch
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches):
        inputs, targets = inputs.chunk(world_size)[rank].to(device), targets.chunk(world_size)[rank].to(device)
        optimizer.zero_grad(set_to_none=True)
        with counter.phase("step") if step == 1 else nullcontext():  # the all-to-all bytes of one step
            loss = loss_fn(model(inputs), targets)
            aux = sum(block.mlp.aux_loss for block in layers)
            (loss + args.aux_loss_weight * aux).backward()
        synchronize_gradients(replicated, experts)
        optimizer.step()
        loss, aux = record.step(loss, aux)  # the means over the ranks, the choices and kept rows per expert
        throughput.step(world_size * inputs.numel())
        logger.log(step, loss=loss, aux_loss=aux, tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {loss:.4f}  aux {aux:.4f}  dropped {sum(record.dropped[-1])}")
    logger.close()

    full, checksum = moe.full_weights(model, device, keep=rank == 0)  # every rank's experts, gathered on rank 0
    if args.checkpoint:
        save0({"model": full, "config": vars(model_config(args))}, args.checkpoint)
        print0(f"saved the full model to {args.checkpoint}")
    all_to_all_bytes = counter.table().get("step", {}).get("all_to_all", [0, 0])[1]  # step 1's input bytes
    tokens = args.batch_size * args.seq_len  # per rank: the group of tokens each capacity is for
    write_metrics(
        args.metrics_out,
        final_loss=record.losses[-1],
        steps=len(record.losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum,
        bytes_per_rank=gather(state_bytes(model, optimizer)),
        parallel=args.parallel,
        impl=args.impl,
        experts=args.experts,
        experts_per_rank=args.experts // world_size,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        aux_loss_weight=args.aux_loss_weight,
        capacity=math.ceil(args.capacity_factor * tokens * args.top_k / args.experts),
        tokens_per_rank=tokens,
        optimizer=args.optimizer,
        dataset=args.dataset,
        **record.metrics(all_to_all_bytes),  # losses, expert choices and load, dropped, all-to-all rows and bytes
    )
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(record.losses)} steps, final loss {record.losses[-1]:.4f}")
    del optimizer, model


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is exact
    parser.add_argument("--parallel", choices=("cp", "ep"), default="cp", help="context or expert parallelism")
    parser.add_argument("--impl", choices=("scratch", "builtin"), default="scratch", help="from scratch or built in")
    options = {}  # each part's own options: given to the other part, they would be ignored, so they are refused
    for part, add_options in (("cp", add_context_options), ("ep", add_expert_options)):
        before = len(parser._actions)
        add_options(parser)
        options[part] = [action.option_strings[0] for action in parser._actions[before:]]
    args = parse_args(parser)
    other = "ep" if args.parallel == "cp" else "cp"
    given = {argument.split("=")[0] for argument in sys.argv[1:]}
    for option in options[other]:
        if option in given:
            parser.error(f"argument {option}: an option of --parallel {other}, not of --parallel {args.parallel}")
    _, rank, device, world_size = setup(args.seed)
    if args.parallel == "cp":
        train_context_parallel(args, rank, world_size, device)
    else:
        train_expert_parallel(args, rank, world_size, device)
    print0("done")
    dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
