"""Whole parameters back from any layout: what every lesson that splits a model uses to compare it with one process.

A parameter may be a DTensor (DTensor TP, FSDP2, or both on a 2-D mesh), a plain shard that remembers the dimension
it was cut along (lesson 04's hand-written TP sets `tp_dim`), or whole. A model may also be cut into pipeline
stages held by other ranks. Every function here that gathers is a collective: every rank calls it.

    whole(p, tp_group, p.tp_dim)            # one parameter (or its gradient) whole, on every rank
    full_parameters(module, tp_group)       # {name: whole parameter} of the module this rank holds
    full_gradients(module, tp_group)        # the same for the gradients (None where there is none)
    gather_stages(pieces, shapes, send)     # {name: tensor} of the whole model from every stage's pieces
    checksum(tensors)                       # the sum of squares in float64: equal for equal parameters
"""

import torch
import torch.distributed as dist
from torch import nn

from utils.distributed_utils import is_dtensor


def gather_dim(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' shards of `group`, concatenated along `dim` in rank order (one all-gather)."""
    moved = shard.movedim(dim, 0).contiguous()
    out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def whole(tensor: torch.Tensor, tp_group=None, tp_dim: int | None = None) -> torch.Tensor:
    """A parameter or a gradient whole, detached: a DTensor replicated over its mesh, a hand-written TP shard
    (cut along `tp_dim`: the parameter's tp_dim, given for its gradient too) gathered over tp_group, anything
    else as it is.

    TP shards a projection's weight along dim 0 over "tp", then FSDP2 shards each TP shard again along dim 0 over
    "dp": the placements are (_StridedShard(0), Shard(0)) on the (dp, tp) mesh, and this rank's rows are not one
    contiguous block of the whole weight. full_tensor() asks for both mesh dimensions at once; DTensor cannot merge
    them into one all-gather, so it runs two and warns on every rank. Undoing the layers in the reverse order of
    building them, the outer (FSDP's) dimension first, is the same two all-gathers, each as planned, and no warning."""
    tensor = tensor.detach()
    if is_dtensor(tensor):
        from torch.distributed.tensor import Replicate

        placements = list(tensor.placements)
        for dim in range(len(placements)):  # the mesh's outer dimension (applied last) first
            placements[dim] = Replicate()
            tensor = tensor.redistribute(tensor.device_mesh, placements)
        return tensor.to_local()
    return tensor if tp_dim is None else gather_dim(tensor, tp_dim, tp_group)


def full_parameters(module: nn.Module, tp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter of `module` whole, under the names of the unsharded model."""
    return {name: whole(p, tp_group, getattr(p, "tp_dim", None)) for name, p in module.named_parameters()}


def full_gradients(module: nn.Module, tp_group=None) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient whole (None where there is none), like full_parameters."""
    return {
        name: None if p.grad is None else whole(p.grad, tp_group, getattr(p, "tp_dim", None))
        for name, p in module.named_parameters()
    }


def gather_stages(pieces: dict[str, torch.Tensor], shapes: dict[str, torch.Size], send: bool = True) -> dict:
    """The whole model's parameters on every rank, from the pieces each pipeline stage holds (whole already).

    shapes: the full model's parameters and their shapes, in its order (the result keeps it). send: this rank
    contributes its pieces (one rank per stage is enough: e.g. dp = tp = 0, whose copies are the others').
    Asserted: the stages together hold each parameter of the model exactly once, at its full shape."""
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {name: t.detach().cpu() for name, t in pieces.items()} if send else {})
    held = sorted(name for part in everything for name in part)
    assert held == sorted(shapes), f"the stages do not hold each of the model's parameters once: {held[:4]}"
    merged = {name: tensor for part in everything for name, tensor in part.items()}
    wrong = [name for name in shapes if merged[name].shape != shapes[name]]
    assert not wrong, f"{wrong[0]} was gathered as {list(merged[wrong[0]].shape)}, not {list(shapes[wrong[0]])}"
    return {name: merged[name] for name in shapes}


def checksum(tensors) -> float:
    """The tensors' sums of squares in float64, added in the order given: bit for bit the same for the same
    parameters in the same order, however they were sharded before being gathered."""
    return sum(float(t.double().pow(2).sum()) for t in tensors)
