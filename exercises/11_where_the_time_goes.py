# Exercise for lesson 11: complete the numbered TODOs. (This file is generated from
# solutions/11_where_the_time_goes.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 11: where the time goes. A distributed step, profiled on every rank, read as intervals, and made faster.

A step is computation, communication, waiting and data loading, on every rank. torch.profiler records a few steps
(--profile DIR: one Chrome/Perfetto trace per rank, which TensorBoard and ui.perfetto.dev open). The lesson reads
each trace back as intervals of each kind (TODOs 1 and 2) and measures the communication that computation does not
hide (TODO 3): what overlap, buckets, prefetching, tensor and pipeline parallelism change. Then it speeds the step
up one technique at a time: bf16 autocast, a foreach or fused optimizer, activation checkpointing (TODO 4 chooses
what selective checkpointing keeps under a memory cap), torch.compile; TODO 5 picks the fastest configuration
under a memory cap from the measured table.

    torchrun --nproc_per_node=2 exercises/11_where_the_time_goes.py --steps 6 --profile runs/traces/ddp
    torchrun --nproc_per_node=2 exercises/11_where_the_time_goes.py --steps 6 --ddp-overlap off --profile runs/t/off
    torchrun --nproc_per_node=2 exercises/11_where_the_time_goes.py --strategy fsdp --prefetch explicit
    torchrun --nproc_per_node=2 exercises/11_where_the_time_goes.py --checkpointing selective --optimizer-impl fused
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from utils.course.lessons import lesson
from utils.data import load_token_dataset
from utils.distributed_utils import destroy_process_group, print0, run_main, setup
from utils.gather import checksum, full_parameters, gather_stages
from utils.lesson_11.activations import block_op_costs, checkpoint_blocks
from utils.lesson_11.options import add_options, check_options
from utils.lesson_11.profiling import StepProfiler, read_events, step_spans, trace_path, training_thread
from utils.metrics import state_bytes, write_metrics
from utils.model import build_model, loss_fn
from utils.training import (
    DEFAULT_LR,
    Logger,
    Throughput,
    autocast,
    base_parser,
    batches,
    check_batches,
    model_config,
    parameter_groups,
    parse_args,
)

KINDS = ("computation", "communication", "waiting", "data")
# What a rank's training thread calls to communicate: torch's c10d operators (DTensor's functional ones for tensor
# parallelism), the backends' own annotations, and FSDP's waits. On the CPU, gloo runs a collective on threads of its
# own (pt_gloo_runloop): the training thread only hands it over (c10d::allreduce_) and later blocks on it, while a
# gloo:all_reduce event on another thread shows the transfer itself. Point-to-point calls (gloo:send, gloo:recv)
# run on the training thread. With NCCL a collective is a kernel on its own CUDA stream ("ncclDevKernel_..." events,
# category "kernel").
COMMUNICATION_CALLS = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")


def kind_of(event: dict, thread) -> str | None:
    """One trace event -> "computation", "communication", "waiting", "data", or None (not a kind of work: metadata,
    markers, annotations that only group other events). `thread`: the id of the rank's training thread."""
    # TODO 1: the kind of an event. Complete events only. The data loader's batches are data; on a GPU, kernels
    #   compute or (NCCL's) communicate; on other threads only gloo's own events ("gloo:...") communicate, the rest
    #   is not counted; the training thread waits inside communication calls and computes in its other operators.
    raise NotImplementedError("TODO 1: the kind of an event")


def union(intervals) -> list[tuple[float, float]]:
    """Intervals (start, end), in any order, overlapping or nested -> the time they cover, as sorted disjoint
    intervals (two that touch become one). The time of nested operators counts once."""
    # TODO 2: the union of intervals. The time covered by any of them, as few sorted intervals as possible, none
    #   overlapping or touching another; empty ones cover nothing. Leave the list you are given as it was.
    raise NotImplementedError("TODO 2: the union of intervals")


def total(intervals) -> float:
    """The time the intervals cover (each instant once)."""
    return sum(end - start for start, end in union(intervals))


def intersection(a, b) -> list[tuple[float, float]]:
    """The time covered both by intervals `a` and by intervals `b`, as sorted disjoint intervals."""
    # TODO 3: the intersection of two sets of intervals: the time covered by both at once. Exposed communication is
    #   then the communication's time minus its intersection with the computation's.
    raise NotImplementedError("TODO 3: the intersection of two sets of intervals: the time covered by both at once")


def exposed(communication, computation) -> float:
    """Communication time that no computation on the same rank covers: what the step pays for it."""
    return total(communication) - total(intersection(communication, computation))


def without(a, b) -> list[tuple[float, float]]:
    """The time of intervals `a` that intervals `b` do not cover."""
    a, gaps = union(a), []
    if not a:
        return []
    start = a[0][0]
    for gap_end, next_start in union(b):
        gaps.append((start, gap_end))
        start = max(start, next_start)
    return intersection(a, [*gaps, (start, a[-1][1])])


