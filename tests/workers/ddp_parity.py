"""Checks of lesson 02's hand-written DataParallel and of DistributedDataParallel, run under torchrun.

    torchrun --nproc_per_node=N tests/workers/ddp_parity.py LESSON_SCRIPT RESULTS.json

LESSON_SCRIPT is solutions/02_data_parallel.py or a learner's exercises/02_data_parallel.py: its DataParallel
class is imported from there. Each rank builds its models from a different seed (the wrapper's broadcast must
fix that), trains a few SGD steps on its slice of each global batch, and compares every parameter with a
single-process reference trained on the whole global batch. Models: a plain MLP, one with a frozen layer,
one with a branch used every other step and a parameter never used, and one with a shared (tied) weight.
Rank 0 writes the results to RESULTS.json; a check that stopped at an unfinished TODO records its message.
"""

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from utils.distributed_utils import destroy_process_group, run_main, setup

STEPS, BATCH, LR = 4, 3, 0.1
SMALL_BUCKETS_MB = 0.0002  # about 200 bytes: every layer's gradients in buckets of their own


def load_lesson(path: str):
    spec = importlib.util.spec_from_file_location("lesson02", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines DataParallel; main() runs only under __main__
    return module


class Mlp(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Frozen(Mlp):
    """The first layer does not train (requires_grad=False): no gradient, no bucket, nothing sent."""

    def __init__(self):
        super().__init__()
        self[0].requires_grad_(False)


class Unused(nn.Module):
    """A branch that only every other forward uses, and a parameter no forward uses."""

    def __init__(self):
        super().__init__()
        self.body, self.branch, self.never = nn.Linear(8, 4), nn.Linear(8, 4), nn.Parameter(torch.ones(3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        return out + self.branch(x) if self.calls % 2 else out


class Tied(nn.Module):
    """One weight used twice in each forward (like an embedding tied to the output head)."""

    def __init__(self):
        super().__init__()
        self.head, self.mid = nn.Linear(16, 8), nn.Linear(16, 16)
        self.bias_in = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        h = torch.tanh(x @ self.head.weight + self.bias_in)  # the head's weight [8, 16] also as the input layer
        return self.head(torch.tanh(self.mid(h)))[:, :4]


MODELS = {"mlp": Mlp, "frozen": Frozen, "unused": Unused, "tied": Tied}


def make_model(kind, seed):
    torch.manual_seed(seed)
    return MODELS[kind]()


def global_batches(world_size, micro_steps):
    """The same global batches on every rank: STEPS x micro_steps x (world_size * BATCH) samples."""
    generator = torch.Generator().manual_seed(42)
    n = world_size * BATCH
    return [
        [(torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator)) for _ in range(micro_steps)]
        for _ in range(STEPS)
    ]


def train(model, batches, rank, world_size, data_parallel):
    """SGD on this rank's slice of each micro-batch; no_sync on all micro-steps but the last."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step_batches in batches:
        for i, (x, y) in enumerate(step_batches):
            if data_parallel:
                x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = i == len(step_batches) - 1
            context = model.no_sync() if (data_parallel and not last) else torch.enable_grad()
            with context:
                loss = nn.functional.mse_loss(model(x), y) / len(step_batches)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worst(value: float) -> float:
    """The largest value over all ranks."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def max_diff(model, reference):
    ours = model.module if hasattr(model, "module") else model
    return worst(max(float((a - b).detach().abs().max()) for a, b in zip(ours.parameters(), reference.parameters())))


def attempt(results, key, check):
    """Run check(); an unfinished TODO (NotImplementedError) is recorded under key instead of raised."""
    try:
        check()
    except NotImplementedError as error:
        results.setdefault("stopped", {})[key] = str(error)


def main():
    _, rank, _, world_size = setup(seed=0)
    lesson = load_lesson(sys.argv[1])
    DataParallel = lesson.DataParallel
    results = {"world_size": world_size, "rank_count": world_size}

    # TODO 1: the broadcast. Each rank starts from its own seed; after wrapping, all must hold rank 0's weights.
    def broadcast():
        reference = make_model("mlp", seed=0)
        model = DataParallel(make_model("mlp", seed=rank))
        results["broadcast_diff"] = max_diff(model, reference)

    attempt(results, "broadcast", broadcast)

    # TODOs 2-3: the hooks launch every bucket during backward, in bucket order, asynchronously.
    def launches():
        model = DataParallel(make_model("mlp", seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
        handles = []
        launch = model._launch

        def spy(bucket):
            launch(bucket)
            handles.append(type(bucket.work).__name__)  # a Work handle only if launched with async_op=True

        model._launch = spy
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        orders = [None] * world_size
        dist.all_gather_object(orders, model.launch_order)
        results["launch"] = {
            "buckets": len(model.buckets),
            "overlapped": model.buckets_overlapped,
            "orders": orders,
            "handles": sorted(set(handles)),
            "allreduce_bytes": model.allreduce_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buckets_reset": all(b.work is None and not b.ready for b in model.buckets),
        }
        # The gradients after backward: the average over ranks of each rank's own gradient.
        local = make_model("mlp", seed=0)
        local(x).square().mean().backward()
        errors = []
        for p, mine in zip(model.module.parameters(), local.parameters()):
            average = mine.grad.clone()
            dist.all_reduce(average, op=dist.ReduceOp.AVG)
            errors.append(float((p.grad - average).abs().max()))
        results["launch"]["grad_vs_average"] = worst(max(errors))

    attempt(results, "launch", launches)

    # Parity: N ranks with batch b take the same SGD steps as one process with batch N*b, for every model.
    wrappers = {
        "scratch_one_bucket": lambda m: DataParallel(m),
        "scratch_small_buckets": lambda m: DataParallel(m, bucket_cap_mb=SMALL_BUCKETS_MB),
        "builtin": lambda m: DistributedDataParallel(m, find_unused_parameters=isinstance(m, Unused)),
    }
    for kind in MODELS:
        for micro_steps in (1, 2):
            batches = global_batches(world_size, micro_steps)
            reference = make_model(kind, seed=0)
            train(reference, batches, rank, world_size, data_parallel=False)
            for name, wrap in wrappers.items():
                if kind != "mlp" and name == "scratch_one_bucket":
                    continue
                key = f"{kind}_{name}_accum{micro_steps}"

                def parity(wrap=wrap, key=key, kind=kind, batches=batches, reference=reference):
                    model = wrap(make_model(kind, seed=rank))  # different weights per rank until the broadcast
                    train(model, batches, rank, world_size, data_parallel=True)
                    results[f"max_diff_{key}"] = max_diff(model, reference)
                    if isinstance(model, DataParallel):
                        results[f"allreduce_bytes_{key}"] = model.allreduce_bytes / STEPS  # per optimizer step
                        results[f"trained_bytes_{kind}"] = sum(
                            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
                        )
                    del model  # DDP holds the process group: free it before the group goes

                attempt(results, key, parity)
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=2))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
