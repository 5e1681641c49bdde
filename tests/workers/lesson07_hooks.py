"""Checks of lesson 07's hand-written communication hooks inside real DDP, run under torchrun (2 ranks, gloo).

    torchrun --nproc_per_node=2 tests/workers/lesson07_hooks.py LESSON_SCRIPT RESULTS.json

LESSON_SCRIPT is solutions/07_communication_efficient.py or a learner's exercises/07_...: its hooks are imported
from there. Rank 0 writes RESULTS.json: for each check, the numbers the tests judge, or `stopped` (an unfinished
TODO) or `failed` (any other error, with its message), so that one failing check does not hide the others.

- hook_at_once (TODO 1): the last rank joins 3 s late, so the hook's Future cannot be done on return unless the
  hook waited; its value on a known bucket, (r + 1) x [0, 1, ..., 7] on rank r, against their average.
- topk_buckets (TODO 2): the course model in DDP with small buckets, 4 SGD steps. DDP rebuilds its buckets after
  the first step; error feedback must still add each parameter's leftover to that same parameter. Error
  feedback's invariant, per parameter: n x (sum of the decoded averages) + (the ranks' errors now) = the sum of
  every gradient every rank computed. Gradients and outputs are read per parameter through the offsets of
  bucket.gradients() in bucket.buffer(), not through the hook's own bookkeeping.
- quantize (TODO 4): each rank quantizes a gradient of its own size (rank r's is r + 1 times larger, so the
  scales differ); the hook's output must be the mean of every rank's own dequantized codes, for every --bits; what
  it all-gathers (dtype and bytes) is noted, and what known mistakes would decode beside the right answer.
- average (TODO 5): rank r's parameters are r + 1 times one vector; after average_parameters, rank 0 must hold
  their mean.
- topk_resume (TODO 2 and TopKState.state_dict): 6 steps straight vs 3 steps, a checkpoint (model, optimizer,
  top-k error memory), a fresh model and state loaded from it, 3 more steps: the same losses. Without the error
  memory in the checkpoint the losses differ (which shows the check can fail).
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.harness.blame import describe
from utils.distributed_utils import destroy_process_group, run_main, setup
from utils.model import ModelConfig, build_model, loss_fn

CONFIG = ModelConfig(seq_len=16, dim=32, n_layers=2, n_heads=2)
SMALL_BUCKETS_MB = 0.02  # about 20 kB: the tiny model's gradients fill several buckets
LR = 0.2


def load_lesson(path: str):
    spec = importlib.util.spec_from_file_location("lesson07", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only under __main__
    return module


def batch(step: int, rank: int):
    """This rank's batch at `step`: the same on every run, different on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def offsets(bucket) -> list[tuple[torch.nn.Parameter, int, int]]:
    """(parameter, start, end) of each gradient inside bucket.buffer(), from where DDP's views point."""
    base, size = bucket.buffer().data_ptr(), bucket.buffer().element_size()
    return [
        (p, (g.data_ptr() - base) // size, (g.data_ptr() - base) // size + g.numel())
        for p, g in zip(bucket.parameters(), bucket.gradients())
    ]


def check_topk_buckets(lesson, rank, n) -> dict:
    model = DistributedDataParallel(build_model(CONFIG, seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    names = {p: name for name, p in model.module.named_parameters()}
    state = lesson.TopKState(ratio=0.1)
    gradient_sum = {p: torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()}
    decoded_sum = {p: torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()}
    layouts = []  # per step: the parameter names of each bucket, in buffer order

    def recording(hook_state, bucket):
        spans = offsets(bucket)
        layouts[-1].append([names[p] for p, _, _ in spans])
        for p, start, end in spans:
            gradient_sum[p] += bucket.buffer()[start:end].view_as(p)

        def note(future):
            out = future.value()
            for p, start, end in spans:
                decoded_sum[p] += out[start:end].view_as(p)
            return out

        return lesson.topk_hook(hook_state, bucket).then(note)

    model.register_comm_hook(state, recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(1, 5):
        layouts.append([])
        inputs, targets = batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    worst, where, ratio = 0.0, None, 1.0
    for p in model.parameters():
        kept = state.errors.get(p)
        error = torch.zeros_like(p, dtype=torch.float64) if kept is None else kept.double().view_as(p)
        together = torch.stack([gradient_sum[p], error, decoded_sum[p]])
        dist.all_reduce(together)  # sums over the ranks (decoded_sum is the same on every rank)
        missing = float((together[0] - together[1] - together[2]).abs().max())  # n x decoded = all sent
        scale = float(together[0].abs().max()) or 1.0
        if missing / scale > worst:
            worst, where = missing / scale, names[p]
            # n x decoded over what was sent (gradients - errors): n when the values are summed, 1/n when averaged
            # twice, 1 when right (then the leftovers went astray).
            sent = together[0] - together[1]
            ratio = float((together[2] * sent).sum() / (sent * sent).sum()) if sent.any() else 1.0
    return {
        "buckets": [len(layout) for layout in layouts],
        "layouts": layouts,
        "worst": worst,
        "where": where,
        "ratio": ratio,
    }


GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")  # an all-gather's names (the lesson's COUNTED)


def recorded_sends(hook, *args) -> tuple[list, object, str | None]:
    """Call hook(*args) and wait for its Future, noting what it all-gathers, under any of its names: ([(dtype, bytes)
    sent], the Future's value or None, the error it raised or None)."""
    sent, real = [], {name: getattr(dist, name) for name in GATHERS}

    def recording(original):
        def gather(output, tensor, *rest, **kwargs):
            sent.append((str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()))
            return original(output, tensor, *rest, **kwargs)

        return gather

    for name, original in real.items():
        setattr(dist, name, recording(original))
    try:
        return sent, hook(*args).wait(), None
    except Exception as error:  # noqa: BLE001 - reported with what was sent before it
        return sent, None, describe(error)
    finally:
        for name, original in real.items():
            setattr(dist, name, original)


def check_quantize(lesson, rank, n) -> dict:
    results = {}
    generator = torch.Generator().manual_seed(7)
    gradient = torch.randn(1001, generator=generator) * (rank + 1)  # rank 1's scale is about twice rank 0's
    for bits in lesson.BITS:
        state = lesson.QuantizeState(bits, seed=100 + rank, device=torch.device("cpu"))
        before = state.generator.get_state()
        sent, decoded, error = recorded_sends(lesson.quantize_hook, state, FakeBucket(gradient.clone()))
        # The reference: this rank's own codes (the same draws), dequantized with its own scale, averaged by a
        # plain all-gather of floats. (Computed even when the hook raised: every rank makes the same collectives.)
        replay = torch.Generator().set_state(before)
        codes, scale = lesson.quantize(gradient.clone(), bits, replay)
        mine = lesson.dequantize(codes, scale).float()
        everyone, scales = [torch.empty_like(mine) for _ in range(n)], [torch.empty(1) for _ in range(n)]
        dist.all_gather(everyone, mine)
        dist.all_gather(scales, scale.float().reshape(1))
        result = results[str(bits)] = {"numel": gradient.numel(), "sent": sent, "error": error, "first": None}
        if error is not None:
            continue
        rows = torch.stack(everyone)
        expected = rows.mean(0)
        size = float(expected.abs().max())
        wrong = ~((decoded.float() - expected).abs() <= 1e-6 * size)  # nan counts as wrong
        first = int(wrong.nonzero()[0, 0]) if wrong.any() else None
        # What known mistakes decode: each mistake's average, for the test to name the one the hook's result matches.
        as_if = {
            "every row were decoded with rank 0's scale": (rows / torch.cat(scales)[:, None] * scales[0]).mean(0),
            "the rows were summed, not averaged": rows.sum(0),
        }
        result["first"] = None if first is None else [first, float(decoded[first]), float(expected[first])]
        result["as_if"] = [name for name, mistaken in as_if.items() if not torch.allclose(mistaken, expected)
                           and float((decoded - mistaken).abs().max()) <= 1e-6 * size]  # fmt: skip
    return results


def check_average(lesson, rank, n) -> dict:
    """TODO 5: rank r's parameters are (r + 1) x [1, 2, 3, ...], so their mean over the ranks is known: what this
    rank holds after average_parameters, what it should hold, and what it held before."""
    module = torch.nn.Linear(3, 2)
    with torch.no_grad():
        base = torch.arange(1.0, 1 + sum(p.numel() for p in module.parameters()))
        torch.nn.utils.vector_to_parameters(base * (rank + 1), module.parameters())
    lesson.average_parameters(module)
    got = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
    return {"got": got.tolist(), "want": (base * (n + 1) / 2).tolist(), "own": (base * (rank + 1)).tolist(), "n": n}


def check_hook_returns_at_once(lesson, rank, n) -> dict:
    """TODO 1's hook must start the all-reduce and return without waiting for it: the last rank joins the collective
    LATE_S seconds late, so the other ranks' Future cannot be done when their hook returns, unless it waited."""
    gradient = torch.arange(8.0) * (rank + 1)
    if rank == n - 1:
        time.sleep(LATE_S)
    future = lesson.allreduce_hook(None, FakeBucket(gradient.clone()))
    done_on_return = future.done()
    value = future.wait()
    # DDP needs the one tensor; a list of tensors is noted (for the test to name) and its first tensor judged.
    returned = "a tensor" if torch.is_tensor(value) else f"a {type(value).__name__} of {len(value)} tensor(s)"
    average = value if torch.is_tensor(value) else value[0]
    expected = torch.arange(8.0) * sum(range(1, n + 1)) / n
    return {
        "done_on_return": done_on_return,
        "difference": float((average - expected).abs().max()),
        "returned": returned,
        "got": average.tolist(),
        "want": expected.tolist(),
        "n": n,
    }


LATE_S = 3.0


class FakeBucket:
    """What the quantize hook uses of dist.GradBucket: its flat buffer and index."""

    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor

    def index(self):
        return 0


def train_topk(lesson, rank, steps, start=None):
    """Top-k DDP training on the tiny model: losses of `steps` steps, from `start` (a checkpoint) if given."""
    model = DistributedDataParallel(build_model(CONFIG, seed=0))
    state = lesson.TopKState(ratio=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    first = 1
    if start is not None:
        model.module.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
        if "topk" in start:
            state.load_state_dict(model.module, start["topk"])
        first = start["step"] + 1
    model.register_comm_hook(state, lesson.topk_hook)
    losses = []
    for step in range(first, first + steps):
        inputs, targets = batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    checkpoint = {
        "model": {k: v.clone() for k, v in model.module.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "topk": state.state_dict(model.module),  # this rank's own leftovers: each rank saves its own
        "step": first + steps - 1,
    }
    del model
    return losses, checkpoint


def check_topk_resume(lesson, rank, n) -> dict:
    straight, _ = train_topk(lesson, rank, 6)
    first, checkpoint = train_topk(lesson, rank, 3)
    resumed, _ = train_topk(lesson, rank, 3, start=checkpoint)
    without = {key: value for key, value in checkpoint.items() if key != "topk"}
    forgetful, _ = train_topk(lesson, rank, 3, start=without)
    return {
        "straight": straight,
        "resumed": first + resumed,
        "without_error_memory": first + forgetful,
        "saved_errors": len(checkpoint["topk"]),
    }


CHECKS = {
    "hook_at_once": check_hook_returns_at_once,
    "topk_buckets": check_topk_buckets,
    "quantize": check_quantize,
    "average": check_average,
    "topk_resume": check_topk_resume,
}


def main():
    script, results_path = sys.argv[1], Path(sys.argv[2])
    _, rank, _, n = setup(seed=0)
    lesson = load_lesson(script)
    results = {"stopped": {}, "failed": {}}
    for name, check in CHECKS.items():
        try:
            results[name] = check(lesson, rank, n)
        except NotImplementedError as error:
            results["stopped"][name] = str(error)
        except Exception as error:  # noqa: BLE001 - recorded for the test to report, with its type
            results["failed"][name] = describe(error)
        dist.barrier()
    if rank == 0:
        results_path.write_text(json.dumps(results, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
