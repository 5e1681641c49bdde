"""Lesson 06's plumbing: the full model back from a 3D layout, and how each parameter is stored.

full_parameters(stage, tp_group, shapes, keep)  # ({name: whole tensor}, checksum) on every rank
describe_placements(stage)                       # {name: how this rank stores it}, for the metrics
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from utils.tensor_parallel import _gather


def _whole(p: torch.Tensor, tp_group) -> torch.Tensor:
    """One parameter whole: a DTensor replicated over its mesh, a hand-written TP shard gathered over tp_group.

    TP sharded a projection's weight along dim 0 over "tp", then FSDP2 sharded each TP shard again along dim 0
    over "dp": the placements are (_StridedShard(0), Shard(0)) on the (dp, tp) mesh, and this rank's rows are
    not one contiguous block of the whole weight. full_tensor() asks for both dimensions at once; DTensor cannot
    merge them into one all-gather (the shards are not in ascending order), so it runs two and warns on every
    rank. Undoing the layers in the reverse order of building them, FSDP's dimension first (dp: one all-gather
    gives back the TP shard), then TP's, is the same two all-gathers, each as planned, and no warning."""
    if isinstance(p, DTensor):
        p = p.detach()
        placements = list(p.placements)
        for dim in range(len(placements)):  # the mesh's outer dimension (dp, applied last) first
            placements[dim] = Replicate()
            p = p.redistribute(p.device_mesh, placements)
        return p.to_local()
    if hasattr(p, "tp_dim"):  # lesson 04's hand-written shard
        return _gather(p.detach(), p.tp_dim, tp_group)
    return p


def full_parameters(stage: nn.Module, tp_group, shapes: dict[str, torch.Size], keep: bool) -> tuple[dict, float]:
    """Every parameter of the model whole, gathered from every stage (a collective: every rank calls it).

    shapes: the full model's parameters and their shapes, in its order. keep: this rank sends its stage's
    parameters (one rank per stage, e.g. dp = tp = 0; the others hold copies or the same shards). Returns (state
    dict in that order, checksum): the checksum adds the parameters' sums of squares (float64) in that order, so
    it is bit for bit utils.metrics.param_checksum of one process."""
    whole = {name: _whole(p, tp_group).detach().cpu() for name, p in stage.named_parameters()}
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, whole if keep else {})
    merged = {name: tensor for part in everything for name, tensor in part.items()}
    held = sorted(name for part in everything for name in part)
    assert held == sorted(shapes), f"the stages do not hold each of the model's parameters once: {held[:4]}"
    wrong = [name for name in shapes if merged[name].shape != shapes[name]]
    assert not wrong, f"{wrong[0]} was gathered as {list(merged[wrong[0]].shape)}, not {list(shapes[wrong[0]])}"
    checksum = sum(float(merged[name].double().pow(2).sum()) for name in shapes)
    return {name: merged[name] for name in shapes}, checksum


def describe_placements(stage: nn.Module) -> dict[str, list[str]]:
    """How this rank stores each of its stage's parameters: DTensor placements per mesh dimension, a hand-written
    TP shard's dimension, or "whole"."""
    described = {}
    for name, p in stage.named_parameters():
        if isinstance(p, DTensor):
            described[name] = [
                f"{dim}: {placement}" for dim, placement in zip(p.device_mesh.mesh_dim_names, p.placements)
            ]
        elif hasattr(p, "tp_dim"):
            described[name] = [f"tp: Shard(dim={p.tp_dim})"]
        else:
            described[name] = ["whole"]
    return described


def output_not_a_view(stage: nn.Module):
    """Make the (FSDP2-wrapped) last stage return a tensor of its own instead of a view.

    The last stage returns the head's logits, and nn.Linear on a [batch, seq, dim] input computes one matrix
    product on the flattened tokens and returns a view of it. FSDP2 warns on every last-stage rank when a wrapped
    module returns a view, because an in-place operation on a view would drop its pre-backward hook. Nothing here
    writes to the logits, but a copy (one logits-sized tensor per micro-batch, freed by the loss) makes that true
    by construction instead of by inspection. prepend=True: this hook runs before FSDP2's own forward hook."""
    stage.register_forward_hook(
        lambda module, args, output: output.clone() if output._base is not None else output, prepend=True
    )


class SavedActivations:
    """Bytes that autograd keeps for backward while the block runs, counted with saved_tensors_hooks.

        with SavedActivations() as saved:
            loss = model(tokens)...
        saved.bytes      # the memory the saved tensors reach, each byte once

    What counts: every tensor an operation saves for its backward (its own, or a view of another), except the
    parameters and views of them (model state, counted by utils/memory.py). A saved tensor reaches a byte range
    of its storage (offset to its last element); ranges of one storage are merged, so views that share memory
    (the heads are views of a projection's output; a micro-batch is a slice of the batch) count once, and a slice
    counts only the bytes it reaches, not its whole batch. A DTensor counts its local shard. The storages are
    kept alive until the block ends, so that no freed address is reused and counted twice."""

    def __init__(self):
        self.ranges: dict[int, list[tuple[int, int]]] = {}  # storage address -> byte ranges saved in it
        self.storages = []  # keeps every storage seen alive until the block ends

    def _pack(self, tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter) and not isinstance(tensor, nn.Parameter) and local.numel():
            storage = local.untyped_storage()
            self.storages.append(storage)
            start = local.storage_offset() * local.element_size()
            reach = sum((size - 1) * stride for size, stride in zip(local.shape, local.stride())) + 1
            self.ranges.setdefault(storage.data_ptr(), []).append((start, start + reach * local.element_size()))
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.storages.clear()

    @property
    def bytes(self) -> int:
        total = 0
        for ranges in self.ranges.values():
            end = 0
            for start, stop in sorted(ranges):  # the union of the ranges: overlaps once
                total += max(0, stop - max(start, end))
                end = max(end, stop)
        return total


def local_numel(module: nn.Module) -> int:
    """The parameters this rank holds: a DTensor's local shard, a hand-written TP shard, or a whole tensor."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
