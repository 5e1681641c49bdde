# Exercise for lesson 05: complete the numbered TODOs. (This file is generated from
# solutions/05_pipeline_parallel.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 05: pipeline parallelism. The model's blocks cut into stages, one per rank, micro-batches streamed through.

Rank r holds stage r: a contiguous slice of model.blocks (the embeddings on the first stage, the final norm, the
head and the loss on the last). Each batch is split into --microbatches micro-batches; activations travel forward
from rank to rank and their gradients backward. A schedule says in which order each rank runs its forwards (F) and
backwards (B): GPipe (all F, then all B) or 1F1B (a few F, then one F one B, then the remaining B). Gradients add
up over the micro-batches and the optimizer steps once per batch, so p stages with m micro-batches train like one
process on the whole batch (lesson 00), to float32 rounding: the gradients add up in another order. The number
of stages is the world size (twice it, interleaved).
The built-in zero-bubble schedules (interleaved-zb, zbv) also split each backward into the input's gradient (B),
which the previous stage waits for, and the weights' gradient (W), which can wait and fill the idle time.

    torchrun --nproc_per_node=4 exercises/05_pipeline_parallel.py --n-layers 4 --schedule 1f1b --microbatches 8
    torchrun --nproc_per_node=2 exercises/05_pipeline_parallel.py --pp-impl builtin --schedule interleaved --n-layers 4
    torchrun --nproc_per_node=2 exercises/05_pipeline_parallel.py --pp-impl builtin --schedule zbv --n-layers 4
    sbatch slurm/05_pipeline_parallel_2nodes.sbatch solutions --n-layers 8     # 8 stages on 2 nodes x 4 GPUs
