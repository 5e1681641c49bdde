"""Lesson 04's plumbing: checks of the hand-written tensor-parallel layers, and full parameters however sharded.

    check_layers(lesson, group, device, sequence_parallel)   # TODOs 1 to 4 (and 5) against one process
    full_parameters(model, group)                             # {name: whole tensor} under the unsharded names

Each check compares a piece of the lesson (given as its module) with what one process computes (nn.Linear, a sum,
a concatenation), forward and backward, on small tensors; the first difference raises a CourseError that starts
with its TODO's number. The lesson script runs them before training with --tp-impl scratch, and
tests/workers/tp_units.py runs them one TODO at a time.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from utils.distributed_utils import CourseError
from utils.model import ModelConfig, build_model

TOLERANCE = 1e-6  # float32: a sum over ranks is added in another order than one process adds it


def _close(todo: int, name: str, got, want: torch.Tensor):
    if got is None:
        raise CourseError(f"TODO {todo}: {name} is None (no gradient reached it)")
    if got.shape != want.shape:
        raise CourseError(f"TODO {todo}: {name} has shape {list(got.shape)}, expected {list(want.shape)}")
    difference = float((got.detach() - want).abs().max())
    if difference > TOLERANCE:
        raise CourseError(f"TODO {todo}: {name} differs from one process's by {difference:.1e}")


def _same_everywhere(*shape, seed: int, device) -> torch.Tensor:
    """A tensor every rank builds identically (its own generator, not the rank-seeded global one)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def check_f_and_g(lesson, group, device):
    """TODO 1: f is the identity forward and sums the gradients backward; g sums forward and is the identity back."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    x = _same_everywhere(3, 5, seed=1, device=device).requires_grad_()
    weights = [_same_everywhere(3, 5, seed=10 + r, device=device) for r in range(n)]  # a gradient per rank
    y = lesson.CopyToParallelRegion.apply(x, group)
    _close(1, "f's forward output (the identity)", y, x.detach())
    (y * weights[rank]).sum().backward()
    _close(1, "f's backward (the sum of every rank's gradient)", x.grad, sum(weights))

    parts = [_same_everywhere(3, 5, seed=20 + r, device=device) for r in range(n)]  # each rank's partial output
    z = parts[rank].clone().requires_grad_()
    out = lesson.ReduceFromParallelRegion.apply(z, group)
    _close(1, "g's forward output (the sum over ranks)", out, sum(parts))
    upstream = _same_everywhere(3, 5, seed=30, device=device)
    (out * upstream).sum().backward()
    _close(1, "g's backward (the identity)", z.grad, upstream)


def _reference(layer: nn.Linear, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def check_column(lesson, group, device):
    """TODO 2: ColumnParallelLinear = this rank's output features of nn.Linear (all of them with gather_output)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    full = nn.Linear(6, 4 * n).to(device)
    with torch.no_grad():
        full.weight.copy_(_same_everywhere(4 * n, 6, seed=2, device=device))
        full.bias.copy_(_same_everywhere(4 * n, seed=3, device=device))
    x = _same_everywhere(2, 3, 6, seed=4, device=device)
    upstream = _same_everywhere(2, 3, 4 * n, seed=5, device=device)
    y_ref, x_grad_ref, w_grad_ref, b_grad_ref = _reference(full, x, upstream)
    rows = slice(4 * rank, 4 * (rank + 1))
    for gather in (True, False):
        layer = lesson.ColumnParallelLinear(full, group, copy_input=True, gather_output=gather)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        _close(2, f"ColumnParallelLinear's output (gather_output={gather})", y, y_ref if gather else y_ref[..., rows])
        (y * (upstream if gather else upstream[..., rows])).sum().backward()
        _close(2, f"ColumnParallelLinear's input gradient (gather_output={gather})", xi.grad, x_grad_ref)
        _close(2, "ColumnParallelLinear's weight gradient (this rank's rows)", layer.weight.grad, w_grad_ref[rows])
        _close(2, "ColumnParallelLinear's bias gradient (this rank's slice)", layer.bias.grad, b_grad_ref[rows])