def breakdown(events: list[dict]) -> dict[str, float]:
    """One rank's trace -> seconds per recorded step of each kind, and of exposed communication.

    The training thread's time splits into waiting (inside a communication call, even one nested in an operator),
    data (loading, not waiting), computation (the rest of its operators) and other (no recorded operator: Python,
    or a wait no event marks). Communication is counted where it runs (gloo's threads, NCCL's stream); its exposed
    part is what no computation covers. On a GPU the device's view: computation and communication are kernels,
    waiting is the time the device runs neither."""
    thread = training_thread(events)
    found = {kind: [] for kind in KINDS}
    gpu = any(event.get("cat") == "kernel" for event in events)
    for event in events:
        kind = kind_of(event, thread)
        if kind == "computation" and gpu and event.get("cat") != "kernel":
            continue  # the CPU only launches the GPU's work; the kernels are the computation
        if kind is not None:
            found[kind].append((event["ts"], event["ts"] + event["dur"]))
    steps = union(step_spans(events))
    waiting = [] if gpu else intersection(found["waiting"], steps)
    data = without(intersection(found["data"], steps), waiting)
    computation = without(intersection(found["computation"], steps), waiting + data)
    communication = intersection(found["communication"], steps)
    seconds = {
        "step": total(steps),
        "computation": total(computation),
        "communication": total(communication),
        "exposed_communication": exposed(communication, computation),
        "data": total(data),
        "waiting": total(waiting),
    }
    if gpu:  # the device's view: the four kinds together cover the step, and nothing is "other"
        seconds["waiting"] = seconds["step"] - total(computation + communication + data)
        seconds["other"] = 0.0
    else:  # the training thread's: waiting, data, computation and other are disjoint and cover the step
        seconds["other"] = seconds["step"] - seconds["computation"] - seconds["data"] - seconds["waiting"]
    per_step = 1e-6 / len(step_spans(events))  # microseconds of all recorded steps -> seconds per step
    return {kind: value * per_step for kind, value in seconds.items()}


def choose_saved(costs: dict[str, tuple[int, float]], cap_bytes: float) -> set[str]:
    """Selective checkpointing's policy: costs maps each operation to (bytes its outputs take, FLOPs to recompute
    them); the operations whose outputs are kept (saved) while the kept bytes stay within cap_bytes. The others are
    recomputed in backward."""
    # TODO 4: a selective checkpointing policy under a memory cap. Keep first the outputs that are dearest to
    #   recompute for the bytes they hold, as long as what is kept fits the cap; an operation that does not fit is
    #   passed over for cheaper ones.
    raise NotImplementedError("TODO 4: a selective checkpointing policy under a memory cap")


def fastest_under_cap(rows: list[dict], cap_bytes: float) -> dict | None:
    """rows: measured configurations, each {"name", "tokens_per_s", "peak_bytes"} -> the fastest whose peak memory per
    rank is within cap_bytes (of two equally fast, the one that needs less memory), or None when none fits."""
    # TODO 5: the fastest configuration under a memory cap. Among the rows whose memory fits the cap (equal to it
    #   fits), the highest throughput; a tie goes to the smaller memory; nothing fits: None.
    raise NotImplementedError("TODO 5: the fastest configuration under a memory cap")


RECORDED = (
    "strategy",
    "ddp_overlap",
    "bucket_cap_mb",
    "prefetch",
    "reshard_after_forward",
    "microbatches",
    "optimizer_impl",
    "checkpointing",
    "compile",
    "autocast",
    "optimizer",
)  # options into the metrics file
SELECTIVE_CAP = 0.6  # selective checkpointing keeps at most this share of what a block's operations output


def apply_speed_ups(model, args):
    """Activation checkpointing (selective: what TODO 4 keeps under the cap) and torch.compile, block by block."""
    if args.checkpointing != "none":
        costs = block_op_costs(model.config, args.batch_size * args.seq_len)
        saved = choose_saved(costs, SELECTIVE_CAP * sum(size for size, _ in costs.values()))
        checkpoint_blocks(model, args.checkpointing, saved if args.checkpointing == "selective" else ())
        if args.checkpointing == "selective":
            print0(f"--checkpointing selective keeps {sorted(saved)} (at most {SELECTIVE_CAP:.0%} of a block's bytes)")
    if args.compile:  # compiled on the first call; each block alike, so one compilation serves them all
        for block in model.blocks:
            block.compile()
    return model


