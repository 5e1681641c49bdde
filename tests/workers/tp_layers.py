"""Unit checks of lesson 04's hand-written layers, run under torchrun (2 or more ranks):

    torchrun --nproc_per_node=2 tests/workers/tp_layers.py solutions/04_tensor_parallel.py results.json

Each check compares a tensor-parallel piece with what one process computes (nn.Linear, a sum, a concatenation)
in forward and backward, and records "ok" or what went wrong under its TODO; rank 0 writes the JSON.
"""

import importlib.util
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from utils.distributed_utils import destroy_process_group, setup  # noqa: E402

TOLERANCE = 1e-6


def load(path: str):
    spec = importlib.util.spec_from_file_location("lesson04", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def close(name: str, got: torch.Tensor, want: torch.Tensor):
    if got is None:
        raise AssertionError(f"{name} is None (no gradient reached it)")
    if got.shape != want.shape:
        raise AssertionError(f"{name} has shape {list(got.shape)}, expected {list(want.shape)}")
    difference = float((got - want).abs().max())
    if difference > TOLERANCE:
        raise AssertionError(f"{name} differs from one process's by {difference:.1e}")


def same_on_every_rank(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_f_and_g(lesson, group, rank, n):
    x = same_on_every_rank(3, 5, seed=1).requires_grad_()
    weights = [same_on_every_rank(3, 5, seed=10 + r) for r in range(n)]  # a different upstream gradient per rank
    y = lesson.CopyToParallelRegion.apply(x, group)
    close("f's forward output (the identity)", y.detach(), x.detach())
    (y * weights[rank]).sum().backward()
    close("f's backward (the sum of every rank's gradient)", x.grad, sum(weights))

    parts = [same_on_every_rank(3, 5, seed=20 + r) for r in range(n)]  # each rank's partial output
    z = parts[rank].clone().requires_grad_()
    out = lesson.ReduceFromParallelRegion.apply(z, group)
    close("g's forward output (the sum over ranks)", out.detach(), sum(parts))
    upstream = same_on_every_rank(3, 5, seed=30)
    (out * upstream).sum().backward()
    close("g's backward (the identity)", z.grad, upstream)


def reference(layer: nn.Linear, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def check_column(lesson, group, rank, n):
    torch.manual_seed(0)
    full = nn.Linear(6, 4 * n)
    x = same_on_every_rank(2, 3, 6, seed=2)
    upstream = same_on_every_rank(2, 3, 4 * n, seed=3)
    y_ref, x_grad_ref, w_grad_ref, b_grad_ref = reference(full, x, upstream)
    rows = slice(4 * rank, 4 * (rank + 1))
    for gather in (True, False):
        layer = lesson.ColumnParallelLinear(full, group, copy_input=True, gather_output=gather)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        want = y_ref if gather else y_ref[..., rows]
        close(f"ColumnParallelLinear's output (gather_output={gather})", y.detach(), want)
        (y * (upstream if gather else upstream[..., rows])).sum().backward()
        close(f"ColumnParallelLinear's input gradient (gather_output={gather})", xi.grad, x_grad_ref)
        close("ColumnParallelLinear's weight gradient (this rank's rows)", layer.weight.grad, w_grad_ref[rows])
        close("ColumnParallelLinear's bias gradient (this rank's slice)", layer.bias.grad, b_grad_ref[rows])


def check_row(lesson, group, rank, n):
    torch.manual_seed(0)
    full = nn.Linear(4 * n, 6)
    x = same_on_every_rank(2, 3, 4 * n, seed=4)
    upstream = same_on_every_rank(2, 3, 6, seed=5)
    y_ref, x_grad_ref, w_grad_ref, b_grad_ref = reference(full, x, upstream)
    columns = slice(4 * rank, 4 * (rank + 1))
    for parallel_input in (False, True):
        layer = lesson.RowParallelLinear(full, group, input_is_parallel=parallel_input)
        xi = (x[..., columns] if parallel_input else x).clone().requires_grad_()
        y = layer(xi)
        close(f"RowParallelLinear's output (input_is_parallel={parallel_input})", y.detach(), y_ref)
        (y * upstream).sum().backward()
        want = x_grad_ref[..., columns] if parallel_input else x_grad_ref
        close(f"RowParallelLinear's input gradient (input_is_parallel={parallel_input})", xi.grad, want)
        close("RowParallelLinear's weight gradient (this rank's columns)", layer.weight.grad, w_grad_ref[:, columns])
        close("RowParallelLinear's bias gradient", layer.bias.grad, b_grad_ref)


def check_sequence_pair(lesson, group, rank, n):
    pieces = [same_on_every_rank(2, 3, 4, seed=40 + r) for r in range(n)]  # each rank's part of the sequence
    x = pieces[rank].clone().requires_grad_()
    gathered = lesson.GatherSequence.apply(x, group)
    close("GatherSequence's forward (all-gather along dim 1)", gathered.detach(), torch.cat(pieces, dim=1))
    upstreams = [same_on_every_rank(2, 3 * n, 4, seed=50 + r) for r in range(n)]  # partial gradients per rank
    (gathered * upstreams[rank]).sum().backward()
    want = sum(upstreams)[:, 3 * rank : 3 * (rank + 1)]
    close("GatherSequence's backward (reduce-scatter along dim 1)", x.grad, want)

    partials = [same_on_every_rank(2, 3 * n, 4, seed=60 + r) for r in range(n)]
    z = partials[rank].clone().requires_grad_()
    scattered = lesson.ReduceScatterSequence.apply(z, group)
    close(
        "ReduceScatterSequence's forward (sum, keep this rank's part of dim 1)",
        scattered.detach(),
        sum(partials)[:, 3 * rank : 3 * (rank + 1)],
    )
    grads = [same_on_every_rank(2, 3, 4, seed=70 + r) for r in range(n)]
    (scattered * grads[rank]).sum().backward()
    close("ReduceScatterSequence's backward (all-gather along dim 1)", z.grad, torch.cat(grads, dim=1))


CHECKS = {"todo1": check_f_and_g, "todo2": check_column, "todo3": check_row, "todo4": check_sequence_pair}


def main():
    lesson_path, out = sys.argv[1], sys.argv[2]
    _, rank, _, n = setup(0)
    lesson = load(lesson_path)
    group = dist.group.WORLD
    results = {}
    for name, check in CHECKS.items():
        try:
            check(lesson, group, rank, n)
            results[name] = "ok"
        except NotImplementedError as error:
            results[name] = f"not done: {error}"
        except Exception as error:  # noqa: BLE001 - report any failure under its TODO
            where = traceback.extract_tb(error.__traceback__)[-1]
            results[name] = f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})"
    everyone = [None] * n
    dist.all_gather_object(everyone, results)
    if rank == 0:
        merged = {name: next((r[name] for r in everyone if r[name] != "ok"), "ok") for name in CHECKS}
        Path(out).write_text(json.dumps(merged, indent=2))
    destroy_process_group()


if __name__ == "__main__":
    main()
