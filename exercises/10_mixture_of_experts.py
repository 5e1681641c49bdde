# Exercise for lesson 10: complete the numbered TODOs. (This file is generated from
# solutions/10_mixture_of_experts.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 10: mixture of experts, split over the ranks (expert parallelism).

A mixture-of-experts (MoE) block holds E MLPs (the experts) and a router that sends each token to k of them: the
model holds E times the MLP's parameters while a token costs about k MLPs. Expert parallelism (EP) puts different
experts on different ranks. Tokens live where their sequence is and experts where their weights are, so in every
MoE layer one all-to-all sends each token to the ranks of its experts and a second one brings the results back.

What travels, two ways (--dispatch):
- padded (GShard, Switch): an expert takes at most `capacity` tokens from each rank, the rest are dropped, and every
  buffer has the fixed shape [E, capacity, D]: the all-to-all's sizes are known before the step (static shapes).
- dropless (MegaBlocks, Megatron-Core): every choice travels; the ranks first exchange how many rows each sends
  (uneven splits), and a rank whose experts are popular receives more rows than the others.

Every rank keeps a copy of everything else (attention, norms, embeddings, routers, head), trained data-parallel.

    torchrun --nproc_per_node=4 exercises/10_mixture_of_experts.py --experts 8 --top-k 2
    torchrun --nproc_per_node=4 exercises/10_mixture_of_experts.py --experts 8 --dispatch padded --capacity-factor 1
