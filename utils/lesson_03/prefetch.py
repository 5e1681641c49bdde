"""FSDP2's prefetching, timed (lesson 03's section on overlap): in one training step, when each unit's all-gather
is issued and when it returns, and when each block's forward and backward compute start and end.

    torchrun --nproc_per_node=2 utils/lesson_03/prefetch.py --metrics-out out.json

The lesson's FSDP2 model (`fully_shard` on each block, then on the root) trains one step in three ways:

- "none": nothing prefetched; each block is gathered when its own forward, and its own backward, begins;
- "default": FSDP2 as the lesson calls it: forward as "none", but backward prefetches the block before
  (FSDP2 does that by default, following the reverse of the forward order);
- "explicit": `block[i].set_modules_to_forward_prefetch([block[i + 1]])` and
  `block[i].set_modules_to_backward_prefetch([block[i - 1]])`: each block issues its neighbour's all-gather
  as soon as its own parameters are ready, before its own compute.

FSDP2 has no switch that turns its backward default off: an explicit list replaces the default, so "none" names
each unit itself (already gathered when its backward starts: nothing to do).

How it is timed: torch.profiler. FSDP2 labels its own steps with the unit they belong to ("FSDP::all_gather
(blocks.1)", "FSDP::post_backward_reduce (blocks.1)"), so the trace says which unit each collective belongs to
without our guessing from the order or the sizes; module hooks add marks for each block's compute to the same
trace, so every time comes from one clock. Rank 0 writes every rank's timeline to --metrics-out. CPU and gloo even
on a GPU node (the notebook's outputs are CPU runs). There FSDP2 calls its all-gathers with async_op=False, which on
gloo returns when the data has arrived: each bar is the call, issue to completion. (On a GPU the same call returns
at once, the collective running on a stream of its own, which is what lets it overlap the compute.)
"""

import argparse
import json
import os
import re
import sys
import warnings
from functools import partial
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: setup() then picks gloo and the CPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torchrun: `import utils` from the course folder
    sys.path.insert(0, str(ROOT))

from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group, setup  # noqa: E402
from utils.model import ModelConfig, build_model, loss_fn  # noqa: E402

CONFIG = ModelConfig(seq_len=32, dim=27, n_heads=3, n_layers=3)  # the notebook's model
SEED, GLOBAL_BATCH, STEPS = 1, 8, 2  # the second step is timed: the first also sets FSDP2 up
MODES = {
    "none": "no prefetching",
    "default": "FSDP2's default (backward prefetches the block before)",
    "explicit": "explicit prefetching (block i+1 in forward, block i-1 in backward)",
}
MARK = "lesson03::"  # the prefix of this file's own marks in the trace
FSDP_SPANS = {"FSDP::all_gather": "gather", "FSDP::post_backward_reduce": "reduce-scatter"}


def shard(model, mesh):
    """The lesson's own apply_fsdp (solutions/03_zero_fsdp.py): each block a unit, then the root."""
    return lesson("03").apply_fsdp(model, mesh)


def set_prefetching(model, mode: str):
    blocks = list(model.blocks)
    if mode == "explicit":
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])  # the next block, if any
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i > 0 else [])  # the block before
        model.set_modules_to_backward_prefetch(blocks[-1:])  # backward starts at the root, then the last block
    elif mode == "none":
        for unit in [model, *blocks]:
            unit.set_modules_to_backward_prefetch([unit])  # replaces the default; itself: already gathered


def mark(event: str, unit: str):
    """An instant in the profiler's trace: `lesson03::forward_start (blocks.1)`."""
    with record_function(f"{MARK}{event} ({unit})"):
        pass


def _on_gradient(event, unit, _grad):
    mark(event, unit)  # returns None: the gradient goes on unchanged


def add_compute_marks(model):
    """Hooks around each block's compute, placed against FSDP2's own hooks:

    - forward start: a forward pre-hook added after fully_shard runs after FSDP2's (prepended) one, i.e. after
      this block's all-gather and the prefetches it issues;
    - forward end: a forward hook prepended to run before FSDP2's post-forward, which frees the gathered weights;
    - backward start: a hook on the block's output, added after FSDP2's own (which gathers the block again);
    - backward end: a hook on the block's input, which fires once its gradient is complete, just before FSDP2's
      post-backward reduce-scatters the block's gradients."""
    for i, block in enumerate(model.blocks):
        unit = f"blocks.{i}"

        def before(module, args, unit=unit):
            mark("forward_start", unit)
            if args and torch.is_tensor(args[0]) and args[0].requires_grad:
                args[0].register_hook(partial(_on_gradient, "backward_end", unit))

        def output_hook(module, args, output, unit=unit):
            output.register_hook(partial(_on_gradient, "backward_start", unit))

        block.register_forward_pre_hook(before)
        block.register_forward_hook(lambda module, args, output, unit=unit: mark("forward_end", unit), prepend=True)
        block.register_forward_hook(output_hook)


