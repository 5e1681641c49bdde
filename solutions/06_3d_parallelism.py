"""Lesson 06: 3D parallelism. Data, tensor and pipeline parallelism at once, on a grid of ranks.

The world's ranks form a grid pp x dp x tp. Each rank has coordinates (its pipeline stage, its data-parallel
replica, its tensor-parallel shard) and belongs to one process group per dimension: the TP group (the ranks that
split each layer of one stage), the DP group (the ranks holding the same shard of the same stage in different
replicas) and the PP group (the stages of one replica's pipeline). TP is innermost: ranks 0..tp-1 are one TP
group, on one node, where the links are fastest, because its all-reduces come several times in every layer, each
between two matrix products that wait for it. PP and DP communicate far less often and can overlap their traffic
with compute (a micro-batch's send with the next one's compute, the gradients' reduction with the backward), so
they are the ones that cross nodes. Here PP is outermost, as in Megatron-LM and torchtitan; Llama 3 put DP
outermost instead (its gradient reduction comes once a step and tolerates the longest links).

From scratch, the pieces are the course's own: lesson 04's column- and row-parallel layers on the TP group,
lesson 05's stages, schedules and point-to-point exchange between the pipeline neighbours of the grid, and
gradients averaged over the DP group. Built in: one DeviceMesh (pp, dp, tp), DTensor tensor parallelism on
mesh["tp"], FSDP2 on mesh["dp"], torch.distributed.pipelining on mesh["pp"]. Either way, dp replicas of
--batch-size sequences each, in --microbatches micro-batches, train like one process on the global batch of
dp x --batch-size sequences (compare with lesson 00).

    torchrun --nproc_per_node=8 solutions/06_3d_parallelism.py --tp 2 --pp 2 --n-layers 4          # dp = 2
    torchrun --nproc_per_node=8 solutions/06_3d_parallelism.py --tp 2 --pp 2 --impl builtin --schedule gpipe
    torchrun --nproc_per_node=4 solutions/06_3d_parallelism.py --tp 2 --pp 1                           # dp = 2
    sbatch slurm/06_3d_parallelism_2nodes.sbatch solutions       # the pipeline across 2 nodes, TP inside each
    COURSE_TIMELINE=step.json torchrun ...   # from scratch: also the last step's timeline (utils/lesson_06/timeline.py)
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from utils.course.lessons import lesson
from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, Refusal, destroy_process_group, print0, run_main, save0, setup
from utils.gather import checksum, full_parameters, gather_stages
from utils.lesson_06.measure import measure_step
from utils.lesson_06.placements import describe_placements, local_numel, output_not_a_view
from utils.lesson_06.timeline import StepTimeline
from utils.metrics import state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    batches,
    build_optimizer,
    check_batches,
    model_config,
    parameter_groups,
    parse_args,
    positive_int,
)

tensor_parallel = lesson("04")  # ColumnParallelLinear, RowParallelLinear, parallelize_scratch, apply_tensor_parallel
pipeline = lesson("05")  # partition, build_stage, the step lists, p2p_plan, forward_step, backward_step, exchange

DIMS = ("pp", "dp", "tp")  # outermost to innermost: rank = pp * (dp_size * tp_size) + dp * tp_size + tp


# --------------------------------------------------------------------------------------------------
# The rank grid: each rank's coordinates and its process group in every dimension
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The sizes of the grid's dimensions; their product is the world size."""

    pp: int
    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


