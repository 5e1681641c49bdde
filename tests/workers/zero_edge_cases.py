"""Each TODO of lesson 03's hand-written ZeRO on its own, then each stage against one process, on an awkward model.

    torchrun --nproc_per_node=3 tests/workers/zero_edge_cases.py LESSON_SCRIPT OUT.json

The model has what the course's Transformer lacks: sizes that do not divide by the world size (padding),
a parameter that does not require grad, a parameter unused in every step, a block never called, and a
layer shared by two blocks (tied parameters). The checks call the lesson's pieces directly, so that each
TODO is checked as soon as it is written, without the TODOs after it:

- todo1: ZeroOptimizer's shards: the ranks' [lo, hi) tile each bucket, S = ceil(numel / N), inner optimizer sizes
- todo4: Zero3's gather() gives the parameters exactly, in fp32 and in bf16 (the compute dtype)
- todo5: reduce_gradients() returns this rank's slice of the average (fp32, also from bf16 gradients) and frees
- todo6: one step's schedule: what is gathered after forward, all-gather bytes per unit, with and without
  reshard_after_forward; and the most bytes gathered at once during backward (a freeing check for TODO 5)
- zero3, zero2 (one bucket per parameter), zero1: 3 SGD steps against one process

Every check runs on its own (a check stopped at an unfinished TODO says so); rank 0 writes the outcomes to
OUT.json after each check, so a check that hangs (a mistake that crashes one rank only) leaves the others'.
The model and the inputs live on the rank's device (CPU with gloo, the GPU with NCCL).
"""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn

from tests.harness.blame import describe
from utils.course.lessons import load_script
from utils.distributed_utils import destroy_process_group, run_main, setup
from utils.gather import full_parameters

STEPS, BATCH_PER_RANK, LR = 3, 2, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 7)
        self.unused = nn.Linear(7, 7)  # never called: its gradient is always missing
        self.shared = nn.Linear(7, 7)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) + 0.5 * self.shared(x)


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])  # the third is never called
        self.blocks[1].shared = self.blocks[0].shared  # tied: one layer in two blocks
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        x = self.frozen(self.embed(x))
        for block in self.blocks[:2]:
            x = block(x)
        return self.head(x)


def build(device, seed=0):
    torch.manual_seed(seed)
    return Awkward().to(device)


def outcome(check, *args) -> dict:
    """Run one check; its result, or why it stopped (an unfinished TODO, or the error and where it happened)."""
    try:
        return check(*args)
    except NotImplementedError as error:
        return {"not_done": str(error)}
    except Exception as error:  # a learner's mistake: report it, go on with the other checks
        return {"error": describe(error)}


def check_shards(lesson, device, world_size):
    """TODO 1: each bucket's [lo, hi) on every rank, as built."""
    report = {}
    for label, kwargs in (("zero1", {}), ("zero2_buckets", {"shard_gradients": True, "bucket_cap_mb": 1e-4})):
        params = [p for p in build(device).parameters() if p.requires_grad]
        optimizer = lesson.ZeroOptimizer(params, torch.optim.SGD, lr=LR, **kwargs)
        inner = [p.numel() for group in optimizer.optimizer.param_groups for p in group["params"]]
        mine = [(f["flat"].numel(), f["shard_numel"], f["lo"], f["hi"]) for f in optimizer.flats]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, {"buckets": mine, "inner": inner})
        problems = []
        for i, (numel, _, _, _) in enumerate(mine):
            expected_s = math.ceil(numel / world_size)
            ranges = [ranks["buckets"][i][2:] for ranks in everyone]
            tiles = [(min(r * expected_s, numel), min((r + 1) * expected_s, numel)) for r in range(world_size)]
            if [tuple(r) for r in ranges] != tiles:
                problems.append(
                    f"a bucket of {numel} elements: ranks own {ranges}, expected {tiles} (S = {expected_s})"
                )
            if any(ranks["buckets"][i][1] != expected_s for ranks in everyone):
                problems.append(f"a bucket of {numel} elements: S = {everyone[0]['buckets'][i][1]}, not {expected_s}")
            if any(ranks["inner"][i] != hi - lo for ranks, (lo, hi) in zip(everyone, ranges)):
                problems.append(f"the inner optimizer does not step the slice [lo, hi) of a bucket of {numel}")
        report[label] = {"problems": problems[:3], "buckets": len(mine)}
    return report


def check_gather(lesson, device):
    """TODO 4: gather() fills each unit's buffer with the parameters, in the compute dtype."""
    report = {}
    reference = dict(build(device).named_parameters())
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = lesson.Zero3(build(device), compute_dtype=dtype)
        worst = 0.0
        for unit, names in zip(model.units, model.names):
            unit.gather()
            for view, qualified in zip(unit.views(), names):
                expected = reference[qualified[0]].detach().to(view.dtype)
                worst = max(worst, float((view.float() - expected.float()).abs().max()))
            report[f"{label}_dtype"] = str(unit.full.dtype)
            unit.free()
        report[f"{label}_max_difference"] = worst
    return report