def build(args, rank: int, world_size: int, device: torch.device):
    """This rank's model (wrapped for the strategy), the parameters its optimizer steps, and lesson 05's schedule
    (pp) or None. The speed-ups go on the blocks before DDP or FSDP wraps the model."""
    model = apply_speed_ups(build_model(model_config(args), seed=args.seed), args)
    model = model.to(device)
    if args.strategy == "ddp":
        overlap = args.ddp_overlap == "on"
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb) if overlap else model
        return wrapped, list(model.parameters()), None
    mesh = init_device_mesh(device.type, (world_size,))
    if args.strategy == "fsdp":
        reshard = args.reshard_after_forward == "on"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        if args.prefetch == "explicit":  # each block starts gathering the next one it will need
            blocks = list(model.blocks)
            for this, following in zip(blocks, blocks[1:]):
                this.set_modules_to_forward_prefetch([following])
                following.set_modules_to_backward_prefetch([this])
        return model, list(model.parameters()), None
    if args.strategy == "tp":
        lesson("04").apply_tensor_parallel(model, mesh)
        return model, parameter_groups(model), None
    pipeline = lesson("05")  # one stage per rank, GPipe, built with lesson 05's built-in path
    stage = pipeline.build_stage(model, rank, world_size).to(device)
    schedule = pipeline.build_builtin_schedule([stage], [rank], world_size, dist.group.WORLD, device, "gpipe",
                                               args.microbatches, loss_fn)  # fmt: skip
    return stage, list(stage.parameters()), schedule


def build_optimizer(params, args):
    """AdamW as the three implementations run it: a loop over the parameters, foreach (one operation over all of
    them at a time), or fused (one kernel for the whole update)."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, **flags[args.optimizer_impl])
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **flags[args.optimizer_impl])


def train_step(args, model, schedule, inputs, targets, device, world_size: int):
    """Forward and backward of one step; the mean loss over the step's batch (on every rank)."""
    if schedule is not None:  # pp: the first stage feeds the batch in, the last computes the loss
        losses = []
        first, last = model.first, model.last
        schedule.step(*((inputs,) if first else ()), **({"target": targets, "losses": losses} if last else {}))
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
        dist.all_reduce(loss)  # only the last stage has it: the sum over ranks is its loss
        return loss
    with autocast(args, device):
        loss = loss_fn(model(inputs), targets)
    loss.backward()
    if args.strategy == "ddp" and args.ddp_overlap == "off":  # after backward, one flat all-reduce of all gradients
        gradients = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in gradients])
        dist.all_reduce(flat)
        flat /= world_size
        for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
            gradient.copy_(average.view_as(gradient))
    loss = loss.detach()
    if args.strategy in ("ddp", "fsdp"):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # each rank's mean over its own sequences -> the global mean
    return loss


def train(args, rank: int, world_size: int, device: torch.device):
    data_parallel = args.strategy in ("ddp", "fsdp")  # tp and pp: every rank reads the same batch
    ranks_per_batch = world_size if data_parallel else 1
    model, params, schedule = build(args, rank, world_size, device)
    optimizer = build_optimizer(params, args)
    print0(f"{world_size} ranks | --strategy {args.strategy} | global batch {ranks_per_batch} x {args.batch_size} "
           f"sequences | --optimizer-impl {args.optimizer_impl} | --autocast {args.autocast} | "
           f"--checkpointing {args.checkpointing} | --compile {args.compile}")  # fmt: skip

    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, per_step=ranks_per_batch, what="global batch")
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=ranks_per_batch * args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    profiler = StepProfiler(args.profile, rank, device, args.steps)
    logger, throughput, losses = Logger(args, total_steps=args.steps), Throughput(device, warmup=2), []
    data = batches(loader)
    for step in range(1, args.steps + 1):
        with profiler.step(step):
            inputs, targets = next(data)  # inside the step: the profiler sees the data loader's time
            if data_parallel:
                inputs, targets = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(args, model, schedule, inputs, targets, device, world_size)
            optimizer.step()
        losses.append(loss.item())
        throughput.step(ranks_per_batch * inputs.numel())
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    profiler.close()
    logger.close()

    per_rank = [None] * world_size
    mine = {"peak_step_bytes": profiler.peak_bytes, **state_bytes(model, optimizer)}
    if args.profile is not None:
        mine |= breakdown(read_events(trace_path(args.profile, rank)))
    dist.all_gather_object(per_rank, mine)
    if args.profile is not None:
        print0(f"traces: {args.profile}/rank*.pt.trace.json (ui.perfetto.dev, chrome://tracing); ms per step:")
        shown = ("step", "computation", "communication", "exposed_communication", "waiting", "data", "other")
        for r, times in enumerate(per_rank):
            print0(f"  rank {r}: " + "  ".join(f"{kind} {times[kind] * 1e3:.1f}" for kind in shown))
    if schedule is None:
        full = full_parameters(getattr(model, "module", model))  # DDP's wrapper names them module.*
    else:
        shapes = {name: p.shape for name, p in build_model(model_config(args), seed=args.seed).named_parameters()}
        full = gather_stages(dict(model.named_parameters()), shapes)
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum(full.values()),
        bytes_per_rank=[{key: r[key] for key in ("params", "grads", "optimizer")} for r in per_rank],
        per_rank=per_rank,
        **{name: getattr(args, name) for name in RECORDED},
        profile=str(args.profile) if args.profile else None,
    )
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    del optimizer, model, schedule


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--checkpoint",))  # nothing to save: a lesson on time
    add_options(parser)
    args = parse_args(parser)
    check_options(parser, args)
    _, rank, device, world_size = setup(args.seed)
    train(args, rank, world_size, device)
    print0("done")
    dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