def coordinates(rank: int, layout: Layout) -> dict[str, int]:
    """Rank `rank`'s place in the grid: {"pp": stage, "dp": replica, "tp": shard}."""
    # TODO 1: the coordinates of a rank. Return its stage, replica and shard. TP is innermost (consecutive ranks
    #   form a TP group, on one node), PP outermost: a rank is a number written in mixed bases.
    # HINT 1: A rank is three digits whose bases are the grid's sizes, tp the last digit. How do you read the digits
    #   of a number written in base 10, the last one first?
    # HINT 2: The tp digit is the remainder by the tp size. Divide it away (integer division) and the dp digit is the
    #   next remainder, by the dp size. What is left after dividing by dp size x tp size is the stage.
    # HINT 3: rank = pp * (dp_size * tp_size) + dp * tp_size + tp. Invert it with // and %: tp = rank % layout.tp,
    #   dp = rank // layout.tp % layout.dp, pp = rank // (layout.dp * layout.tp).
    # BEGIN SOLUTION
    return {
        "pp": rank // (layout.dp * layout.tp),
        "dp": rank // layout.tp % layout.dp,
        "tp": rank % layout.tp,
    }
    # END SOLUTION


def group_members(layout: Layout, dim: str) -> list[list[int]]:
    """Every process group of dimension `dim`, as lists of global ranks: the ranks whose coordinates differ in
    `dim` only. Groups ordered by their smallest rank, each group's ranks in ascending order (= its coordinate)."""
    # TODO 2: the groups of one dimension. Return them in the docstring's order. Two ranks share a `dim` group
    #   exactly when all their other coordinates are equal.
    # HINT 1: Two ranks of one TP group differ only in their tp coordinate. What can you compute from a rank's
    #   coordinates that is the same for every rank of its group, and different for any other group?
    # HINT 2: Walk the ranks in ascending order; key each by its coordinates in the dimensions other than `dim`;
    #   collect the ranks under their key. Walking in order keeps each group ascending and the groups ordered by
    #   their smallest rank (a dict keeps its keys in the order they first appear).
    # HINT 3: for rank in range(layout.world_size): place = coordinates(rank, layout); key = tuple(place[other] for
    #   other in DIMS if other != dim); append the rank to groups.setdefault(key, []); return the values as a list.
    # BEGIN SOLUTION
    groups: dict[tuple, list[int]] = {}
    for rank in range(layout.world_size):
        place = coordinates(rank, layout)
        key = tuple(place[other] for other in DIMS if other != dim)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
    # END SOLUTION


@dataclass
class Grid:
    """This rank's view of the grid: its coordinates, and for each dimension its process group and its ranks."""

    layout: Layout
    rank: int
    coords: dict[str, int]
    groups: dict[str, object]  # dimension -> this rank's process group
    members: dict[str, list[int]]  # dimension -> the global ranks of that group, in coordinate order


def build_grid(rank: int, layout: Layout, new_group=dist.new_group) -> Grid:
    """Create every process group of every dimension, and keep the ones this rank belongs to.

    torch requires every rank to call new_group for every group, in the same order, even for the groups it is not
    in: creating a group is a collective of the whole world (it agrees on the group's identity). A rank that only
    creates its own groups waits forever for the others. `new_group` is torch's, or a stand-in in the tests."""
    groups, members = {}, {}
    # TODO 3: the process groups. Keep this rank's group, and its ranks, in every dimension. Creating a group is a
    #   collective of the whole world: every rank creates every group, all ranks in one order.
    # HINT 1: Which groups must a rank create: only its own, or also those it is not in? And must the calls come in
    #   the same order on every rank?
    # HINT 2: Loop over the dimensions, and for each over its groups (TODO 2 lists them); call new_group for every
    #   one of them, on every rank; when this rank is among a group's ranks, keep that group's handle and its ranks
    #   under the dimension.
    # HINT 3: for dim in DIMS: for ranks in group_members(layout, dim): group = new_group(ranks); if rank in ranks:
    #   groups[dim], members[dim] = group, ranks.
    # BEGIN SOLUTION
    for dim in DIMS:
        for ranks in group_members(layout, dim):
            group = new_group(ranks)
            if rank in ranks:
                groups[dim], members[dim] = group, ranks
    # END SOLUTION
    return Grid(layout, rank, coordinates(rank, layout), groups, members)


# --------------------------------------------------------------------------------------------------
# 3D training from scratch: lesson 04's layers, lesson 05's pipeline, gradients averaged over DP
# --------------------------------------------------------------------------------------------------