def check_row(lesson, group, device):
    """TODO 3: RowParallelLinear = nn.Linear, from this rank's input features (split here, or already split)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    full = nn.Linear(4 * n, 6).to(device)
    with torch.no_grad():
        full.weight.copy_(_same_everywhere(6, 4 * n, seed=6, device=device))
        full.bias.copy_(_same_everywhere(6, seed=7, device=device))
    x = _same_everywhere(2, 3, 4 * n, seed=8, device=device)
    upstream = _same_everywhere(2, 3, 6, seed=9, device=device)
    y_ref, x_grad_ref, w_grad_ref, b_grad_ref = _reference(full, x, upstream)
    columns = slice(4 * rank, 4 * (rank + 1))
    for parallel_input in (False, True):
        layer = lesson.RowParallelLinear(full, group, input_is_parallel=parallel_input)
        xi = (x[..., columns] if parallel_input else x).clone().requires_grad_()
        y = layer(xi)
        _close(3, f"RowParallelLinear's output (input_is_parallel={parallel_input})", y, y_ref)
        (y * upstream).sum().backward()
        want = x_grad_ref[..., columns] if parallel_input else x_grad_ref
        _close(3, f"RowParallelLinear's input gradient (input_is_parallel={parallel_input})", xi.grad, want)
        _close(
            3, "RowParallelLinear's weight gradient (this rank's columns)", layer.weight.grad, w_grad_ref[:, columns]
        )
        _close(3, "RowParallelLinear's bias gradient", layer.bias.grad, b_grad_ref)


def check_block(lesson, group, device):
    """TODO 4: one Block of utils/model.py made tensor-parallel = the whole block on one process (output and input
    gradient; without SP, so that TODO 5 is not needed yet)."""
    n = dist.get_world_size(group)
    whole = build_model(ModelConfig(seq_len=4, dim=4 * n, n_heads=n, n_layers=1), seed=5).blocks[0].to(device)
    block = copy.deepcopy(whole)
    lesson.tensor_parallel_block(block, group)
    x = _same_everywhere(2, 4, 4 * n, seed=80, device=device)
    upstream = _same_everywhere(2, 4, 4 * n, seed=81, device=device)
    outputs, grads = [], []
    for module in (whole, block):
        xi = x.clone().requires_grad_()
        y = module(xi)
        (y * upstream).sum().backward()
        outputs.append(y.detach())
        grads.append(xi.grad)
    _close(4, "the tensor-parallel block's output", outputs[1], outputs[0])
    _close(4, "the tensor-parallel block's input gradient", grads[1], grads[0])


def check_sequence_pair(lesson, group, device):
    """TODO 5: GatherSequence all-gathers dim 1 (reduce-scatters back); ReduceScatterSequence the reverse."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = slice(3 * rank, 3 * (rank + 1))
    pieces = [_same_everywhere(2, 3, 4, seed=40 + r, device=device) for r in range(n)]  # each rank's tokens
    x = pieces[rank].clone().requires_grad_()
    gathered = lesson.GatherSequence.apply(x, group)
    _close(5, "GatherSequence's forward (all-gather along dim 1)", gathered, torch.cat(pieces, dim=1))
    upstreams = [_same_everywhere(2, 3 * n, 4, seed=50 + r, device=device) for r in range(n)]  # partial gradients
    (gathered * upstreams[rank]).sum().backward()
    _close(5, "GatherSequence's backward (reduce-scatter along dim 1)", x.grad, sum(upstreams)[:, mine])

    partials = [_same_everywhere(2, 3 * n, 4, seed=60 + r, device=device) for r in range(n)]
    z = partials[rank].clone().requires_grad_()
    scattered = lesson.ReduceScatterSequence.apply(z, group)
    _close(
        5, "ReduceScatterSequence's forward (sum, keep this rank's part of dim 1)", scattered, sum(partials)[:, mine]
    )
    grads = [_same_everywhere(2, 3, 4, seed=70 + r, device=device) for r in range(n)]
    (scattered * grads[rank]).sum().backward()
    _close(5, "ReduceScatterSequence's backward (all-gather along dim 1)", z.grad, torch.cat(grads, dim=1))


def check_layers(lesson, group, device, sequence_parallel: bool = False):
    """The lesson's hand-written pieces, in TODO order; stops at the first one that is not done or is wrong."""
    checks = [check_f_and_g, check_column, check_row, check_block] + (
        [check_sequence_pair] if sequence_parallel else []
    )
    for check in checks:
        check(lesson, group, device)


# --------------------------------------------------------------------------------------------------
# Full parameters, however sharded: DTensors, or plain shards that remember their dimension (`tp_dim`)
# --------------------------------------------------------------------------------------------------


def _gather(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    moved = shard.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def full_parameters(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """Every parameter whole, under the names of the unsharded model (a collective: every rank calls it)."""
    full = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            full[name] = p.detach().full_tensor()
        elif hasattr(p, "tp_dim"):
            full[name] = _gather(p.detach(), p.tp_dim, group)
        else:
            full[name] = p.detach()
    return full


def full_gradients(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """Every parameter's gradient whole (None where there is none), like full_parameters."""
    full = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and isinstance(g, DTensor):
            g = g.full_tensor()
        elif g is not None and hasattr(p, "tp_dim"):
            g = _gather(g, p.tp_dim, group)
        full[name] = g
    return full


def param_checksum(parameters: dict[str, torch.Tensor]) -> float:
    """utils.metrics.param_checksum of full parameters: the sum of squares in float64."""
    return sum(float(p.double().pow(2).sum()) for p in parameters.values())


def parameter_groups(model: nn.Module) -> list[dict]:
    """DTensor parameters and plain ones in separate groups: a multi-tensor (foreach) optimizer step, the default
    on GPUs, cannot mix the two kinds in one call."""
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [{"params": group} for group in (dtensors, plain) if group]


def describe(model: nn.Module, name: str) -> dict:
    """How a parameter is stored on this rank: its kind, placements, whole shape and local shape."""
    p = model.get_parameter(name)
    if isinstance(p, DTensor):
        return {
            "type": "DTensor",
            "placements": [repr(x) for x in p.placements],
            "global_shape": list(p.shape),
            "local_shape": list(p.to_local().shape),
        }
    shape = list(p.shape)
    if hasattr(p, "tp_dim"):  # a hand-written shard: the whole tensor is N slices along tp_dim
        shape[p.tp_dim] *= dist.get_world_size()
    placements = [f"Shard(dim={p.tp_dim})"] if hasattr(p, "tp_dim") else ["Replicate()"]
    return {"type": "Parameter", "placements": placements, "global_shape": shape, "local_shape": list(p.shape)}
