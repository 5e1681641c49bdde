"""The hand-written ZeRO stages on an awkward model, against one process with the whole batch.

    torchrun --nproc_per_node=3 tests/workers/zero_edge_cases.py LESSON_SCRIPT OUT.json

The model has what the course's Transformer lacks: sizes that do not divide by the world size (padding),
a parameter that does not require grad, a parameter unused in every step, a block never called, and a
layer shared by two blocks (tied parameters). Every rank trains its slice of a global batch with
ZeroOptimizer (ZeRO-1, ZeRO-2) or Zero3 (ZeRO-3) and also the plain model on the whole batch itself;
rank 0 writes the largest parameter difference per stage (or the error it stopped at) to OUT.json.
"""

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn

from utils.distributed_utils import destroy_process_group, run_main, setup

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


def build(seed=0):
    torch.manual_seed(seed)
    return Awkward()


def full_parameters(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    script, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = importlib.util.spec_from_file_location("lesson03", script)
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    _, rank, device, world_size = setup(0)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH_PER_RANK * world_size, 5, generator=generator),
         torch.randn(BATCH_PER_RANK * world_size, 3, generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    reference = build()
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    expected = full_parameters(reference)

    results = {"world_size": world_size}
    for stage in ("zero1", "zero2", "zero3"):
        try:
            model = build()
            if stage == "zero3":
                model = lesson.Zero3(model)
                optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
            else:
                params = [p for p in model.parameters() if p.requires_grad]
                optimizer = lesson.ZeroOptimizer(
                    params, torch.optim.SGD, shard_gradients=stage == "zero2", lr=LR, momentum=0.9
                )
            for x, y in batches:
                optimizer.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
                if stage == "zero3":
                    model.finish_gradient_synchronization()  # already ran at the end of backward: a no-op now
                optimizer.step()
            got = model.full_state_dict() if stage == "zero3" else full_parameters(model)
            missing = sorted(expected.keys() ^ got.keys())
            results[stage] = {
                "names_differ": missing,
                "max_difference": None if missing else max(float((got[k] - expected[k]).abs().max()) for k in got),
            }
        except NotImplementedError as error:
            results[stage] = {"error": str(error)}
        dist.barrier()
    if rank == 0:
        out.write_text(json.dumps(results, indent=2))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
