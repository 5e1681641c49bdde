"""Checks of lesson 02's hand-written DataParallel and of DistributedDataParallel, run under torchrun.

    torchrun --nproc_per_node=N tests/workers/ddp_parity.py LESSON_SCRIPT RESULTS.json

LESSON_SCRIPT is solutions/02_data_parallel.py or a learner's exercises/02_data_parallel.py: its DataParallel
class is imported from there. First each of TODOs 1-4 alone, the other three replaced by this file's reference
code (so a mistake in one TODO fails that TODO's check only): the broadcast (parameters and buffers), the hooks
(on a model whose gradients complete several buckets at once), the launch, the wait and unpack. Then the whole
wrapper: each rank builds its models from a different seed (the wrapper's broadcast must fix that), trains a
few SGD steps on its slice of each global batch, and compares every parameter with a single-process reference
trained on the whole global batch. Models: a plain MLP, one with a frozen layer, one with a branch used every
other step and a parameter never used, and one with a shared (tied) weight. Last, TODO 6: the script's
main() up to its DataLoader, to read which samples each rank's sampler gives it.
Rank 0 writes the results to RESULTS.json; a check that stopped at an unfinished TODO records its message
under "stopped", one that raised anything else under "errors".
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
from torch.utils.data import DataLoader

from utils.distributed_utils import destroy_process_group, run_main, setup

STEPS, BATCH, LR = 4, 3, 0.1
SHARD_ARGS = ["--steps", "1", "--seq-len", "32", "--batch-size", "2"]  # main() stops before it builds a model
SMALL_BUCKETS_MB = 0.0002  # about 200 bytes: every layer's gradients in buckets of their own


def load_lesson(path: str):
    spec = importlib.util.spec_from_file_location("lesson02", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines DataParallel; main() runs only under __main__
    return module


class Mlp(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Buffered(Mlp):
    """A buffer (state that is not a parameter, like BatchNorm's running mean), drawn from each rank's seed."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x):
        return super().forward(x + self.shift)


class Reordered(nn.Module):
    """Layers registered in the reverse of the order the forward uses them: the buckets (reverse registration
    order) then fill in the reverse of the order they launch in, and the last hook completes all three."""

    def __init__(self):
        super().__init__()
        self.head, self.mid, self.inp = nn.Linear(16, 4), nn.Linear(16, 16), nn.Linear(8, 16)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


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


MODELS = {"mlp": Mlp, "frozen": Frozen, "unused": Unused, "tied": Tied}  # the parity models
UNITS = {"buffered": Buffered, "reordered": Reordered}  # used by one TODO's check only


def make_model(kind, seed):
    torch.manual_seed(seed)
    return {**MODELS, **UNITS}[kind]()


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
    """Run check(); an unfinished TODO (NotImplementedError) is recorded under key instead of raised, and so is
    any other error (its last line), so that one broken TODO does not take the other TODOs' checks with it."""
    try:
        check()
    except NotImplementedError as error:
        if str(error).startswith("TODO"):
            results.setdefault("stopped", {})[key] = str(error)
        else:
            results.setdefault("errors", {})[key] = f"NotImplementedError: {error}"
    except Exception as error:  # reported by the test of the TODO this check belongs to
        results.setdefault("errors", {})[key] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1:]}"


def local_gradients(model, rank):
    """Give every trained parameter a gradient of its own on each rank; return the average over ranks of each."""
    generator = torch.Generator().manual_seed(100 + rank)
    averages = []
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
        average = p.grad.clone()
        dist.all_reduce(average, op=dist.ReduceOp.AVG)
        averages.append(average)
    return averages


def grad_error(model, averages) -> float:
    """The largest difference, over parameters and ranks, between .grad and the expected average."""
    return worst(max(float((p.grad - a).abs().max()) for p, a in zip(model.parameters(), averages)))


class DeferredAllReduce:
    """A stand-in for the handle of an asynchronous all-reduce that happens only when waited for: unpacking
    without wait() then reads the local gradients, on every run, whatever the timing."""

    def __init__(self, flat):
        self.flat, self.waits = flat, 0

    def wait(self):
        self.waits += 1
        if self.waits == 1:
            dist.all_reduce(self.flat, op=dist.ReduceOp.AVG)
        return True


def reference_launch(model, launched, where):
    """TODO 3 done right, standing in for the learner's _launch while TODO 2's hooks are checked."""

    def launch(bucket):
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)
        model.allreduce_bytes += bucket.nbytes
        model.launch_order.append(bucket.index)
        model._next_to_launch += 1
        launched.append((bucket.index, where[0]))

    return launch


def reference_finish(model, where):
    """The end of backward with TODO 4 done right, standing in while TODO 2's hooks are checked."""

    def finish():
        if not model._syncing:
            return
        where[0] = "end of backward"
        for bucket in model.buckets[model._next_to_launch :]:
            for p in bucket.params:
                if id(p) not in bucket.ready:
                    bucket.put(p)
            model._launch(bucket)
        for bucket in model.buckets:
            bucket.work.wait()
            bucket.unpack()
            bucket.ready.clear()
            bucket.work = None
        model._next_to_launch, model._syncing = 0, False

    return finish