def batch(rank: int, world_size: int, step: int):
    """This rank's slice of the global batch of `step`."""
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(100 + step))  # fmt: skip
    mine = tokens.chunk(world_size)[rank]
    return mine[:, :-1], mine[:, 1:]


def unit_of(name: str) -> str:
    found = re.search(r"\(([^)]*)\)$", name)
    return found.group(1) if found and found.group(1) else "root"  # FSDP2 names the root's spans without a unit


def timeline(events) -> list:
    """[unit, kind, start ms, end ms] from the trace: kinds "forward gather", "backward gather", "forward",
    "backward", "reduce-scatter"; time from the step's start."""
    spans, marks = [], {}
    for event in events:
        name, start, end = event.name, event.time_range.start, event.time_range.end
        if name.startswith(MARK):
            marks[name[len(MARK) :]] = start
            continue
        for label, kind in FSDP_SPANS.items():
            if name == label or name.startswith(label + " ("):
                spans.append([unit_of(name), kind, start, end])
    zero, backward = marks.pop("step_start (root)"), marks.pop("backward_start (root)")
    rows = []
    for unit, kind, start, end in spans:
        if kind == "gather":
            kind = "forward gather" if start < backward else "backward gather"
        rows.append([unit, kind, (start - zero) / 1e3, (end - zero) / 1e3])
    for i in range(CONFIG.n_layers):
        unit = f"blocks.{i}"
        for kind in ("forward", "backward"):
            start, end = marks[f"{kind}_start ({unit})"], marks[f"{kind}_end ({unit})"]
            rows.append([unit, kind, (start - zero) / 1e3, (end - zero) / 1e3])
    return sorted(rows, key=lambda row: row[2])


def timed_step(mode: str, mesh, rank: int, world_size: int) -> list:
    model = shard(build_model(CONFIG, seed=SEED), mesh)
    set_prefetching(model, mode)
    add_compute_marks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(number: int):
        inputs, targets = batch(rank, world_size, number)
        dist.barrier()  # the ranks start the step together
        mark("step_start", "root")
        loss = loss_fn(model(inputs), targets)
        mark("backward_start", "root")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for number in range(STEPS - 1):
        step(number)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        step(STEPS - 1)
    return timeline(trace.events())


# --------------------------------------------------------------------------------------------------
# Reading a timeline (on one process, from the run's record)
# --------------------------------------------------------------------------------------------------


def first(rows, unit: str, kind: str) -> list:
    return next(row for row in rows if row[0] == unit and row[1] == kind)


def prefetched(rows, n_layers: int) -> dict:
    """For each neighbouring pair of blocks, was the next block's all-gather issued before this block's compute
    ended? Forward: block i+1's gather against block i's forward, i = 0 .. L-2; backward: block i-1's gather
    against block i's backward, i = L-1 .. 1. Without prefetching each gather starts only after that."""
    forward = [first(rows, f"blocks.{i + 1}", "forward gather")[2] < first(rows, f"blocks.{i}", "forward")[3]
               for i in range(n_layers - 1)]  # fmt: skip
    backward = [first(rows, f"blocks.{i - 1}", "backward gather")[2] < first(rows, f"blocks.{i}", "backward")[3]
                for i in range(n_layers - 1, 0, -1)]  # fmt: skip
    return {"forward": forward, "backward": backward}


def main():
    # FSDP2 warns that the root returns a view (the head's output): the loss only reads it, never changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-out", type=Path, required=True)
    args = parser.parse_args()
    _, rank, device, world_size = setup(seed=0)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    found = {mode: timed_step(mode, mesh, rank, world_size) for mode in MODES}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, found)
    if rank == 0:
        record = {"world_size": world_size, "n_layers": CONFIG.n_layers, "modes": MODES}
        record["timelines"] = {mode: [ranks[mode] for ranks in everyone] for mode in MODES}
        args.metrics_out.write_text(json.dumps(record, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    main()