"""

import argparse
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from utils.course.faults import crash_before_backward
from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, destroy_process_group, print0, run_main, save0, setup
from utils.gather import checksum, gather_stages
from utils.lesson_05.plumbing import check_stages, refuse_layout, report, schedule_order, summarise
from utils.lesson_05.timing import bubble_sweep, now, record_builtin_timings
from utils.metrics import SavedActivations, state_bytes, write_metrics
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
    positive_int,
)

# The built-in schedules, by their classes in torch.distributed.pipelining. The last three are built-in only and put
# two stages on each rank; the zero-bubble ones (ZB) split the backward into B (input) and W (weights).
BUILTIN_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
SCHEDULES = tuple(BUILTIN_SCHEDULES)
MULTI_STAGE = ("interleaved", "interleaved-zb", "zbv")
ZERO_BUBBLE = ("interleaved-zb", "zbv")  # no closed-form bubble: it depends on the times of F, B and W
VIRTUAL_STAGES = 2  # stages per rank in the multi-stage schedules


def stage_indices(schedule: str, rank: int, world_size: int) -> list[int]:
    """The stages rank r holds: r; with two per rank, r and r + p (a loop), or r and 2p - 1 - r (ZBV's "V": the
    first rank holds the first and the last stage, so the loss's gradient turns back on the rank that has it)."""
    if schedule not in MULTI_STAGE:
        return [rank]
    return [rank, 2 * world_size - 1 - rank] if schedule == "zbv" else [rank, rank + world_size]


# --------------------------------------------------------------------------------------------------
# Partition: which blocks each stage holds
# --------------------------------------------------------------------------------------------------


def partition(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Block ranges [start, end) of each stage: contiguous, covering every block, sizes differing by at most one."""
    check_stages(n_layers, n_stages)  # refuses more stages than blocks
    # TODO 1: balanced partition. Return every stage's range of blocks: together they cover the model in order,
    #   and no stage has two blocks more than another. The slowest stage sets the pace of the whole pipeline.
    raise NotImplementedError("TODO 1: balanced partition")


class Stage(nn.Module):
    """One pipeline stage: some of the model's modules, under the names they have in the full model.

    Keeping the names ("blocks.3.mlp.up_proj.weight") lets the stages' state dicts merge back into the full
    model's, and the checksum compare with one process, parameter by parameter.
    """

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.token_embedding = model.token_embedding if first else None
        self.position_embedding = model.position_embedding if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: tokens [mb, T] -> activations; others: activations [mb, T, dim]; the last returns logits."""
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.norm(x))
        return x


def build_stage(model: nn.Module, stage_index: int, n_stages: int) -> Stage:
    """Stage `stage_index` of `n_stages`, sharing its modules with `model` (built from the seed on the CPU)."""
    start, end = partition(len(model.blocks), n_stages)[stage_index]
    return Stage(model, range(start, end), first=stage_index == 0, last=stage_index == n_stages - 1)


# --------------------------------------------------------------------------------------------------
# Schedules: the steps each rank runs, as lists of ("F", micro-batch) and ("B", micro-batch)
# --------------------------------------------------------------------------------------------------


def gpipe_steps(n_stages: int, n_microbatches: int, rank: int) -> list[tuple[str, int]]:
    """GPipe: every forward, then every backward (micro-batches in order 0, 1, ..., m - 1 both times)."""
    # TODO 2: the GPipe schedule. This rank's list of ("F", micro-batch) and ("B", micro-batch) steps: nothing
    #   flows backward until every micro-batch has gone forward.
    raise NotImplementedError("TODO 2: the GPipe schedule")


def one_f_one_b_steps(n_stages: int, n_microbatches: int, rank: int) -> list[tuple[str, int]]:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    # TODO 3: the 1F1B schedule. Each rank runs a backward as soon as one can arrive, so it holds at most
    #   p - r micro-batches' activations; same steps as GPipe, another order.
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
    """The bubble as a fraction of the step: (p - 1) / (v m + p - 1), v = stages per rank (1 for GPipe and 1F1B)."""
    return (n_stages - 1) / (virtual_stages * n_microbatches + n_stages - 1)


def in_flight(steps: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward is done and backward is not, at any point of a step list."""
    held = most = 0
    for kind, _ in steps:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


# --------------------------------------------------------------------------------------------------
# Communication: which tensors each rank sends and receives before each step
# --------------------------------------------------------------------------------------------------


def p2p_plan(steps: list[tuple[str, int]], rank: int, n_stages: int) -> list[list[tuple[str, int, str, int]]]:
    """The communication before each step, as len(steps) + 1 batches of (op, peer, what, micro-batch).

    Batch i holds the sends of step i - 1's result and the receive step i needs; the engine posts a batch with
    one batch_isend_irecv and waits for it. Posting a send together with the next receive is what keeps
    neighbours from waiting for each other (rank r sending an activation to r + 1 while r + 1 sends a gradient
    to r): with NCCL a send can block until its receive is posted. `naive_p2p_plan` shows the deadlock.
    """
    previous = rank - 1 if rank > 0 else None
    following = rank + 1 if rank < n_stages - 1 else None
    batches: list[list] = [[] for _ in range(len(steps) + 1)]
    # TODO 4: the point-to-point plan. Fill the batches: what each step needs arrives in the batch posted before
    #   it, what it produced leaves in the next one. Activations go forward, gradients backward; the end stages
    #   lack a neighbour.
    raise NotImplementedError("TODO 4: the point-to-point plan")
    return batches


def naive_p2p_plan(steps: list[tuple[str, int]], rank: int, n_stages: int) -> list[list[tuple[str, int, str, int]]]:
    """The plan as one first writes it, one blocking operation at a time: receive, compute, send.

    Under 1F1B, rank r sends activation i + 1 (waiting for r + 1 to receive it) while r + 1 sends gradient i
    (waiting for r to receive it): both wait forever. utils.lesson_05.timing.rendezvous_completes shows it."""
    batches = []
    for batch in p2p_plan(steps, rank, n_stages):  # the same operations, each in a batch of its own, sends first
        batches += [[operation] for operation in sorted(batch, key=lambda operation: operation[0] != "send")]
    return batches


# --------------------------------------------------------------------------------------------------
# The engine: one micro-batch's forward and backward on a stage, and the loop that runs a step list
# --------------------------------------------------------------------------------------------------


def forward_step(stage: Stage, x: torch.Tensor, target: torch.Tensor | None, n_microbatches: int):
    """One micro-batch's forward on this stage. x: the tokens on the first stage, else the activation received
    from the previous stage; target: the micro-batch's targets on the last stage, else None.
    Returns (the stage's input, kept for the backward; its output: the activation to send, or on the last stage
    the micro-batch's loss)."""
    # TODO 5: one micro-batch's forward. A received activation must collect the gradient that goes back to the
    #   previous stage; the last stage returns this micro-batch's share of the batch's mean loss, so the
    #   micro-batches' gradients add up to the batch's.
    raise NotImplementedError("TODO 5: one micro-batch's forward")


def backward_step(stage_input: torch.Tensor, output: torch.Tensor, output_gradient: torch.Tensor | None):
    """One micro-batch's backward on this stage, from what its forward returned. output_gradient: the gradient
    received from the next stage (None on the last stage, whose output is the loss). Returns the gradient of the
    stage's input, to send to the previous stage (None on the first stage, whose input is tokens)."""
    # TODO 6: one micro-batch's backward. Backpropagate from this stage's output as if the next stage's loss were
    #   attached; the parameters' gradients add up over the micro-batches. Return what the previous stage needs.
    raise NotImplementedError("TODO 6: one micro-batch's backward")


def exchange(batch, buffers: dict, shape, device: torch.device):
    """Post one batch of the plan with a single batch_isend_irecv and wait for all of it. A receive allocates its
    buffer (shapes are known in advance) under buffers[(what, mb)]; a send takes its tensor from there."""
    ops = []
    for op, peer, what, mb in batch:
        if op == "recv":
            buffers[(what, mb)] = torch.empty(shape, device=device)
            ops.append(dist.P2POp(dist.irecv, buffers[(what, mb)], peer))
        else:
            ops.append(dist.P2POp(dist.isend, buffers.pop((what, mb)), peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def run_steps(stage, steps, *, rank, n_stages, inputs, targets, activation_shape, device, saved=None, post=exchange):
    """Run one batch's step list on this rank. `inputs` (first stage) and `targets` (last stage) are lists of
    micro-batches; `post` posts a batch of the plan and waits for it (the lab wraps `exchange` to see where a rank
    waits). Returns (losses of the micro-batches on the last stage, timeline [(kind, mb, start, end, stage)],
    bytes one micro-batch's forward leaves saved for backward, measured when `saved` is given)."""
    n_microbatches = len(steps) // 2
    kept: dict[int, tuple] = {}  # micro-batch -> (stage input, output), from its forward to its backward
    buffers: dict[tuple[str, int], torch.Tensor] = {}  # received tensors and tensors to send
    losses, timeline, microbatch_bytes = [], [], None
    plan = p2p_plan(steps, rank, n_stages)
    t0 = time.perf_counter()
    for i, (kind, mb) in enumerate(steps):
        post(plan[i], buffers, activation_shape, device)
        start = now(device)
        if kind == "F":
            before = saved.current_bytes if saved is not None else 0
            x = inputs[mb] if stage.first else buffers.pop(("activation", mb))
            kept[mb] = forward_step(stage, x, targets[mb] if stage.last else None, n_microbatches)
            output = kept[mb][1].detach()
            if stage.last:
                losses.append(output)
            else:
                buffers[("activation", mb)] = output
            if saved is not None and microbatch_bytes is None:
                microbatch_bytes = saved.current_bytes - before
        else:
            gradient = backward_step(*kept.pop(mb), None if stage.last else buffers.pop(("gradient", mb)))
            if not stage.first:
                buffers[("gradient", mb)] = gradient
        timeline.append((kind, mb, start - t0, now(device) - t0, rank))
    post(plan[-1], buffers, activation_shape, device)  # the last step's send
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
    from torch.distributed import pipelining

    built_in = getattr(pipelining, BUILTIN_SCHEDULES[schedule])  # e.g. pipelining.Schedule1F1B
    # TODO 7: the built-in pipeline. Wrap this rank's stage modules in PipelineStage objects of the pipeline's
    #   process group and return the built-in schedule that runs them; it averages the micro-batches' gradients
    #   itself.
    raise NotImplementedError("TODO 7: the built-in pipeline")


# --------------------------------------------------------------------------------------------------
# Training: build this rank's part of the pipeline, run its steps, summarise
# --------------------------------------------------------------------------------------------------


def check_layout(args, world_size: int):
    """Refuse what cannot run, with one line each, before any process waits for another (utils.lesson_05.plumbing)."""
    builtin = BUILTIN_SCHEDULES[args.schedule] if args.pp_impl == "builtin" else None
    refuse_layout(args, world_size, args.schedule in MULTI_STAGE, VIRTUAL_STAGES, builtin)


@dataclass
class Pipeline:
    """What one rank runs: its stage module(s) and its schedule, from scratch (a step list) or built-in."""

    modules: list[Stage]  # this rank's stages: one, or two with the multi-stage schedules
    indices: list[int]  # their stage numbers (stage_indices)
    n_stages: int
    schedule: str
    n_microbatches: int
    activation_shape: tuple[int, int, int]  # what travels between stages: [micro-batch, seq_len, dim]
    steps: list | None = None  # from scratch: this rank's step list
    builtin: object = None  # built-in: the torch.distributed.pipelining schedule
    timeline: list | None = None  # built-in: filled by the timing hooks during a step
    origin: list | None = None  # built-in: the step's start time, which the timing hooks read

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.indices


def build_pipeline(args, rank: int, world_size: int, device: torch.device, schedule: str, n_microbatches: int):
    """This rank's stage(s), on the device, and the schedule that runs them. Returns (pipeline, the full model's
    parameter shapes in its order)."""
    model = build_model(model_config(args), seed=args.seed)  # on the CPU: every rank builds the same weights...
    shapes = {name: p.shape for name, p in model.named_parameters()}
    indices = stage_indices(schedule, rank, world_size)
    n_stages = len(indices) * world_size
    modules = [build_stage(model, index, n_stages).to(device) for index in indices]  # ...the device gets its stage
    del model  # what this rank's stages do not hold is freed
    held = {r: [i for i in range(n_stages) if i % world_size == r] for r in range(world_size)}
    print0(f"stages per rank {held}, blocks per stage {partition(args.n_layers, n_stages)}")
    shape = (args.batch_size // n_microbatches, args.seq_len, args.dim)
    pipeline = Pipeline(modules, indices, n_stages, schedule, n_microbatches, shape)
    if args.pp_impl == "scratch":
        pipeline.steps = SCRATCH_SCHEDULES[schedule](world_size, n_microbatches, rank)
        return pipeline, shapes
    try:
        pipeline.builtin = build_builtin_schedule(
            modules, indices, n_stages, dist.group.WORLD, device, schedule, n_microbatches, loss_fn
        )
    except ValueError as error:  # e.g. 1F1B with fewer micro-batches than stages
        raise CourseError(f"torch.distributed.pipelining refuses --schedule {schedule}: {error}") from None
    pipeline.timeline, pipeline.origin = [], [0.0]
    if not record_builtin_timings(pipeline.builtin, pipeline.timeline, pipeline.origin, device):
        pipeline.timeline = None
    return pipeline, shapes


def train_step(pipeline: Pipeline, inputs, targets, *, rank, world_size, device, saved=None):
    """One batch through the pipeline (forward and backward, no optimizer step). Returns (the batch's mean loss
    on the last stage, else 0; this rank's timeline or None; one micro-batch's saved bytes or None)."""
    m = pipeline.n_microbatches
    if pipeline.builtin is not None:
        losses = []
        if pipeline.timeline is not None:
            pipeline.timeline.clear()
        pipeline.origin[0] = time.perf_counter()
        pipeline.builtin.step(
            *((inputs,) if pipeline.first else ()), **({"target": targets, "losses": losses} if pipeline.last else {})
        )
        loss = torch.stack(losses).mean() if pipeline.last else torch.zeros((), device=device)
        timeline = sorted(pipeline.timeline, key=lambda entry: entry[2]) if pipeline.timeline is not None else None
        return loss, timeline, None
    # Each micro-batch its own copy: micro-batches must not share storage (saved-bytes accounting).
    micro_inputs = [chunk.clone() for chunk in inputs.chunk(m)] if pipeline.first else None
    micro_targets = [chunk.clone() for chunk in targets.chunk(m)] if pipeline.last else None
    losses, timeline, microbatch_bytes = run_steps(
        pipeline.modules[0], pipeline.steps, rank=rank, n_stages=world_size, inputs=micro_inputs,
        targets=micro_targets, activation_shape=pipeline.activation_shape, device=device, saved=saved,
    )  # fmt: skip
    loss = torch.stack(losses).sum() if pipeline.last else torch.zeros((), device=device)
    return loss, timeline, microbatch_bytes


def train(args, rank: int, world_size: int, device: torch.device, schedule: str, n_microbatches: int) -> dict:
    """Train --steps steps with one pipeline layout; return the metrics (the same dict on every rank)."""
    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, what="pipeline")  # every stage reads the same batches
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    pipeline, shapes = build_pipeline(args, rank, world_size, device, schedule, n_microbatches)
    params = [p for module in pipeline.modules for p in module.parameters()]
    optimizer = build_optimizer(params, args)
    logger, throughput = Logger(args, total_steps=args.steps), Throughput(device)
    losses, timelines, peak, microbatch_bytes = [], [], None, None
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches(loader)):
        optimizer.zero_grad(set_to_none=True)
        # Every rank starts the schedule together, so the timelines share one origin. (With NCCL, a collective
        # before the first batch_isend_irecv also lets that call involve only some ranks of the group.)
        dist.barrier()
        if step == args.crash_at_step and rank == world_size - 1:  # tests only: a rank dies mid-schedule
            crash_before_backward(pipeline.modules[-1], rank)
        # Activation bytes are counted in the first step only: the hooks run on every saved tensor and cost time.
        with SavedActivations(exclude=params) if step == 1 else nullcontext() as saved:
            loss, timeline, bytes_one = train_step(
                pipeline, inputs.to(device), targets.to(device), rank=rank, world_size=world_size, device=device,
                saved=saved,
            )  # fmt: skip
        if saved is not None:
            peak, microbatch_bytes = saved.peak_bytes, bytes_one
        optimizer.step()
        timelines.append(timeline)
        # The last stage computed the loss (on rank 0 with ZBV's V): everyone logs it.
        last = next(r for r in range(world_size) if pipeline.n_stages - 1 in stage_indices(schedule, r, world_size))
        dist.broadcast(loss, src=last)
        losses.append(loss.item())
        throughput.step(inputs.numel())
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    # Every stage's parameters, gathered under the full model's names and in its order (asserted: each once).
    full_state = gather_stages(
        {name: p for module in pipeline.modules for name, p in module.named_parameters()}, shapes
    )
    if args.checkpoint:
        save0({"model": full_state, "config": vars(model_config(args))}, args.checkpoint)
        print0(f"saved the model to {args.checkpoint}")
    m, scratch = pipeline.n_microbatches, pipeline.steps is not None
    metrics = summarise(
        world_size, losses, timelines, peak, microbatch_bytes,
        in_flight=in_flight(pipeline.steps) if scratch else None,
        bubble_predicted=None if schedule in ZERO_BUBBLE else predicted_bubble(world_size, m, len(pipeline.indices)),
        bubble_from_steps=float(simulate(schedule, world_size, m)[1]) if scratch else None,
    )  # fmt: skip
    metrics.update(
        schedule=schedule,
        microbatches=m,
        stages=pipeline.n_stages,
        stages_per_rank=len(pipeline.indices),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum(full_state.values()),  # as utils.metrics.param_checksum on one process
        bytes_per_rank=state_bytes(nn.ModuleList(pipeline.modules), optimizer),
        optimizer=args.optimizer,
        dataset=args.dataset,
        pp_impl=args.pp_impl,
        partition=partition(args.n_layers, pipeline.n_stages),
        schedule_order=schedule_order(pipeline.builtin),  # built-in: torch's order of F, I, W, B on every rank
    )
    del optimizer, params, pipeline
    return metrics


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is checked in fp32
    parser.add_argument("--pp-impl", choices=["scratch", "builtin"], default="scratch", help="which pipeline")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="gpipe and 1f1b: both --pp-impl")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per --batch-size batch")
    sweep_help = (
        "measure the bubble of GPipe and 1F1B at m = 1, 2, 4, 8 micro-batches of --batch-size sequences each "
        "(the batch grows with m) and add the results to this JSON file"
    )
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
        run = lambda sweep_args, schedule, m: train(sweep_args, rank, world_size, device, schedule, m)  # noqa: E731
        metrics = bubble_sweep(run, args, rank, world_size, device, args.bubble_sweep)
    else:
        metrics = train(args, rank, world_size, device, args.schedule, args.microbatches)
    report(metrics, world_size, device)
    write_metrics(args.metrics_out, **metrics)
    print0(f"FINISHED {metrics['steps']} steps, final loss {metrics['final_loss']:.4f}")
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: a schedule that deadlocks (TODO 8; notebook section 8, `make check LESSON=05`)
# --------------------------------------------------------------------------------------------------


def capped_warmup(n_stages: int, n_microbatches: int, rank: int, max_in_flight: int) -> int:
    """1F1B's warm-up forwards on `rank` when the first stage may hold at most `max_in_flight` micro-batches'
    activations (1F1B gives it p: with the embeddings too, it is the first to run out of memory).
    utils/lesson_05/lab.py builds each rank's 1F1B step list from it and runs them on live ranks."""
    # TODO 8: lab, a schedule that deadlocks. In the exercise only the first stage's warm-up is capped, and a
    #   4-stage run hangs. Which rank waits for which tensor, from whom, and when would that rank send it? Fix
    #   it so that no rank waits forever, rank 0 holds at most the cap, and every rank warms up as much as it
    #   can (fewer forwards idle the pipeline).
    warmup = min(n_microbatches, n_stages - rank - 1)  # 1F1B's warm-up (TODO 3)
    if rank == 0:  # the first stage holds the most activations: cap it
        warmup = min(warmup, max_in_flight - 1)
    return warmup


if __name__ == "__main__":
    run_main(main)