def replica_batch(batch: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's share of a global batch of dp x b sequences: the b sequences of its DP replica."""
    # TODO 4: the replica's share of the batch. The dp replicas train on disjoint, equal shares that cover the batch;
    #   every rank of one replica (each stage, each TP shard) reads the same share.
    # HINT 1: Which coordinate tells the replicas apart? Why must all stages and TP shards of a replica read the same
    #   sequences (who embeds them, who needs their targets, what does TP split)?
    # HINT 2: Cut the batch along dim 0 into as many equal parts as there are replicas, and keep the part of this
    #   rank's DP coordinate. (gbs = micro-batch x micro-batches x dp.)
    # HINT 3: batch.chunk(grid.layout.dp)[grid.coords["dp"]]. Any split that gives each replica its own sequences
    #   trains the same, e.g. every dp-th sequence from this replica's index.
    # BEGIN SOLUTION
    return batch.chunk(grid.layout.dp)[grid.coords["dp"]]
    # END SOLUTION


def stage_rank(grid: Grid, stage: int) -> int:
    """The global rank that runs pipeline stage `stage` for this rank's replica and TP shard: where lesson 05's
    plan, written with stage numbers, must send an activation or a gradient."""
    # TODO 5: a pipeline neighbour's global rank. Return the rank that runs stage `stage` in this rank's own pipeline:
    #   the same replica and TP shard, since TP shard t of one stage talks to TP shard t of the next.
    # HINT 1: Lesson 05 ran one stage per rank, so a stage number was a rank. Here, which ranks form this rank's
    #   pipeline, and does the grid already know them in stage order?
    # HINT 2: This rank's PP group holds one rank per stage, all with its dp and tp coordinates, in stage order, and
    #   the grid keeps its ranks. (Or put `stage` in place of the pp coordinate in TODO 1's formula.)
    # HINT 3: the rank is grid.members["pp"][stage], which is stage * dp * tp + this rank's dp * tp + its tp.
    # BEGIN SOLUTION
    return grid.members["pp"][stage]
    # END SOLUTION


def average_gradients(parameters, group):
    """Average the gradients over the DP group (after the pipeline's backward, before the optimizer step).

    The group holds the ranks with the same stage and TP shard in every replica: the same parameters (the same
    shard of them), each with the gradient of a different part of the global batch."""
    gradients = [p.grad for p in parameters if p.grad is not None]
    # TODO 6: the data-parallel gradient average. Replace every gradient by its mean over `group`, whose ranks hold
    #   the same parameters. One collective for all of them costs less than one per parameter.
    # HINT 1: DDP (lesson 02) sums each gradient over its group and divides by the group's size. Why would you
    #   flatten every gradient into one buffer before communicating?
    # HINT 2: Concatenate the flattened gradients into one buffer; all-reduce it over the group (a sum); divide by
    #   the group's size; copy each slice back into its gradient, in place (the optimizer reads p.grad).
    # HINT 3: flat = torch.cat([g.flatten() for g in gradients]); dist.all_reduce it with group=group; divide it by
    #   dist.get_world_size(group); then for each gradient and its slice of flat.split([g.numel() for g in gradients]):
    #   gradient.copy_(slice.view_as(gradient)).
    # BEGIN SOLUTION
    flat = torch.cat([g.flatten() for g in gradients])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
        gradient.copy_(average.view_as(gradient))
    # END SOLUTION


def build_scratch(args, grid: Grid, device: torch.device):
    """This rank's stage: the whole model built from the seed, its projections sharded over the TP group with
    lesson 04's layers, then cut to this rank's pipeline stage with lesson 05's build_stage."""
    model = build_model(model_config(args), seed=args.seed)
    tensor_parallel.parallelize_scratch(model, grid.groups["tp"])
    return pipeline.build_stage(model, grid.coords["pp"], grid.layout.pp).to(device)


def pipeline_step(stage, grid: Grid, steps, inputs, targets, n_microbatches: int, shape, device) -> torch.Tensor:
    """One batch through this rank's stage, following lesson 05's step list; returns the replica's mean loss on
    the last stage (0 elsewhere). Lesson 05's plan names stages; stage_rank turns them into global ranks."""
    plan = [
        [(op, stage_rank(grid, peer), what, mb) for op, peer, what, mb in batch]
        for batch in pipeline.p2p_plan(steps, grid.coords["pp"], grid.layout.pp)
    ]
    micro_inputs, micro_targets = inputs.chunk(n_microbatches), targets.chunk(n_microbatches)
    kept, buffers, losses = {}, {}, []  # kept: micro-batch -> (stage input, output) from its forward to its backward
    for i, (kind, mb) in enumerate(steps):
        pipeline.exchange(plan[i], buffers, shape, device)
        if kind == "F":
            x = micro_inputs[mb] if stage.first else buffers.pop(("activation", mb))
            kept[mb] = pipeline.forward_step(stage, x, micro_targets[mb] if stage.last else None, n_microbatches)
            output = kept[mb][1].detach()
            if stage.last:
                losses.append(output)
            else:
                buffers[("activation", mb)] = output
        else:
            received = None if stage.last else buffers.pop(("gradient", mb))
            gradient = pipeline.backward_step(*kept.pop(mb), received)
            if not stage.first:
                buffers[("gradient", mb)] = gradient
    pipeline.exchange(plan[-1], buffers, shape, device)  # the last step's send
    return torch.stack(losses).sum() if stage.last else torch.zeros((), device=device)


# --------------------------------------------------------------------------------------------------
# The built-in: one DeviceMesh, DTensor TP on mesh["tp"], FSDP2 on mesh["dp"], pipelining on mesh["pp"]
# --------------------------------------------------------------------------------------------------


def parallelize_builtin(model, mesh, stage_index: int):
    """Lesson 04's apply_tensor_parallel on the TP sub-mesh, lesson 05's stage, FSDP2 over the DP sub-mesh.

    Under a pipeline, torch's schedules hold each stage's gradients whole until the last micro-batch's backward and
    reduce-scatter them once (PipelineStage turns FSDP2's gradient sync off until then, and keeps the parameters
    gathered after each backward). A block that reshards after forward would all-gather its parameters again before
    every micro-batch's forward: m + 1 all-gathers a step instead of one, to free memory only between a forward and
    its backward. Hence, as torchtitan does, no resharding after forward when the pipeline has more than one stage."""
    # TODO 7: the built-in composition. Return this rank's stage, tensor parallel on mesh["tp"] and sharded by FSDP2
    #   on mesh["dp"] block by block, plus a unit for the rest. Under a pipeline, each block stays gathered from its
    #   forward to its backward.
    # HINT 1: Lessons 04 and 05 each wrote their built-in as a function of (model, mesh). Which sub-mesh does each
    #   dimension use, and in what order do they apply (TP needs the whole model, FSDP the stage)? Why would
    #   resharding after forward cost more under a pipeline?
    # HINT 2: TP first, on the whole model (lesson 04's apply_tensor_parallel on the tp sub-mesh); then this rank's
    #   stage (lesson 05's build_stage, as many stages as the pp sub-mesh has ranks); then fully_shard each of the
    #   stage's blocks on the dp sub-mesh, resharding after forward only with one stage; last fully_shard the stage.
    # HINT 3: tensor_parallel.apply_tensor_parallel(model, mesh["tp"]); stage = pipeline.build_stage(model,
    #   stage_index, mesh["pp"].size()); for block in stage.blocks.values(): fully_shard(block, mesh=mesh["dp"],
    #   reshard_after_forward=mesh["pp"].size() == 1); fully_shard(stage, mesh=mesh["dp"]); return stage.
    # BEGIN SOLUTION
    tensor_parallel.apply_tensor_parallel(model, mesh["tp"])
    stage = pipeline.build_stage(model, stage_index, mesh["pp"].size())
    one_stage = mesh["pp"].size() == 1  # else each block would be gathered again for every micro-batch
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=one_stage)
    fully_shard(stage, mesh=mesh["dp"])  # the root: FSDP2 keeps its parameters from forward to backward anyway
    return stage
    # END SOLUTION


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def check_layout(args, world_size: int) -> Layout:
    """Refuse what cannot run, with one line each, before any process waits for another."""
    if world_size % (args.tp * args.pp):
        raise Refusal(
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} ranks per replica does not divide the "
            f"{world_size} processes: launch a multiple of {args.tp * args.pp} processes, or change --tp/--pp"
        )
    tensor_parallel.check_tensor_parallel_size(model_config(args), args.tp, args.seq_len, False)  # whole heads
    pipeline.partition(args.n_layers, args.pp)  # refuses more stages than blocks
    if args.batch_size % args.microbatches:
        raise Refusal(
            f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches} equal "
            f"micro-batches; use a --batch-size that is a multiple of {args.microbatches}"
        )
    if args.impl == "builtin" and args.schedule == "1f1b" and args.microbatches < args.pp:
        raise Refusal(
            f"the built-in Schedule1F1B needs --microbatches >= --pp {args.pp} (got {args.microbatches}); "
            "the from-scratch one (--impl scratch) runs any number"
        )
    return Layout(pp=args.pp, dp=world_size // (args.tp * args.pp), tp=args.tp)


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is exact
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (ranks per layer)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages; dp = world / (tp x pp)")
    parser.add_argument("--impl", choices=["scratch", "builtin"], default="scratch", help="which 3D parallelism")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="the pipeline schedule")
    parser.add_argument("--microbatches", type=positive_int, default=2, help="micro-batches per --batch-size batch")
    args = parse_args(parser)
    layout = check_layout(args, int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1))))
    timeline = StepTimeline.requested(args)  # COURSE_TIMELINE=FILE: the last step's timeline (utils), else nothing
    local_rank, rank, device, world_size = setup(args.seed)
    place = coordinates(rank, layout)
    everyone = [coordinates(r, layout) for r in range(world_size)]
    print0(
        f"{world_size} ranks = pp {layout.pp} x dp {layout.dp} x tp {layout.tp} | global batch {layout.dp} x "
        f"{args.batch_size} = {layout.dp * args.batch_size} sequences, {args.microbatches} micro-batches of "
        f"{args.batch_size // args.microbatches} per replica | --impl {args.impl} --schedule {args.schedule} | "
        f"model: {count_parameters(model_config(args)):,} parameters | device {device.type}"
    )
    print0("rank (pp, dp, tp): " + ", ".join(f"{r} {tuple(c.values())}" for r, c in enumerate(everyone)))

    # The data first: a sequence longer than the data is refused before the model (its positions too) is built.
    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, 1, per_step=layout.dp, what="global batch")
    shapes = {name: p.shape for name, p in build_model(model_config(args), seed=args.seed).named_parameters()}
    if args.impl == "scratch":
        grid = build_grid(rank, layout)
        stage = build_scratch(args, grid, device)
        tp_group, dp_group = grid.groups["tp"], grid.groups["dp"]
        steps = pipeline.SCRATCH_SCHEDULES[args.schedule](layout.pp, args.microbatches, place["pp"])
    else:
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)
        if dict(zip(DIMS, mesh.get_coordinate())) != place:
            raise CourseError(f"TODO 1: rank {rank} is {place}, but the DeviceMesh puts it at {mesh.get_coordinate()}")
        grid = Grid(layout, rank, place, groups={}, members={})  # the mesh holds the groups
        stage = parallelize_builtin(build_model(model_config(args), seed=args.seed).to(device), mesh, place["pp"])
        if stage.last:
            output_not_a_view(stage)  # the logits, else FSDP2 warns (see utils/lesson_06/placements.py)
        tp_group, dp_group = mesh["tp"].get_group(), None
        schedule = pipeline.build_builtin_schedule(
            [stage], [place["pp"]], layout.pp, mesh["pp"].get_group(), device, args.schedule, args.microbatches, loss_fn
        )
    optimizer = build_optimizer(parameter_groups(stage), args)

    generator = torch.Generator().manual_seed(args.seed)  # lesson 00's order of batches, dp x --batch-size each
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=layout.dp * args.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    shape = (args.batch_size // args.microbatches, args.seq_len, args.dim)  # what travels between stages
    logger, throughput = Logger(args, total_steps=args.steps), Throughput(device)
    losses, grad_norms = [], []
    activation_bytes = collectives = None  # per micro-batch / per rank, in the last step (None: not measured)
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches(loader)):
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # with NCCL, a collective before the first batch_isend_irecv lets it involve some ranks only
        mine, theirs = replica_batch(inputs, grid), replica_batch(targets, grid)
        # The last step: what this rank keeps for backward and the collectives it runs (utils/lesson_06/measure.py).
        # Never the built-in's first step: its schedule then also runs the stage once to learn the shapes it exchanges.
        measured = step == args.steps and (step > 1 or args.impl == "scratch")
        with measure_step(measured, count_collectives=not timeline) as seen, timeline.record(step == args.steps, grid):
            if args.impl == "scratch":
                loss = pipeline_step(stage, grid, steps, mine, theirs, args.microbatches, shape, device)
                average_gradients(stage.parameters(), dp_group)
            else:
                kept = []
                schedule.step(
                    *((mine,) if stage.first else ()), **({"target": theirs, "losses": kept} if stage.last else {})
                )  # FSDP2 averages the gradients over the DP sub-mesh in its reduce-scatter
                loss = torch.stack(kept).mean() if stage.last else torch.zeros((), device=device)
        if measured:
            activation_bytes = seen.activation_bytes // args.microbatches  # the micro-batches are the same size
            collectives = seen.collectives
        norm = global_gradient_norm(stage, place)
        grad_norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))  # a DTensor: its value
        optimizer.step()
        # Every TP shard of every replica's last stage holds its replica's loss: their mean is the global batch's.
        loss = loss / (layout.dp * layout.tp) if stage.last else loss
        dist.all_reduce(loss)
        losses.append(loss.item())
        throughput.step(inputs.numel())
        logger.log(step, loss=losses[-1], grad_norm=grad_norms[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}  gradient norm {grad_norms[-1]:.4f}")
    logger.close()

    # Every stage whole on every rank; one rank per stage sends it (its DP and TP peers hold copies of the same).
    full = gather_stages(full_parameters(stage, tp_group), shapes, send=place["dp"] == 0 and place["tp"] == 0)
    if args.checkpoint:
        save0({"model": full, "config": vars(model_config(args))}, args.checkpoint)
        print0(f"saved the full model to {args.checkpoint}")
    held: list = [None] * world_size
    dist.all_gather_object(held, state_bytes(stage, optimizer))
    activations: list = [None] * world_size  # bytes one micro-batch's forward saves for backward, per rank
    dist.all_gather_object(activations, activation_bytes)
    counted: list = [None] * world_size  # the last step's collectives, per rank: {kind: [calls, bytes]}
    dist.all_gather_object(counted, collectives)
    params_per_rank: list = [None] * world_size  # the parameters each rank holds (its shard of its stage)
    dist.all_gather_object(params_per_rank, local_numel(stage))
    fsdp = [name for name, module in stage.named_modules() if type(module).__name__.startswith("FSDP")]
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=throughput.tokens_per_s,
        param_checksum=checksum(full.values()),
        layout={"pp": layout.pp, "dp": layout.dp, "tp": layout.tp},
        coordinates=everyone,
        global_batch=layout.dp * args.batch_size,
        micro_batch=args.batch_size // args.microbatches,  # sequences per micro-batch, per replica
        microbatches=args.microbatches,
        bytes_per_rank=held,
        activation_bytes_per_rank=activations,
        collectives_last_step=counted,
        grad_norms=grad_norms,
        params_per_rank=params_per_rank,
        impl=args.impl,
        schedule=args.schedule,
        device=device.type,  # utils/report.py counts processes, not GPUs, where every run says "cpu"
        optimizer=args.optimizer,
        dataset=args.dataset,
        partition=pipeline.partition(args.n_layers, layout.pp),
        fsdp_modules=fsdp,
        placements=describe_placements(stage),
    )
    print0(f"throughput: {throughput.tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    del optimizer, stage
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: a gradient norm every rank agrees on (TODO 8; the notebook's last section, `make check LESSON=06`)
# --------------------------------------------------------------------------------------------------


def global_gradient_norm(stage, place: dict[str, int]) -> torch.Tensor:
    """The norm of the whole model's gradient, on every rank: what clip_grad_norm_ returns on one process for the
    same model and global batch (clipping then scales every rank's gradients by the same min(1, max_norm / norm)).
    `stage` is this rank's stage after the step's backward (from scratch, after the DP average too): lesson 04's
    TP shards carry a `tp_dim`; built in, the gradients are DTensors. `place` is this rank's coordinates.
    utils/lesson_06/lab.py runs it on live ranks, in four layouts."""
    # TODO 8: lab, a gradient norm every rank agrees on. Every rank logs the same norm, without an error, yet it is
    #   larger than one process's clip_grad_norm_ on the same model and batch, by a factor that changes with the
    #   layout. Make every layout report one process's norm.
    # HINT 1: Take one element of a parameter TP keeps whole (a norm's weight), and one of a TP shard: on how many
    #   ranks does each sit, and how many times does the exercise add its square? And a DP replica's copy?
    # HINT 2: Add the squares of a piece replicated over a dimension on one rank of that dimension only (coordinate
    #   0): a parameter TP keeps whole over tp; from scratch every parameter over dp (the replicas hold copies after
    #   the average). Add a piece sharded over a dimension on every rank of it: a TP shard (it has a `tp_dim`); built
    #   in, whatever a DTensor gradient's placements do not replicate (FSDP2 shards every parameter over dp; a
    #   dimension its mesh lacks holds copies: FSDP2 puts the parameters TP keeps whole on the dp mesh alone). Then
    #   one all-reduce over the world adds the stages and the shards.
    # HINT 3: for each p with a grad: copies = {"dp", "tp"}, less "tp" if hasattr(p, "tp_dim"); for a DTensor grad,
    #   less every name of p.grad.device_mesh.mesh_dim_names whose placement in p.grad.placements is not
    #   is_replicate() (not is_shard(): FSDP2 over a TP shard uses a strided shard, which is_shard() does not count);
    #   if place[dim] == 0 for every dim in copies, add (p.grad.to_local() for a DTensor) .double().pow(2).sum();
    #   then dist.all_reduce the sum and return its sqrt().
    # BEGIN SOLUTION
    squares = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)
    for p in stage.parameters():
        if p.grad is None:
            continue
        copies = {"dp", "tp"} - ({"tp"} if hasattr(p, "tp_dim") else set())  # dimensions it is replicated over
        if isinstance(p.grad, DTensor):  # built in: a placement per dimension of its mesh (FSDP2's and TP's)
            names = p.grad.device_mesh.mesh_dim_names
            copies -= {dim for dim, placement in zip(names, p.grad.placements) if not placement.is_replicate()}
        if all(place[dim] == 0 for dim in copies):  # one copy of each replicated piece
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            squares += local.double().pow(2).sum()
    dist.all_reduce(squares)  # the other copies add zero: this sums the stages and the shards
    return squares.sqrt()
    # EXERCISE
    # squares = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)
    # for p in stage.parameters():
    #     if p.grad is not None:  # what this rank holds: its stage, its shard of it
    #         local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    #         squares += local.double().pow(2).sum()
    # dist.all_reduce(squares)  # every rank's squares added up: the stages and the shards
    # return squares.sqrt()
    # END SOLUTION


if __name__ == "__main__":
    run_main(main)
