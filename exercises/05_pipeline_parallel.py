# Exercise for lesson 05: complete the numbered TODOs. (This file is generated from
# solutions/05_pipeline_parallel.py by `python -m utils.make_exercises`; course maintainers edit the solution.)
"""Lesson 05: pipeline parallelism. The model's blocks cut into stages, one per rank, micro-batches streamed through.

Rank r holds stage r: a contiguous slice of model.blocks (the embeddings on the first stage, the final norm, the
head and the loss on the last). Each batch is split into --microbatches micro-batches; activations travel forward
from rank to rank and their gradients backward. A schedule says in which order each rank runs its forwards (F) and
backwards (B): GPipe (all F, then all B) or 1F1B (a few F, then one F one B, then the remaining B). Gradients add
up over the micro-batches and the optimizer steps once per batch, so p stages with m micro-batches train exactly
like one process on the whole batch. The number of stages is the world size.

    torchrun --nproc_per_node=4 solutions/05_pipeline_parallel.py --n-layers 4 --schedule 1f1b --microbatches 8
    torchrun --nproc_per_node=2 solutions/05_pipeline_parallel.py --pp-impl builtin --schedule interleaved
    sbatch slurm/05_pipeline_parallel_2nodes.sbatch solutions --n-layers 8     # 8 stages on 2 nodes x 4 GPUs
"""

import argparse
import json
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, destroy_process_group, print0, run_main, save0, setup
from utils.metrics import SavedActivations, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
    positive_int,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
VIRTUAL_STAGES = 2  # stages per rank in the interleaved schedule (built-in only)


# --------------------------------------------------------------------------------------------------
# Partition: which blocks each stage holds
# --------------------------------------------------------------------------------------------------