def check_reduce(lesson, device, rank, world_size):
    """TODO 5: reduce_gradients() -> this rank's slice of the average over ranks, in fp32; the unit is freed."""
    report = {}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = lesson.Zero3(build(device), compute_dtype=dtype)
        unit = model.units[0]
        generator = torch.Generator().manual_seed(7)
        base = [torch.randn(shape, generator=generator).to(device) for shape in unit.shapes]
        grads = [(rank + 1) * g for g in base]
        grads[-1] = None  # an unused parameter: its gradient counts as zeros
        grads = [None if g is None else g.to(unit.full.dtype) for g in grads]
        expected = torch.zeros(unit.shard_numel * world_size, device=device)
        offset = 0
        for g, shape in zip(base, unit.shapes):
            numel = math.prod(shape)
            if g is not base[-1]:  # each rank's gradient as that rank made it (rounded to the compute dtype)
                mean = sum(((r + 1) * g).to(unit.full.dtype).float() for r in range(world_size)) / world_size
                expected[offset : offset + numel] = mean.reshape(-1)
            offset += numel
        unit.gathered = True  # as after a gather: reduce_gradients must free it
        unit.awaiting_gradients = True  # as during backward: once reduced, the unit awaits no more gradients
        got = unit.reduce_gradients(grads)
        mine = expected[rank * unit.shard_numel : (rank + 1) * unit.shard_numel]
        report[label] = {
            "dtype": str(got.dtype),
            "shape": list(got.shape),
            "expected_shape": [unit.shard_numel],
            "max_difference": float((got.float() - mine).abs().max()) if got.shape == mine.shape else None,
            "freed": not unit.gathered and unit.full.untyped_storage().nbytes() == 0,
            "still_awaiting": bool(unit.awaiting_gradients),
        }
    return report


def check_schedule(lesson, device, world_size, batches, mine):
    """TODO 6: what one step gathers and frees, with and without reshard_after_forward."""
    report = {}
    for reshard in (True, False):
        model = lesson.Zero3(build(device), reshard_after_forward=reshard)
        unit_of = {unit.module: unit for unit in model.units}
        blocks = [unit_of[b] for b in model.module.blocks[:2] if b in unit_of]  # the third block never runs
        full = {id(u): u.full.numel() * u.full.element_size() for u in model.units}
        x, y = batches[0]
        before = lesson.WIRE["all_gather"]
        loss = nn.functional.mse_loss(model(x[mine].to(device)), y[mine].to(device))
        after_forward = model.gathered_bytes()
        gathered_in_forward = lesson.WIRE["all_gather"] - before
        loss.backward()
        root = full[id(model.root)]
        report[f"reshard_{reshard}"] = {
            "after_forward": after_forward,
            "expected_after_forward": root + (0 if reshard else sum(full[id(b)] for b in blocks)),
            "all_gather": lesson.WIRE["all_gather"] - before,
            "expected_all_gather": root + sum(full[id(b)] for b in blocks) * (2 if reshard else 1),
            "all_gather_in_forward": gathered_in_forward,
            "expected_in_forward": root + sum(full[id(b)] for b in blocks),
            "peak_in_backward": model.peak_gathered_in_backward,
            "root_plus_one_unit": root + max(full[id(b)] for b in blocks),
            "after_backward": model.gathered_bytes(),
        }
    return report


def check_training(lesson, stage, device, batches, mine, expected):
    """A stage against one process: 3 SGD steps with momentum on the awkward model."""
    model = build(device)
    if stage == "zero3":
        model = lesson.Zero3(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs = {"shard_gradients": stage != "zero1"} | ({"bucket_cap_mb": 1e-4} if stage == "zero2" else {})
        optimizer = lesson.ZeroOptimizer(params, torch.optim.SGD, lr=LR, momentum=0.9, **kwargs)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
        if stage == "zero3":
            model.finish_gradient_synchronization()  # already ran at the end of backward: a no-op now
        optimizer.step()
    got = model.full_state_dict() if stage == "zero3" else full_parameters(model)  # Zero3's: tied names twice
    missing = sorted(expected.keys() - got.keys())
    return {
        "names_differ": missing,
        "max_difference": None if missing else max(float((got[k] - expected[k]).abs().max()) for k in expected),
    }


def main():
    script, out = Path(sys.argv[1]), Path(sys.argv[2])
    lesson = load_script(script, "lesson03")
    _, rank, device, world_size = setup(0)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH_PER_RANK * world_size, 5, generator=generator),
         torch.randn(BATCH_PER_RANK * world_size, 3, generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    reference = build(device)
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x.to(device)), y.to(device)).backward()
        optimizer.step()
    expected = full_parameters(reference)

    results = {"world_size": world_size}
    checks = [
        ("todo1", check_shards, (lesson, device, world_size)),
        ("todo4", check_gather, (lesson, device)),
        ("todo5", check_reduce, (lesson, device, rank, world_size)),
        ("todo6", check_schedule, (lesson, device, world_size, batches, mine)),
        *(
            (stage, check_training, (lesson, stage, device, batches, mine, expected))
            for stage in ("zero3", "zero2", "zero1")
        ),
    ]  # ZeRO-1 last: a mistake in TODO 1 can crash one rank only, and a hung collective ends the worker
    for key, check, args in checks:
        results[key] = outcome(check, *args)
        if rank == 0:  # after every check: what finished survives a later check that hangs
            out.write_text(json.dumps(results, indent=2))
        dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