"""

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
from torch.nn.utils.rnn import pad_sequence

from utils.collective_counter import CollectiveCounter
from utils.data import load_token_dataset
from utils.distributed_utils import destroy_process_group, print0, run_main, save0, setup
from utils.lesson_10.options import add_expert_options, check_experts, check_options
from utils.lesson_10.record import ExpertRecord, full_weights, timed
from utils.lesson_10.reference import EXPERT_WEIGHTS, build_experts, build_router
from utils.metrics import state_bytes, write_metrics
from utils.model import build_model, loss_fn
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

# Rank r of N holds experts r E/N ... (r+1) E/N - 1 of every MoE layer. In each layer, each rank routes its own
# tokens (TODO 1); with --dispatch padded it keeps each expert's first `capacity` choices (TODO 2) and sends fixed
# buffers, with dropless it sends every choice, the counts first (TODO 3); its experts run on what arrived, and the
# results come back to their tokens, weighted by the gates (TODO 4). After backward: the gradients (TODO 5).


@dataclass
class Routing:
    """The router's decisions for T tokens (one rank's), and the load-balancing loss they cost."""

    experts: torch.Tensor  # [T, k] each token's experts, most probable first
    gates: torch.Tensor  # [T, k] the weights of their outputs
    aux_loss: torch.Tensor  # E x sum_e f_e x P_e (see route)


def route(logits: torch.Tensor, k: int) -> Routing:
    """logits [T, E] (the router's output for T tokens) -> each token's top-k experts, their gates, the loss."""
    # TODO 1: the router: top-k experts, their gates, and the load-balancing loss. Each token's k most probable
    #   experts; gates that let the task teach the router, at k = 1 too; Switch's loss, its gradient through the
    #   probabilities only.
    raise NotImplementedError("TODO 1: the router: top-k experts, their gates, and the load-balancing loss")


def keep_within_capacity(experts: torch.Tensor, n_experts: int, capacity_factor: float):
    """experts [T, k] -> (kept [T, k], slots [T, k], capacity). A choice's slot is its place in its expert's queue
    (any other order of an expert's kept choices in its buffer would do as well); it is kept when slot < capacity.
    Served in priority order: every token's first choice, then every token's second, ...; tokens in order. Each rank
    decides for its own T tokens, before any communication."""
    # TODO 2: the capacity and each choice's place in its expert's queue. Which choices fit, their slots, and the
    #   capacity for this rank's tokens; an expert's queue serves every token's first choice before any second, tokens
    #   in order.
    raise NotImplementedError("TODO 2: the capacity and each choice's place in its expert's queue")


def dispatch_padded(tokens, routing: Routing, kept, slots, capacity: int, n_experts: int, exchange, group=None):
    """GShard's static shapes: each kept choice's token goes to its slot of its expert's buffer [E, capacity, D]
    (zeros where no token came), and one all-to-all with equal splits gives each rank its experts' buffers from
    every rank. Returns [E/N, N x capacity, D]: for each of this rank's experts, rank 0's slots, rank 1's, ..."""
    world_size, dim = dist.get_world_size(group), tokens.shape[1]
    token = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(routing.experts)
    buffer = tokens.new_zeros(n_experts, capacity, dim).index_put((routing.experts[kept], slots[kept]),
                                                                  tokens[token[kept]])  # fmt: skip
    splits = [n_experts // world_size * capacity] * world_size  # the same every step: no counts to exchange
    received = exchange(buffer.view(-1, dim), splits, splits, group)
    return received.view(world_size, n_experts // world_size, capacity, dim).transpose(0, 1).flatten(1, 2)


def combine_padded(results, routing: Routing, kept, slots, capacity: int, n_experts: int, exchange, group=None):
    """The experts' results [E/N, N x capacity, D] back to their ranks (the same equal splits), and each kept
    choice's result, weighted by its gate, added to its token -> [T, D]. The empty slots' results are never read."""
    world_size, dim = dist.get_world_size(group), results.shape[-1]
    back = results.view(n_experts // world_size, world_size, capacity, dim).transpose(0, 1).reshape(-1, dim)
    splits = [n_experts // world_size * capacity] * world_size
    back = exchange(back, splits, splits, group).view(n_experts, capacity, dim)
    token = torch.arange(routing.experts.shape[0], device=results.device)[:, None].expand_as(routing.experts)
    weighted = back[routing.experts[kept], slots[kept]] * routing.gates[kept][:, None]
    return weighted.new_zeros(routing.experts.shape[0], dim).index_add(0, token[kept], weighted)


@dataclass
class Plan:
    """How the choices travelled in the dropless dispatch, so that the combine can bring their results back."""

    order: torch.Tensor  # [T k] the choices' indices into the flattened [T, k] routing, in the order sent
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    recv_counts: torch.Tensor  # [N, E/N] rows received from each rank for each of this rank's experts


def dispatch(tokens, routing: Routing, n_experts: int, exchange, group=None) -> tuple[torch.Tensor, Plan]:
    """Dropless: send every choice's token [D] to the rank holding its expert. Returns the rows this rank's experts
    must process, grouped by source rank and within each by expert, as torch's all-to-all delivers them (with the
    plan). `exchange(rows, output_splits, input_splits, group)` is the differentiable all-to-all."""
    world_size, k = dist.get_world_size(group), routing.experts.shape[1]
    # TODO 3: the counts, then the rows (uneven splits). Send each choice's token to the rank holding its expert, each
    #   rank's rows contiguous; no rank knows what it will receive until the ranks exchange counts
    #   (dist.all_to_all_single).
    raise NotImplementedError("TODO 3: the counts, then the rows (uneven splits)")


def combine(results, plan: Plan, routing: Routing, n_tokens: int, exchange, group=None) -> torch.Tensor:
    """Dropless: the experts' results [R, D] back to the ranks that sent the rows -> this rank's output [T, D]."""
    k = routing.experts.shape[1]
    # TODO 4: the way back. This rank's output [T, D]: the results return by the reverse exchange, and each token gets
    #   the gate-weighted sum of its choices' results (a token with k choices gets k).
    raise NotImplementedError("TODO 4: the way back")


class Experts(nn.Module):
    """n experts (each an MLP of the course model's shape: up, GELU, down) with their weights stacked, [n, D, H] and
    [n, H, D]: x [n, R, D] (R rows for each expert) -> [n, R, D], every expert at once in two batched matmuls."""

    def __init__(self, weights: dict):
        super().__init__()
        for name in EXPERT_WEIGHTS:
            setattr(self, name, nn.Parameter(weights[name]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.baddbmm(self.up_bias[:, None], x, self.up_weight))
        return torch.baddbmm(self.down_bias[:, None], hidden, self.down_weight)


def run_experts(received: torch.Tensor, plan: Plan, experts: Experts) -> torch.Tensor:
    """Dropless: this rank's experts on the rows received, in the order they arrived. One batched matmul instead of
    one small matmul per (source rank, expert): the rows are grouped by expert and padded to the busiest one here
    (a grouped GEMM, as in MegaBlocks or Megatron-Core, runs the uneven groups without the padding)."""
    sources, local = plan.recv_counts.shape
    expert = torch.arange(local, device=received.device).repeat(sources).repeat_interleave(plan.recv_counts.flatten())
    grouped = torch.argsort(expert, stable=True)  # expert 0's rows from every source, then expert 1's, ...
    per_expert = plan.recv_counts.sum(0)
    batch = pad_sequence(received[grouped].split(per_expert.tolist()), batch_first=True)  # [E/N, busiest, D]
    filled = torch.arange(batch.shape[1], device=received.device) < per_expert[:, None]
    return experts(batch)[filled][torch.argsort(grouped)]


def synchronize_gradients(replicated: list, experts: list, group=None):
    """After backward: every rank holds its own loss's gradients (the mean over its tokens). The objective is the
    mean of the ranks' losses (the global batch's mean)."""
    world_size = dist.get_world_size(group)
    # TODO 5: the gradients. Make every gradient that of the global batch's mean loss: a replicated parameter's differs
    #   per rank (lesson 02); an expert's already sums every rank's tokens. Never all-reduce an expert's.
    raise NotImplementedError("TODO 5: the gradients")


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
    utils.model.MLP: [B, T, D] -> [B, T, D]). After each forward, what utils/lesson_10/record.py records."""

    def __init__(self, router, experts: Experts, n_experts: int, k: int, capacity_factor, exchange, group=None):
        super().__init__()
        self.router, self.experts, self.n_experts, self.k = router, experts, n_experts, k
        self.capacity_factor, self.exchange, self.group = capacity_factor, exchange, group  # factor None: dropless
        self.seconds = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing, exchange, group = route(self.router(tokens), self.k), self.exchange, self.group
        if self.capacity_factor is not None:
            kept, slots, capacity = keep_within_capacity(routing.experts, self.n_experts, self.capacity_factor)
            received = dispatch_padded(tokens, routing, kept, slots, capacity, self.n_experts, exchange, group)
            with timed(self.seconds, "experts", x.device):
                results = self.experts(received)
            with timed(self.seconds, "combine", x.device):
                output = combine_padded(results, routing, kept, slots, capacity, self.n_experts, exchange, group)
            world_size = dist.get_world_size(group)
            self.sent = self.received = [self.n_experts // world_size * capacity] * world_size  # padding included
        else:
            kept = torch.ones_like(routing.experts, dtype=torch.bool)
            received, plan = dispatch(tokens, routing, self.n_experts, exchange, group)
            with timed(self.seconds, "experts", x.device):
                results = run_experts(received, plan, self.experts)
            with timed(self.seconds, "combine", x.device):
                output = combine(results, plan, routing, tokens.shape[0], exchange, group)
            self.sent, self.received = plan.send_splits, plan.recv_splits
        self.aux_loss = routing.aux_loss
        self.chosen = torch.bincount(routing.experts.flatten(), minlength=self.n_experts)  # before the capacity
        self.kept = torch.bincount(routing.experts[kept], minlength=self.n_experts)  # after it
        return output.view(x.shape)


def build_moe_model(args, group=None):
    """The course model with every block's MLP an MoEMLP holding this rank's experts (utils/lesson_10 builds each
    expert from its own seed: the rank builds only its own, and one process would build the same)."""
    config, world_size, rank = model_config(args), dist.get_world_size(group), dist.get_rank(group)
    mine = range(rank * args.experts // world_size, (rank + 1) * args.experts // world_size)
    factor = args.capacity_factor if args.dispatch == "padded" else None
    model = build_model(config, seed=args.seed)
    for layer, block in enumerate(model.blocks):
        experts = Experts(build_experts(config, args.seed, layer, mine))
        router = build_router(config, args.experts, args.seed, layer)
        block.mlp = MoEMLP(router, experts, args.experts, args.top_k, factor, EXCHANGES[args.impl], group)
    return model


def split_parameters(model) -> tuple[list, list]:
    """(replicated parameters, this rank's experts' parameters)."""
    named = list(model.named_parameters())
    return [p for n, p in named if ".experts." not in n], [p for n, p in named if ".experts." in n]


def train(args, rank: int, world_size: int, device: torch.device):
    check_experts(args, world_size)
    model = build_moe_model(args).to(device)
    replicated, experts = split_parameters(model)
    optimizer = build_optimizer(model.parameters(), args)
    layers = list(model.blocks)
    capacity = f"capacity factor {args.capacity_factor}" if args.dispatch == "padded" else "every choice kept"
    print0(
        f"{world_size} ranks x {args.experts // world_size} experts of {args.experts} per layer | top-{args.top_k} | "
        f"--dispatch {args.dispatch} ({capacity}) | aux-loss weight {args.aux_loss_weight} | --impl {args.impl} | "
        f"global batch {world_size} x {args.batch_size} sequences"
    )

    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, per_step=world_size, what="global batch")
    generator = torch.Generator().manual_seed(args.seed)  # lesson 00's order of batches, N x --batch-size each
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=world_size * args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    counter, record = CollectiveCounter(), ExpertRecord(layers, args.experts)
    logger, throughput = Logger(args, total_steps=args.steps), Throughput(device)
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches(loader)):  # epoch after epoch
        inputs, targets = inputs.chunk(world_size)[rank].to(device), targets.chunk(world_size)[rank].to(device)
        optimizer.zero_grad(set_to_none=True)
        with counter.phase("step") if step == 1 else nullcontext():  # the all-to-all bytes of one step
            loss = loss_fn(model(inputs), targets)
            (loss + args.aux_loss_weight * sum(block.mlp.aux_loss for block in layers)).backward()
        synchronize_gradients(replicated, experts)
        optimizer.step()
        loss, aux = record.step(loss)  # means over the ranks; choices and kept rows per expert
        throughput.step(world_size * inputs.numel())
        logger.log(step, loss=loss, **{f"aux_loss/layer{i}": a for i, a in enumerate(aux)},
                   tokens_per_s=throughput.tokens_per_s)  # fmt: skip
        if step % args.log_every == 0 or step == args.steps:
            print0(record.line(step))
    logger.close()

    full, checksum = full_weights(model, device, keep=rank == 0)  # every rank's experts, gathered on rank 0
    if args.checkpoint:
        save0({"model": full, "config": vars(model_config(args))}, args.checkpoint)
        print0(f"saved the full model to {args.checkpoint}")
    tokens = args.batch_size * args.seq_len  # per rank: the group of tokens each capacity is for
    bytes_per_rank = [None] * world_size
    dist.all_gather_object(bytes_per_rank, state_bytes(model, optimizer))
    write_metrics(
        args.metrics_out,
        final_loss=record.losses[-1],
        steps=len(record.losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum,
        bytes_per_rank=bytes_per_rank,
        **{
            name: getattr(args, name)
            for name in (
                "impl",
                "experts",
                "top_k",
                "dispatch",
                "capacity_factor",
                "aux_loss_weight",
                "optimizer",
                "dataset",
            )
        },  # fmt: skip
        experts_per_rank=args.experts // world_size,
        capacity=math.ceil(args.capacity_factor * tokens * args.top_k / args.experts) if args.capacity_factor else None,
        tokens_per_rank=tokens,
        **record.metrics(counter.table().get("step", {}).get("all_to_all", [0, 0])[1]),  # step 1's input bytes
    )
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(record.losses)} steps, final loss {record.losses[-1]:.4f}")
    del optimizer, model


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is exact
    add_expert_options(parser)
    args = parse_args(parser)
    check_options(parser, args)
    _, rank, device, world_size = setup(args.seed)
    train(args, rank, world_size, device)
    print0("done")
    dist.barrier()
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: padded buffers that do not match (TODO 6; the notebook's last section, `make check LESSON=10`)
# --------------------------------------------------------------------------------------------------


def shared_capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float, group=None, device="cpu") -> int:
    """The capacity (slots per expert) of the padded dispatch on this rank, which holds `n_tokens` tokens: in production
    the ranks of `group` often hold different numbers (batches packed to a token budget, an epoch's last batch, padding
    removed). Every rank calls this at the same point. `device`: this rank's device (setup()'s: a GPU under NCCL, the
    CPU under gloo). utils/lesson_10/lab.py runs it on three live ranks whose token counts differ."""
    # TODO 6: lab, padded buffers that do not match. Three live ranks hold different token counts; in the padded
    #   all-to-all gloo would abort one ("Received data size doesn't match expected size"), so the lab stops before
    #   it. Make every rank's output equal one process's.
    return math.ceil(capacity_factor * n_tokens * k / n_experts)  # as in TODO 2


if __name__ == "__main__":
    run_main(main)