def partition(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Block ranges [start, end) of each stage: contiguous, covering every block, sizes differing by at most one."""
    if n_stages > n_layers:
        raise CourseError(
            f"{n_stages} pipeline stages need at least {n_stages} blocks, but the model has --n-layers {n_layers}; "
            f"use --n-layers {n_stages} or more, or fewer processes"
        )
    # TODO 1: balanced partition. Cut n_layers blocks into n_stages contiguous ranges [start, end) whose sizes
    #   differ by at most one (the first n_layers % n_stages stages get one block more). The slowest stage sets
    #   the pace of the whole pipeline, so balance matters.
    raise NotImplementedError("TODO 1: balanced partition")


class Stage(nn.Module):
    """One pipeline stage: some of the model's modules, under the names they have in the full model.

    Keeping the names ("blocks.3.mlp.up_proj.weight") lets the stages' state dicts merge back into the full
    model's, and the checksum compare with one process, parameter by parameter.
    """

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.token_embedding = model.token_embedding if first else None
        self.position_embedding = model.position_embedding if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: tokens [mb, T] -> activations; others: activations [mb, T, dim]; the last returns logits."""
        if self.token_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def build_stage(model: nn.Module, stage_index: int, n_stages: int) -> Stage:
    """Stage `stage_index` of `n_stages`, sharing its modules with `model` (built from the seed on every rank)."""
    start, end = partition(len(model.blocks), n_stages)[stage_index]
    return Stage(model, range(start, end), first=stage_index == 0, last=stage_index == n_stages - 1)


# --------------------------------------------------------------------------------------------------
# Schedules: the steps each rank runs, as lists of ("F", micro-batch) and ("B", micro-batch)
# --------------------------------------------------------------------------------------------------


def gpipe_steps(n_stages: int, n_microbatches: int, rank: int) -> list[tuple[str, int]]:
    """GPipe: every forward, then every backward (micro-batches in order 0, 1, ..., m - 1 both times)."""
    # TODO 2: the GPipe schedule. Return [("F", 0), ..., ("F", m-1), ("B", 0), ..., ("B", m-1)]: the same list on
    #   every rank. Each rank holds all m micro-batches' activations before its first backward.
    raise NotImplementedError("TODO 2: the GPipe schedule")


def one_f_one_b_steps(n_stages: int, n_microbatches: int, rank: int) -> list[tuple[str, int]]:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    # TODO 3: the 1F1B schedule. Rank r first runs min(p - r - 1, m) warm-up forwards (the last rank none), then
    #   alternates F(next) B(oldest) until every forward is done, then runs the backwards that are left. A rank
    #   starts a backward as soon as it can, so it never holds more than p - r micro-batches' activations.
    raise NotImplementedError("TODO 3: the 1F1B schedule")


SCRATCH_SCHEDULES = {"gpipe": gpipe_steps, "1f1b": one_f_one_b_steps}


def simulate(schedule: str, n_stages: int, n_microbatches: int, forward=Fraction(1), backward=Fraction(2)):
    """Run every rank's step list on an ideal machine: a forward takes `forward`, a backward `backward`,
    communication is free. F(mb) on rank r starts after F(mb) on rank r - 1 ended, B(mb) after B(mb) on rank r + 1.
    Returns (timeline per rank as [(kind, mb, start, end)], idle fraction of the p x makespan rectangle)."""
    steps = [SCRATCH_SCHEDULES[schedule](n_stages, n_microbatches, r) for r in range(n_stages)]
    done: dict[tuple[str, int, int], Fraction] = {}  # (kind, mb, rank) -> end time
    position, clock = [0] * n_stages, [Fraction(0)] * n_stages
    timelines: list[list] = [[] for _ in range(n_stages)]
    while any(position[r] < len(steps[r]) for r in range(n_stages)):
        progressed = False
        for r in range(n_stages):
            while position[r] < len(steps[r]):
                kind, mb = steps[r][position[r]]
                needs = (kind, mb, r - 1) if kind == "F" and r > 0 else None
                needs = (kind, mb, r + 1) if kind == "B" and r < n_stages - 1 else needs
                if needs is not None and needs not in done:
                    break
                start = max(clock[r], done.get(needs, Fraction(0)))
                clock[r] = start + (forward if kind == "F" else backward)
                done[(kind, mb, r)] = clock[r]
                timelines[r].append((kind, mb, start, clock[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} with p={n_stages}, m={n_microbatches}: no rank can make progress")
    makespan = max(clock)
    busy = n_microbatches * (forward + backward) * n_stages
    return timelines, 1 - busy / (n_stages * makespan)


def predicted_bubble(n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble formula: (p - 1) / (v m + p - 1), v = stages per rank (1 for GPipe and 1F1B)."""
    return (n_stages - 1) / (virtual_stages * n_microbatches + n_stages - 1)


def in_flight(steps: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward is done and backward is not, at any point of a step list."""
    held = most = 0
    for kind, _ in steps:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


# --------------------------------------------------------------------------------------------------
# The engine: runs one rank's step list, with point-to-point communication between neighbours
# --------------------------------------------------------------------------------------------------


def p2p_plan(steps: list[tuple[str, int]], rank: int, n_stages: int) -> list[list[tuple[str, int, str, int]]]:
    """The communication before each step, as len(steps) + 1 batches of (op, peer, what, micro-batch).

    Batch i holds the sends of step i - 1's result and the receive step i needs; the engine posts a batch with
    one batch_isend_irecv and waits for it. Posting a send together with the next receive is what keeps
    neighbours from waiting for each other (rank r sending an activation to r + 1 while r + 1 sends a gradient
    to r): with NCCL a send can block until its receive is posted. tests/test_05 checks every plan against
    that strictest rule for many (p, m).
    """
    previous = rank - 1 if rank > 0 else None
    following = rank + 1 if rank < n_stages - 1 else None
    batches: list[list] = [[] for _ in range(len(steps) + 1)]
    # TODO 4: the point-to-point plan. For step i = (kind, mb) put into batches[i] what it must receive first, and
    #   into batches[i + 1] what it sends after computing:
    #   F: receive ("recv", previous, "activation", mb) unless first; then send ("send", following, "activation", mb)
    #      unless last.   B: receive ("recv", following, "gradient", mb) unless last; then send
    #      ("send", previous, "gradient", mb) unless first. Activations go forward, gradients backward.
    raise NotImplementedError("TODO 4: the point-to-point plan")
    return batches


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: time what the GPU did, not what was queued
    return time.perf_counter()


def run_steps(stage, steps, *, rank, n_stages, inputs, targets, activation_shape, device, saved=None, crash=False):
    """Run one batch's step list on this rank. `inputs` (first stage) and `targets` (last stage) are lists of
    micro-batches. Returns (losses of the micro-batches on the last stage, timeline [(kind, mb, start, end, stage)],
    bytes one micro-batch's forward leaves saved for backward)."""
    n_microbatches = len(inputs) if inputs is not None else len(targets) if targets is not None else None
    n_microbatches = n_microbatches or len({mb for _, mb in steps})
    last = rank == n_stages - 1
    stage_inputs, stage_outputs, losses, timeline = {}, {}, [], []
    buffers: dict[tuple[str, int], torch.Tensor] = {}  # received and sent tensors, alive until their batch is done
    microbatch_bytes = None
    t0 = time.perf_counter()
    for i, batch in enumerate(p2p_plan(steps, rank, n_stages)):
        ops = []
        for op, peer, what, mb in batch:
            if op == "recv":
                buffers[(what, mb)] = torch.empty(activation_shape, device=device)
                ops.append(dist.P2POp(dist.irecv, buffers[(what, mb)], peer))
            else:
                ops.append(dist.P2POp(dist.isend, buffers.pop((what, mb)), peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if i == len(steps):
            break
        kind, mb = steps[i]
        if crash and kind == "B":  # --crash-at-step: this rank dies in the middle of the schedule
            print(f"[rank {rank}] crashing on purpose before B{mb} (--crash-at-step)", file=sys.stderr, flush=True)
            os._exit(3)
        start = _now(device)
        # TODO 5: run one step. F: the stage input is inputs[mb] on the first stage, else the received activation
        #   buffers.pop(("activation", mb)) made a leaf that requires grad; keep the input and the output (on the last
        #   stage: loss_fn(logits, targets[mb]) / n_microbatches, a micro-batch's share of the batch's mean loss) for
        #   the backward, and leave the output, detached, in buffers[("activation", mb)] for the send. B: backward from
        #   the kept output with the received gradient buffers.pop(("gradient", mb)) (none on the last stage: it is
        #   the loss), then leave the input's gradient in buffers[("gradient", mb)] (not on the first stage).
        raise NotImplementedError("TODO 5: run one step")
        timeline.append((kind, mb, start - t0, _now(device) - t0, rank))
    return losses, timeline, microbatch_bytes


# --------------------------------------------------------------------------------------------------
# The built-in: torch.distributed.pipelining
# --------------------------------------------------------------------------------------------------


def build_builtin_schedule(stage_modules, stage_indices, n_stages, pp_group, device, schedule, n_microbatches, loss):
    """PipelineStage(s) around this rank's stage module(s) and the built-in schedule that runs them.

    stage_modules[i] is stage stage_indices[i] of n_stages; pp_group is the pipeline's process group (lesson 06
    passes a DeviceMesh's "pp" dimension). `loss(output, target)` is one micro-batch's mean loss: the schedule
    divides the gradients by n_microbatches (scale_grads=True), so they equal the whole batch's.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    # TODO 6: the built-in pipeline. Wrap each stage module: PipelineStage(module, stage_index, n_stages, device,
    #   group=pp_group). GPipe and 1F1B take the one stage (ScheduleGPipe / Schedule1F1B(stage, n_microbatches,
    #   loss_fn=loss)); the interleaved schedule takes this rank's list of stages (ScheduleInterleaved1F1B).
    raise NotImplementedError("TODO 6: the built-in pipeline")


def record_builtin_timings(schedule, timeline: list, origin: list, device: torch.device) -> bool:
    """Make the built-in schedule's stages append (kind, mb, start, end, stage) to `timeline` for every F and B,
    times from origin[0]. It wraps PipelineStage.forward_one_chunk and backward_one_chunk, which are not public
    API: where they are missing (another torch), nothing is recorded and this returns False."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if not all(hasattr(stage, "forward_one_chunk") and hasattr(stage, "backward_one_chunk") for stage in stages):
        return False

    def timed(run, kind, stage_index):
        def run_and_record(chunk, *args, **kwargs):
            start = _now(device)
            result = run(chunk, *args, **kwargs)
            timeline.append((kind, chunk, start - origin[0], _now(device) - origin[0], stage_index))
            return result

        return run_and_record

    for stage in stages:
        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F", stage.stage_index)
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B", stage.stage_index)
    return True


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def check_layout(args, world_size: int):
    """Refuse what cannot run, with one line each, before any process waits for another."""
    if args.batch_size % args.microbatches:
        raise CourseError(
            f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches} equal "
            f"micro-batches; use a --batch-size that is a multiple of {args.microbatches}"
        )
    if args.schedule == "interleaved":
        if args.pp_impl == "scratch":
            raise CourseError("--schedule interleaved is built-in only here; add --pp-impl builtin")
        if args.n_layers < VIRTUAL_STAGES * world_size:
            raise CourseError(
                f"--schedule interleaved puts {VIRTUAL_STAGES} stages on each of {world_size} ranks: it needs "
                f"--n-layers {VIRTUAL_STAGES * world_size} or more (got {args.n_layers})"
            )
    partition(args.n_layers, world_size)  # refuses more stages than blocks
    if args.pp_impl == "builtin" and args.schedule == "1f1b" and args.microbatches < world_size:
        raise CourseError(
            f"the built-in Schedule1F1B needs --microbatches >= {world_size} stages (got {args.microbatches}); "
            "the from-scratch one (--pp-impl scratch) runs any number"
        )


def full_parameters(stage_modules, names: list[str]) -> tuple[float, dict | None]:
    """(checksum, full state dict on rank 0 or None): gathered from every stage, in the full model's order.

    The checksum adds each parameter's sum of squares (float64) in the full model's order, so it is bit for bit
    utils.metrics.param_checksum of the same parameters in one process."""
    local = {name: p.detach().cpu() for module in stage_modules for name, p in module.named_parameters()}
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    merged = {name: tensor for part in everything for name, tensor in part.items()}
    missing = set(names) ^ set(merged)
    assert not missing, f"the stages do not hold exactly the model's parameters: {sorted(missing)[:4]}"
    checksum = sum(float(merged[name].double().pow(2).sum()) for name in names)
    return checksum, {name: merged[name] for name in names}


def train(args, rank: int, world_size: int, device: torch.device, schedule: str, n_microbatches: int) -> dict:
    """Train --steps steps with one pipeline layout; return the metrics (the same dict on every rank)."""
    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, what="pipeline")  # every stage reads the same batches
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator
    )

    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)  # the whole model on every rank, so stages match it
    names = [name for name, _ in model.named_parameters()]
    builtin = args.pp_impl == "builtin"
    virtual = VIRTUAL_STAGES if schedule == "interleaved" else 1
    n_stages = virtual * world_size
    stage_indices = [rank + v * world_size for v in range(virtual)]  # interleaved: stages r and r + p on rank r
    stage_modules = [build_stage(model, index, n_stages) for index in stage_indices]
    del model  # what this rank's stages do not hold is freed
    params = [p for module in stage_modules for p in module.parameters()]
    optimizer = build_optimizer(params, args)
    ranges = partition(config.n_layers, n_stages)  # stage i runs on rank i % world_size
    print0(
        " | ".join(
            f"rank {r}: "
            + ", ".join(f"stage {i} = blocks {a}-{b - 1}" for i, (a, b) in enumerate(ranges) if i % world_size == r)
            for r in range(world_size)
        )
    )
    first = any(i == 0 for i in stage_indices)
    last = any(i == n_stages - 1 for i in stage_indices)
    micro = args.batch_size // n_microbatches
    activation_shape = (micro, args.seq_len, args.dim)

    if builtin:
        pipeline = build_builtin_schedule(
            stage_modules, stage_indices, n_stages, dist.group.WORLD, device, schedule, n_microbatches, loss_fn
        )
        steps = None
        builtin_timeline, origin = [], [0.0]
        recorded = record_builtin_timings(pipeline, builtin_timeline, origin, device)
    else:
        steps = SCRATCH_SCHEDULES[schedule](world_size, n_microbatches, rank)

    logger = Logger(args, total_steps=args.steps)
    throughput = Throughput(device)
    losses, timelines, peaks = [], [], []
    microbatch_bytes = None
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        # Every rank starts the schedule together, so the timelines share one origin. (With NCCL, a collective
        # before the first batch_isend_irecv also lets that call involve only some ranks of the group.)
        dist.barrier()
        with SavedActivations(exclude=params) as saved:
            if builtin:
                mb_losses = []
                builtin_timeline.clear()
                origin[0] = time.perf_counter()
                args_in = (inputs,) if first else ()
                kwargs = {"target": targets, "losses": mb_losses} if last else {}
                pipeline.step(*args_in, **kwargs)
                step_loss = torch.stack(mb_losses).mean() if last else torch.zeros((), device=device)
                timeline = sorted(builtin_timeline, key=lambda entry: entry[2]) if recorded else None
            else:
                # Each micro-batch its own copy: micro-batches must not share storage (saved-bytes accounting).
                mb_inputs = [c.clone() for c in inputs.chunk(n_microbatches)] if rank == 0 else None
                mb_targets = [c.clone() for c in targets.chunk(n_microbatches)] if rank == world_size - 1 else None
                mb_losses, timeline, mb_bytes = run_steps(
                    stage_modules[0],
                    steps,
                    rank=rank,
                    n_stages=world_size,
                    inputs=mb_inputs,
                    targets=mb_targets,
                    activation_shape=activation_shape,
                    device=device,
                    saved=saved,
                    crash=step == args.crash_at_step and rank == world_size - 1,
                )
                microbatch_bytes = microbatch_bytes or mb_bytes
                step_loss = torch.stack(mb_losses).sum() if last else torch.zeros((), device=device)
        optimizer.step()
        peaks.append(saved.peak_bytes)
        timelines.append(timeline)
        dist.broadcast(step_loss, src=world_size - 1)  # the last stage computed the loss: everyone logs it
        losses.append(step_loss.item())
        throughput.step(inputs.numel())
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    # Every rank's timelines and activation bytes, so rank 0 can write them all.
    record = {"timelines": timelines, "peak": max(peaks), "microbatch_bytes": microbatch_bytes}
    if steps is not None:
        record["in_flight"] = in_flight(steps)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, record)
    measured = []
    if all(r["timelines"][0] is not None for r in everyone):
        for s in range(len(timelines)):
            busy = sum(entry[3] - entry[2] for r in everyone for entry in r["timelines"][s])
            span = max(entry[3] for r in everyone for entry in r["timelines"][s])
            measured.append(1 - busy / (world_size * span))
    later = measured[1:] or measured  # the first step pays for one-off start-up work
    checksum, full_state = full_parameters(stage_modules, names)
    if args.checkpoint:
        save0({"model": full_state, "config": vars(config)}, args.checkpoint)
        print0(f"saved the model to {args.checkpoint}")
    predicted_peaks = (
        None if builtin or microbatch_bytes is None else [r["in_flight"] * r["microbatch_bytes"] for r in everyone]
    )
    metrics = dict(
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum,
        bytes_per_rank=state_bytes(nn.ModuleList(stage_modules), optimizer),
        optimizer=args.optimizer,
        dataset=args.dataset,
        pp_impl=args.pp_impl,
        schedule=schedule,
        microbatches=n_microbatches,
        stages=n_stages,
        stages_per_rank=virtual,
        partition=partition(config.n_layers, n_stages),
        bubble_predicted=predicted_bubble(world_size, n_microbatches, virtual),
        bubble_from_steps=None if builtin else float(simulate(schedule, world_size, n_microbatches)[1]),
        bubble_measured=sum(later) / len(later) if later else None,
        bubble_measured_min=min(later) if later else None,
        bubble_measured_max=max(later) if later else None,
        bubble_measured_per_step=measured,
        timeline=[r["timelines"][-1] for r in everyone] if measured else None,  # the last step, per rank
        in_flight_per_rank=None if builtin else [r["in_flight"] for r in everyone],
        peak_activation_bytes_per_rank=[r["peak"] for r in everyone],
        microbatch_activation_bytes_per_rank=None if builtin else [r["microbatch_bytes"] for r in everyone],
        predicted_activation_bytes_per_rank=predicted_peaks,
    )
    del optimizer, stage_modules, params
    if builtin:
        del pipeline
    return metrics


def main():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--pp-impl", choices=["scratch", "builtin"], default="scratch", help="which pipeline")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="interleaved: --pp-impl builtin only")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per --batch-size batch")
    sweep_help = "measure the bubble at m = 1, 2, 4, 8 (GPipe, 1F1B) and add the results to this JSON file"
    parser.add_argument("--bubble-sweep", type=Path, default=None, help=sweep_help)
    parser.add_argument("--crash-at-step", type=positive_int, default=None, help=argparse.SUPPRESS)  # tests only
    args = parse_args(parser)
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    check_layout(args, world_size)  # before setup(): a refused layout ends every rank at once
    local_rank, rank, device, world_size = setup(args.seed)
    print0(
        f"{world_size} ranks, {args.n_layers} blocks | batch "
        f"{args.batch_size} = {args.microbatches} micro-batches of {args.batch_size // args.microbatches} | "
        f"--pp-impl {args.pp_impl} --schedule {args.schedule} | model: {count_parameters(model_config(args)):,} "
        f"parameters | device {device.type}"
    )
    if args.bubble_sweep:
        results = []
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4, 8):
                if args.batch_size % m:
                    raise CourseError(f"--bubble-sweep needs a --batch-size divisible by 8 (got {args.batch_size})")
                metrics = train(args, rank, world_size, device, schedule, m)
                keep = ("bubble_predicted", "bubble_from_steps", "bubble_measured_per_step", "timeline")
                results.append({"schedule": schedule, "microbatches": m, **{k: metrics[k] for k in keep}})
                print0(f"{schedule:5s} m={m}: bubble measured {metrics['bubble_measured']:.3f}, formula "
                       f"{metrics['bubble_predicted']:.3f}")  # fmt: skip
        if rank == 0:
            path = args.bubble_sweep
            table = json.loads(path.read_text()) if path.exists() else {}
            table[str(world_size)] = {"device": device.type, "n_layers": args.n_layers, "runs": results}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        metrics = {**metrics, "bubble_sweep": results}
    else:
        metrics = train(args, rank, world_size, device, args.schedule, args.microbatches)
    print0(
        f"bubble: predicted {metrics['bubble_predicted']:.3f}"
        + (f", measured {metrics['bubble_measured']:.3f}" if metrics["bubble_measured"] is not None else "")
        + f" | peak activation bytes per rank {metrics['peak_activation_bytes_per_rank']}"
    )
    print0(f"throughput: {metrics['tokens_per_s']:,.0f} tokens/s on {world_size} x {device.type}")
    write_metrics(args.metrics_out, **metrics)
    print0(f"FINISHED {metrics['steps']} steps, final loss {metrics['final_loss']:.4f}")
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
