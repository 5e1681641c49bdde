"""Lesson 04's checks of its hand-written tensor-parallel pieces, each against what one process computes.

    check_layers(group, device, f=..., g=..., column=..., row=..., block=..., sequence_pair=None)  # TODOs 1-5

The pieces come in by name (the lesson's f and g autograd functions, its two layer classes, the function that
shards a block, and SP's pair): each check compares one of them with nn.Linear, a sum or a concatenation on one
process, forward and backward, on small tensors; the first difference raises a CourseError that starts with its
TODO's number. The lesson script runs them before training with --tp-impl scratch, and tests/workers/tp_units.py
runs them one TODO at a time.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from utils.distributed_utils import CourseError
from utils.model import ModelConfig, build_model

TOLERANCE = 1e-6  # float32: a sum over ranks is added in another order than one process adds it


def _close(todo: int, name: str, got, want: torch.Tensor, mistakes: dict | None = None):
    """Fail naming where `got` first differs from `want` (index, got, want), and the likely cause when `got` is what
    a known mistake gives: mistakes = {cause: the value (or shape) that mistake produces}."""
    if got is None:
        raise CourseError(f"TODO {todo}: {name} is None (no gradient reached it)")
    got = got.detach()
    known = [(why, value) for why, value in (mistakes or {}).items() if value.shape == got.shape]
    where = f" on rank {dist.get_rank()}" if dist.is_initialized() else ""
    if got.shape != want.shape:
        cause = f": {known[0][0]}" if known else ""
        raise CourseError(f"TODO {todo}: {name} has shape {list(got.shape)}{where}, expected {list(want.shape)}{cause}")
    wrong = (got - want).abs() > TOLERANCE
    if wrong.any():
        index = tuple(int(i) for i in wrong.nonzero()[0])
        cause = next((why for why, value in known if float((got - value).abs().max()) <= TOLERANCE), None)
        cause = f": {cause}" if cause else f" (differs by up to {float((got - want).abs().max()):.1e})"
        raise CourseError(
            f"TODO {todo}: {name} at {list(index)} is {float(got[index]):.4f}{where}, want {float(want[index]):.4f}"
            f"{cause}"
        )


def _same_everywhere(*shape, seed: int, device) -> torch.Tensor:
    """A tensor every rank builds identically (its own generator, not the rank-seeded global one)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def check_f_and_g(f, g, group, device):
    """TODO 1: f is the identity forward and sums the gradients backward; g sums forward and is the identity back."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    x = _same_everywhere(3, 5, seed=1, device=device).requires_grad_()
    weights = [_same_everywhere(3, 5, seed=10 + r, device=device) for r in range(n)]  # a gradient per rank
    y = f.apply(x, group)
    _close(
        1,
        "f's forward output (the identity)",
        y,
        x.detach(),
        {f"f sums over the {n} ranks in forward (g's job); f is the identity forward": n * x.detach()},
    )
    (y * weights[rank]).sum().backward()
    _close(
        1,
        "f's backward (the sum of every rank's gradient)",
        x.grad,
        sum(weights),
        {"f's backward keeps this rank's own gradient: the ranks' gradients are not summed": weights[rank]},
    )

    parts = [_same_everywhere(3, 5, seed=20 + r, device=device) for r in range(n)]  # each rank's partial output
    z = parts[rank].clone().requires_grad_()
    out = g.apply(z, group)
    _close(
        1,
        "g's forward output (the sum over ranks)",
        out,
        sum(parts),
        {"g returns this rank's partial output: the partial outputs are not summed over the ranks": parts[rank]},
    )
    upstream = _same_everywhere(3, 5, seed=30, device=device)
    (out * upstream).sum().backward()
    _close(
        1,
        "g's backward (the identity)",
        z.grad,
        upstream,
        {
            f"g's backward sums the gradient over the {n} ranks, {n} x too large: g is the identity backward": n
            * upstream
        },
    )


def _reference(layer: nn.Linear, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def check_column(column, group, device):
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
        layer = column(full, group, copy_input=True, gather_output=gather)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        want = y_ref if gather else y_ref[..., rows]
        mistakes = {  # what the known mistakes give
            "the bias is missing (this rank's slice of it is not added)": want - full.bias.detach()[
                slice(None) if gather else rows],
            "the slices are concatenated along dim 0 (the batch), not the output features (dim -1)": torch.cat(
                [y_ref[..., 4 * r : 4 * (r + 1)] for r in range(n)]),
        }  # fmt: skip
        _close(2, f"ColumnParallelLinear's output (gather_output={gather})", y, want, mistakes)
        (y * (upstream if gather else upstream[..., rows])).sum().backward()
        partial = upstream[..., rows] @ full.weight.detach()[rows]  # through this rank's output features only
        _close(
            2,
            f"ColumnParallelLinear's input gradient (gather_output={gather})",
            xi.grad,
            x_grad_ref,
            {"the input gradient is this rank's partial one: f is not applied to the input (copy_input)": partial},
        )
        _close(2, "ColumnParallelLinear's weight gradient (this rank's rows)", layer.weight.grad, w_grad_ref[rows])
        _close(2, "ColumnParallelLinear's bias gradient (this rank's slice)", layer.bias.grad, b_grad_ref[rows])


def check_row(row, group, device):
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
        layer = row(full, group, input_is_parallel=parallel_input)
        xi = (x[..., columns] if parallel_input else x).clone().requires_grad_()
        try:
            y = layer(xi)
        except RuntimeError as error:
            if parallel_input or "cannot be multiplied" not in str(error):
                raise
            raise CourseError(  # a whole input (4n features) met this rank's 4 columns of the weight
                f"TODO 3: RowParallelLinear(input_is_parallel=False) raised RuntimeError: {error}: likely the whole "
                f"input ({4 * n} features) is not split before it meets this rank's {4} columns"
            ) from error
        n_biases = y_ref + (n - 1) * full.bias.detach()  # each rank's partial output carrying the bias, then summed
        name = f"RowParallelLinear's output (input_is_parallel={parallel_input})"
        _close(3, name, y, y_ref, {f"the bias is added {n} times (on every rank before g sums them)": n_biases})
        (y * upstream).sum().backward()
        want = x_grad_ref[..., columns] if parallel_input else x_grad_ref
        _close(3, f"RowParallelLinear's input gradient (input_is_parallel={parallel_input})", xi.grad, want)
        _close(
            3, "RowParallelLinear's weight gradient (this rank's columns)", layer.weight.grad, w_grad_ref[:, columns]
        )
        _close(3, "RowParallelLinear's bias gradient", layer.bias.grad, b_grad_ref)


def check_block(block_parallel, group, device):
    """TODO 4: one Block of utils/model.py made tensor-parallel = the whole block on one process (output and input
    gradient; without SP, so that TODO 5 is not needed yet)."""
    n = dist.get_world_size(group)
    whole = build_model(ModelConfig(seq_len=4, dim=4 * n, n_heads=n, n_layers=1), seed=5).blocks[0].to(device)
    block = copy.deepcopy(whole)
    block_parallel(block, group)
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


def check_sequence_pair(gather, reduce_scatter, group, device):
    """TODO 5: GatherSequence all-gathers dim 1 (reduce-scatters back); ReduceScatterSequence the reverse."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = slice(3 * rank, 3 * (rank + 1))
    pieces = [_same_everywhere(2, 3, 4, seed=40 + r, device=device) for r in range(n)]  # each rank's tokens
    x = pieces[rank].clone().requires_grad_()
    gathered = gather.apply(x, group)
    _close(
        5,
        "GatherSequence's forward (all-gather along dim 1)",
        gathered,
        torch.cat(pieces, dim=1),
        {"the pieces are concatenated along dim 0 (the batch), not the sequence (dim 1)": torch.cat(pieces)},
    )
    upstreams = [_same_everywhere(2, 3 * n, 4, seed=50 + r, device=device) for r in range(n)]  # partial gradients
    (gathered * upstreams[rank]).sum().backward()
    _close(
        5,
        "GatherSequence's backward (reduce-scatter along dim 1)",
        x.grad,
        sum(upstreams)[:, mine],
        {
            "this rank's slice of its own gradient: the ranks' gradients are not summed (reduce-scatter)": upstreams[
                rank
            ][:, mine]
        },
    )

    partials = [_same_everywhere(2, 3 * n, 4, seed=60 + r, device=device) for r in range(n)]
    z = partials[rank].clone().requires_grad_()
    scattered = reduce_scatter.apply(z, group)
    _close(
        5,
        "ReduceScatterSequence's forward (sum, keep this rank's part of dim 1)",
        scattered,
        sum(partials)[:, mine],
        {"the whole sequence is kept: summed over the ranks but not split along dim 1": sum(partials)},
    )
    grads = [_same_everywhere(2, 3, 4, seed=70 + r, device=device) for r in range(n)]
    (scattered * grads[rank]).sum().backward()
    _close(5, "ReduceScatterSequence's backward (all-gather along dim 1)", z.grad, torch.cat(grads, dim=1))


def check_layers(group, device, *, f, g, column, row, block, sequence_pair=None):
    """The lesson's hand-written pieces, in TODO order; stops at the first one that is not done or is wrong.

    f, g: the autograd functions entering and leaving a region (TODO 1); column, row: the layer classes (TODOs 2
    and 3); block: the function that shards one Block in place (TODO 4); sequence_pair: SP's (f, g) (TODO 5), or
    None to leave them unchecked (a run without SP does not need them)."""
    check_f_and_g(f, g, group, device)
    check_column(column, group, device)
    check_row(row, group, device)
    check_block(block, group, device)
    if sequence_pair is not None:
        check_sequence_pair(*sequence_pair, group, device)
