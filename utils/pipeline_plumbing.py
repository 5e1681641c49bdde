"""Lesson 05's plumbing: what the pipeline script needs besides the technique itself.

- `check_stages`, `refuse_layout`: refuse a layout that cannot run, in one line, before any rank waits;
- `full_parameters`: every stage's parameters gathered into the full model's state dict, and its checksum;
- `summarise`, `report`: the run's metrics from every rank's records, and the lines rank 0 prints;
- `batches`: endless batches from a loader, as lesson 00 takes them.
"""

import torch
import torch.distributed as dist

from utils.distributed_utils import CourseError, print0
from utils.pipeline_timing import measured_bubble


def check_stages(n_layers: int, n_stages: int):
    """Every stage needs at least one block."""
    if n_stages > n_layers:
        raise CourseError(
            f"{n_stages} pipeline stages need at least {n_stages} blocks, but the model has --n-layers {n_layers}; "
            f"use --n-layers {n_stages} or more, or fewer processes"
        )


def refuse_layout(args, world_size: int, multi_stage: bool, virtual_stages: int, builtin_class: str | None):
    """Refuse what cannot run, with one line each. multi_stage: the schedule puts `virtual_stages` stages on each
    rank (built-in only); builtin_class: the torch.distributed.pipelining schedule asked for (None: from scratch)."""
    sweep = getattr(args, "bubble_sweep", None)
    if args.batch_size % args.microbatches and not sweep:
        raise CourseError(
            f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches} equal "
            f"micro-batches; use a --batch-size that is a multiple of {args.microbatches}"
        )
    if sweep and builtin_class:
        raise CourseError("--bubble-sweep measures the from-scratch schedules; leave out --pp-impl builtin")
    if multi_stage and not builtin_class:
        raise CourseError(f"--schedule {args.schedule} is built-in only here; add --pp-impl builtin")
    if multi_stage and args.n_layers < virtual_stages * world_size:
        raise CourseError(
            f"--schedule {args.schedule} puts {virtual_stages} stages on each of {world_size} ranks: it needs "
            f"--n-layers {virtual_stages * world_size} or more (got {args.n_layers})"
        )
    check_builtin_available(builtin_class)
    check_stages(args.n_layers, world_size)
    if builtin_class == "Schedule1F1B" and args.microbatches < world_size:
        raise CourseError(
            f"the built-in Schedule1F1B needs --microbatches >= {world_size} stages (got {args.microbatches}); "
            "the from-scratch one (--pp-impl scratch) runs any number"
        )


def check_builtin_available(class_name: str | None):
    """Refuse `torch.distributed.pipelining.<class_name>` when this torch lacks it (None: nothing to check)."""
    from torch.distributed import pipelining

    if class_name is not None and not hasattr(pipelining, class_name):
        raise CourseError(
            f"torch {torch.__version__} has no torch.distributed.pipelining.{class_name}; choose another --schedule "
            "or a newer torch"
        )


def full_parameters(stage_modules, names: list[str]) -> tuple[float, dict]:
    """(checksum, full state dict): gathered from every stage, in the full model's order (a collective).

    The checksum adds each parameter's sum of squares (float64) in the full model's order, so it is bit for bit
    utils.metrics.param_checksum of the same parameters in one process. The stages together must hold exactly
    the model's parameters, each once: asserted."""
    local = {name: p.detach().cpu() for module in stage_modules for name, p in module.named_parameters()}
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    held = [name for part in everything for name in part]
    assert sorted(held) == sorted(names), f"the stages do not hold each of the model's parameters once: {held[:4]}"
    merged = {name: tensor for part in everything for name, tensor in part.items()}
    checksum = sum(float(merged[name].double().pow(2).sum()) for name in names)
    return checksum, {name: merged[name] for name in names}


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


def batches(loader):
    """Endless batches: start another pass over the data whenever one ends (as lesson 00 does)."""
    while True:
        yield from loader
