"""Lesson 05's plumbing: what the pipeline script needs besides the technique itself.

- `check_stages`, `refuse_layout`: refuse a layout that cannot run, in one line, before any rank waits;
- `summarise`, `report`: the run's metrics from every rank's records, and the lines rank 0 prints;
- `schedule_order`, `simulate_order`, `simulate_per_block`: a built-in schedule's own order of F, I, W and B on
  every rank, and its bubble on an ideal machine (the notebook's zero-bubble section);
- `forward_flops_per_token`, `cost_aware_partition`, `stage_costs`: stages balanced in compute, not in blocks
  (the notebook's last section).
"""

from fractions import Fraction

import torch
import torch.distributed as dist

from utils.distributed_utils import Refusal, print0
from utils.lesson_05.timing import measured_bubble


def check_stages(n_layers: int, n_stages: int):
    """Every stage needs at least one block."""
    if n_stages > n_layers:
        raise Refusal(
            f"{n_stages} pipeline stages need at least {n_stages} blocks, but the model has --n-layers {n_layers}; "
            f"use --n-layers {n_stages} or more, or fewer processes"
        )


def refuse_layout(args, world_size: int, multi_stage: bool, virtual_stages: int, builtin_class: str | None):
    """Refuse what cannot run, with one line each. multi_stage: the schedule puts `virtual_stages` stages on each
    rank (built-in only); builtin_class: the torch.distributed.pipelining schedule asked for (None: from scratch)."""
    sweep = getattr(args, "bubble_sweep", None)
    if args.batch_size % args.microbatches and not sweep:
        raise Refusal(
            f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches} equal "
            f"micro-batches; use a --batch-size that is a multiple of {args.microbatches}"
        )
    if sweep and builtin_class:
        raise Refusal("--bubble-sweep measures the from-scratch schedules; leave out --pp-impl builtin")
    if multi_stage and not builtin_class:
        raise Refusal(f"--schedule {args.schedule} is built-in only here; add --pp-impl builtin")
    if multi_stage and args.n_layers < virtual_stages * world_size:
        raise Refusal(
            f"--schedule {args.schedule} puts {virtual_stages} stages on each of {world_size} ranks: it needs "
            f"--n-layers {virtual_stages * world_size} or more (got {args.n_layers})"
        )
    check_builtin_available(builtin_class)
    check_stages(args.n_layers, world_size)
    if builtin_class == "Schedule1F1B" and args.microbatches < world_size:
        raise Refusal(
            f"the built-in Schedule1F1B needs --microbatches >= {world_size} stages (got {args.microbatches}); "
            "the from-scratch one (--pp-impl scratch) runs any number"
        )


def check_builtin_available(class_name: str | None):
    """Refuse `torch.distributed.pipelining.<class_name>` when this torch lacks it (None: nothing to check)."""
    from torch.distributed import pipelining

    if class_name is not None and not hasattr(pipelining, class_name):
        raise Refusal(
            f"torch {torch.__version__} has no torch.distributed.pipelining.{class_name}; choose another --schedule "
            "or a newer torch"
        )


def summarise(world_size: int, losses, timelines, peak, microbatch_bytes, *, in_flight, bubble_predicted,
              bubble_from_steps) -> dict:  # fmt: skip
    """The pipeline's metrics from every rank's records (a collective: every rank calls it). in_flight: this rank's
    most micro-batches held (from scratch; None for the built-in, whose step lists are not ours)."""
    record = {"timelines": timelines, "peak": peak, "microbatch_bytes": microbatch_bytes, "in_flight": in_flight}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, record)
    per_step = [measured_bubble([r["timelines"][s] for r in everyone]) for s in range(len(timelines))]
    measured = [] if None in per_step else per_step  # [] when the timings were not recorded
    later = measured[1:] or measured  # the first step pays for one-off start-up work and counts activation bytes
    scratch = in_flight is not None
    return dict(
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        bubble_predicted=bubble_predicted,
        bubble_from_steps=bubble_from_steps,
        bubble_measured=sum(later) / len(later) if later else None,
        bubble_measured_min=min(later) if later else None,
        bubble_measured_max=max(later) if later else None,
        bubble_measured_per_step=measured,
        timeline=[r["timelines"][-1] for r in everyone] if measured else None,  # the last step, per rank
        in_flight_per_rank=[r["in_flight"] for r in everyone] if scratch else None,
        peak_activation_bytes_per_rank=[r["peak"] for r in everyone],
        microbatch_activation_bytes_per_rank=[r["microbatch_bytes"] for r in everyone] if scratch else None,
        predicted_activation_bytes_per_rank=[r["in_flight"] * r["microbatch_bytes"] for r in everyone]
        if scratch
        else None,
    )


def report(metrics: dict, world_size: int, device: torch.device):
    """Rank 0's lines about the bubble, the activation memory and the throughput."""
    predicted, measured = metrics["bubble_predicted"], metrics["bubble_measured"]
    print0(
        "bubble: "
        + (f"predicted {predicted:.3f}" if predicted is not None else "no formula for zero-bubble schedules")
        + (f", measured {measured:.3f}" if measured is not None else "")
        + f" | peak activation bytes per rank {metrics['peak_activation_bytes_per_rank']}"
    )
    print0(f"throughput: {metrics['tokens_per_s']:,.0f} tokens/s on {world_size} x {device.type}")


# --------------------------------------------------------------------------------------------------
# Zero bubble: a built-in schedule's order of actions, run on an ideal machine
# --------------------------------------------------------------------------------------------------

COMPUTE = ("F", "I", "W", "B")  # forward; backward split into input's (I) and weights' (W) gradient; B: both at once