def main():
    _, rank, _, world_size = setup(seed=0)
    lesson = load_lesson(sys.argv[1])
    DataParallel = lesson.DataParallel
    results = {"world_size": world_size, "rank_count": world_size}

    # TODO 1: the broadcast. Each rank starts from its own seed; after wrapping, all must hold rank 0's weights
    # and buffers.
    def broadcast():
        reference = make_model("buffered", seed=0)
        model = DataParallel(make_model("buffered", seed=rank))
        results["broadcast_diff"] = max_diff(model, reference)
        results["buffer_diff"] = worst(
            max(float((a - b).abs().max()) for a, b in zip(model.module.buffers(), reference.buffers()))
        )

        def built_by(r):  # does this rank hold the weights rank r built (from seed r)?
            return all(torch.equal(a, b) for a, b in zip(model.parameters(), make_model("buffered", r).parameters()))

        holds = [None] * world_size  # whose weights each rank holds after wrapping (None: nobody's)
        dist.all_gather_object(holds, next((r for r in range(world_size) if built_by(r)), None))
        results["weights_of"] = holds

    attempt(results, "broadcast", broadcast)

    # TODO 2 alone: the hooks, with TODOs 3 and 4 done by this file's reference code. On the plain MLP each hook
    # completes at most one bucket; on the reordered model the last hook completes all of them.
    def hooks():
        results["hooks"] = {}
        for kind in ("mlp", "reordered"):
            model = DataParallel(make_model(kind, seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
            launched, where = [], ["hook"]
            model._launch = reference_launch(model, launched, where)
            model.finish_gradient_synchronization = reference_finish(model, where)  # what the hook queues
            x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(rank))
            model(x).square().mean().backward()
            local = make_model(kind, seed=0)
            local(x).square().mean().backward()
            errors = []
            for p, mine in zip(model.module.parameters(), local.parameters()):
                average = mine.grad.clone()
                dist.all_reduce(average, op=dist.ReduceOp.AVG)
                errors.append(float((p.grad - average).abs().max()))
            orders = [None] * world_size
            dist.all_gather_object(orders, [index for index, _ in launched])
            results["hooks"][kind] = {
                "buckets": len(model.buckets),
                "from_hooks": sum(w == "hook" for _, w in launched),
                "orders": orders,
                "grad_vs_average": worst(max(errors)),
            }

    attempt(results, "hooks", hooks)

    # TODO 3 alone: _launch called on full buckets, in order, as TODO 2's hooks would.
    def launch():
        model = DataParallel(make_model("mlp", seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
        averages = local_gradients(model.module, rank)
        for bucket in model.buckets:
            for p in bucket.params:
                bucket.put(p)
        for bucket in model.buckets:
            model._launch(bucket)
        handles = sorted({type(bucket.work).__name__ for bucket in model.buckets})
        for bucket in model.buckets:
            if hasattr(bucket.work, "wait"):
                bucket.work.wait()
            bucket.unpack()
        results["launch"] = {
            "buckets": len(model.buckets),
            "handles": handles,
            "allreduce_bytes": model.allreduce_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "order": model.launch_order,
            "next_to_launch": model._next_to_launch,
            "flat_vs_average": grad_error(model.module, averages),
            # .grad as a multiple of the average over ranks (a sum gives the world size)
            "times_average": float(
                sum((p.grad * a).sum() for p, a in zip(model.module.parameters(), averages))
                / sum((a * a).sum() for a in averages)
            ),
        }

    attempt(results, "launch", launch)

    # TODO 4 alone: the end of backward with every bucket full and launched (handles that all-reduce on wait()).
    def unpack():
        model = DataParallel(make_model("mlp", seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
        averages = local_gradients(model.module, rank)
        own = [p.grad.clone() for p in model.module.parameters()]
        for bucket in model.buckets:
            for p in bucket.params:
                bucket.put(p)
            bucket.work = DeferredAllReduce(bucket.flat)
        handles = [bucket.work for bucket in model.buckets]
        model._syncing, model._next_to_launch = True, len(model.buckets)  # as after TODO 2's hooks
        model.finish_gradient_synchronization()
        not_reset = [
            f"bucket {b.index} still holds " + ("its handle" if b.work is not None else f"{len(b.ready)} ready params")
            for b in model.buckets
            if b.work is not None or b.ready
        ]
        results["unpack"] = {
            "grad_vs_average": grad_error(model.module, averages),
            "buckets_reset": not not_reset,
            "not_reset": not_reset[:1],
            "waited": all(handle.waits > 0 for handle in handles),  # was every handle waited for?
            "grad_is_own": all(torch.equal(p.grad, g) for p, g in zip(model.module.parameters(), own)),
        }

    attempt(results, "unpack", unpack)

    # TODOs 1-4 together: the hooks launch every bucket during backward, in bucket order, asynchronously.
    def together():
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
        results["together"] = {
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
        results["together"]["grad_vs_average"] = worst(max(errors))

    attempt(results, "together", together)

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

    # TODO 6: which samples each rank reads in an epoch. main() runs up to its DataLoader, which records the
    # loader's sampler and stops the script there (nothing trains).
    def shard():
        recorded = {}

        class Recorded(Exception):
            pass

        def recording_loader(*args, **kwargs):
            recorded["loader"] = DataLoader(*args, **kwargs)
            raise Recorded

        lesson.DataLoader = recording_loader
        argv, sys.argv = sys.argv, [sys.argv[1], *SHARD_ARGS]
        try:
            lesson.main()
        except Recorded:
            pass
        finally:
            sys.argv = argv
        loader = recorded["loader"]
        mine = [int(i) for i in loader.sampler]  # the epoch's samples for this rank, in order
        shards = [None] * world_size
        dist.all_gather_object(shards, mine)
        seen = [set(shard) for shard in shards]
        results["shard"] = {
            "samples": len(loader.dataset),
            "sampler": type(loader.sampler).__name__,
            "per_rank": [len(shard) for shard in shards],
            "read_twice": sum(len(shard) for shard in seen) - len(set().union(*seen)),
            "read": len(set().union(*seen)),
        }

    attempt(results, "shard", shard)
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=2))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