def schedule_order(schedule) -> list[list[tuple[str, int, int]]] | None:
    """Each rank's computations, in the order a built-in multi-stage schedule runs them: [(kind, stage, micro-batch)]
    with kind in COMPUTE. Read from the schedule's `pipeline_order` (every rank computes every rank's), without its
    empty slots and communication actions. None for a single-stage schedule (its `pipeline_order`, where it has one,
    is only a picture: it does not drive the run) or where torch has no such attribute."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(schedule, PipelineScheduleMulti) or not order:
        return None
    kind = lambda action: getattr(action.computation_type, "value", str(action.computation_type))  # noqa: E731
    return [
        [(kind(a), a.stage_index, a.microbatch_index) for a in order[rank] if a is not None and kind(a) in COMPUTE]
        for rank in sorted(order)
    ]


PER_BLOCK = {"F": 1, "I": 1, "W": 1, "B": 2}  # time units per block; a whole backward (B) is I + W


def simulate_per_block(orders, partition) -> tuple[list, Fraction]:
    """simulate_order with each action costing PER_BLOCK[kind] times the blocks of its stage (partition: the run's
    block ranges [start, end) per stage)."""
    blocks = [end - start for start, end in partition]
    return simulate_order(orders, len(blocks), lambda kind, stage: PER_BLOCK[kind] * blocks[stage])


def simulate_order(orders, n_stages: int, cost) -> tuple[list, Fraction]:
    """Run each rank's list of (kind, stage, micro-batch) in order on an ideal machine: communication is free and
    an action takes cost(kind, stage). F(s, i) waits for F(s - 1, i); I or B(s, i) for I or B(s + 1, i) (on the last
    stage, for its F(s, i)); W(s, i) for I(s, i). Returns (each rank's timeline [(kind, i, start, end, stage)], idle
    fraction of the ranks x makespan rectangle). Raises RuntimeError when no rank can go on (a deadlock)."""
    ended: dict[tuple[str, int, int], Fraction] = {}  # ("F" or "I", stage, mb) -> end time; a B ends its I too
    position, clock = [0] * len(orders), [Fraction(0)] * len(orders)
    timelines: list[list] = [[] for _ in orders]

    def waits_for(kind, stage, mb):
        if kind == "F":
            return ("F", stage - 1, mb) if stage > 0 else None
        if kind == "W":
            return ("I", stage, mb)
        return ("I", stage + 1, mb) if stage < n_stages - 1 else ("F", stage, mb)

    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, stage, mb = order[position[rank]]
                needs = waits_for(kind, stage, mb)
                if needs is not None and needs not in ended:
                    break
                start = max(clock[rank], ended.get(needs, Fraction(0)))
                clock[rank] = start + cost(kind, stage)
                ended["I" if kind == "B" else kind, stage, mb] = clock[rank]
                timelines[rank].append((kind, mb, start, clock[rank], stage))
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {rank: order[position[rank]] for rank, order in enumerate(orders) if position[rank] < len(order)}
            raise RuntimeError(f"no rank can go on; each waits at {stuck}")
    makespan = max(clock)
    busy = sum(end - start for timeline in timelines for _, _, start, end, _ in timeline)
    return timelines, 1 - busy / (len(orders) * makespan)


# --------------------------------------------------------------------------------------------------
# Cost-aware partitioning: the embeddings and the head are not blocks
# --------------------------------------------------------------------------------------------------


def forward_flops_per_token(config) -> dict[str, int]:
    """Forward FLOPs per token of each piece of the course's model (2 per multiply-add of a matrix product):
    the embeddings 0 (a table lookup), one block 2 (4 d^2 + 2 d h) for its six projections plus 2 x 2 x T x d for
    the attention scores and their weighted sum, the head 2 d V (the norms and the loss are O(d) and O(V): left
    out, as utils.model.flops_per_token leaves them out; three times the sum is that training estimate)."""
    d, hidden = config.dim, config.mlp_ratio * config.dim
    return {
        "embedding": 0,
        "block": 2 * (4 * d * d + 2 * d * hidden) + 2 * 2 * config.seq_len * d,
        "head": 2 * d * config.vocab_size,
    }


def stage_costs(ranges, block_costs, first_extra, last_extra) -> list:
    """Each stage's cost: its blocks', plus the embeddings' on the first stage and the head's on the last."""
    costs = [sum(block_costs[start:end]) for start, end in ranges]
    costs[0] += first_extra
    costs[-1] += last_extra
    return costs


def cost_aware_partition(block_costs, n_stages: int, first_extra=0, last_extra=0) -> list[tuple[int, int]]:
    """Contiguous block ranges [start, end), at least one block per stage, that make the slowest stage as fast as
    possible when the first stage also pays `first_extra` (embeddings) and the last `last_extra` (norm, head, loss).
    Dynamic programming: best[s][n] holds the first n blocks cut into s stages with the smallest stage costs, sorted
    from the slowest down and compared in that order (the bottleneck first); among equal cuts, later stages get fewer
    blocks."""
    n_layers = len(block_costs)
    check_stages(n_layers, n_stages)
    prefix = [0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    def cost(start, end):
        return prefix[end] - prefix[start] + (first_extra if start == 0 else 0) + (last_extra if end == n_layers else 0)

    # (stage costs sorted from the slowest down, minus where the last stage starts)
    best = {(1, n): ((cost(0, n),), 0) for n in range(1, n_layers + 1)}
    for s in range(2, n_stages + 1):
        for n in range(s, n_layers + 1):
            best[s, n] = min(
                (tuple(sorted((*best[s - 1, k][0], cost(k, n)), reverse=True)), -k) for k in range(s - 1, n)
            )
    ranges, end = [], n_layers
    for s in range(n_stages, 0, -1):
        start = -best[s, end][1]
        ranges.append((start, end))
        end = start
    return ranges[::-1]
