"""Lesson 03's measurements: what each strategy built, the bytes it holds at its peak, first-step gradients.

Plumbing for solutions/03_zero_fsdp.py, kept here so that the lesson's script reads as the technique. It
recognises the lesson's classes by what they hold (`optimizer.flats`: ZeroOptimizer's buckets; `model.units`:
Zero3's gathered units), so a learner's exercise is measured exactly like the solution.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from utils.metrics import SavedActivations


def is_zero3(model) -> bool:
    return hasattr(model, "units") and hasattr(model, "gathered_bytes")


def is_zero_optimizer(optimizer) -> bool:
    return hasattr(optimizer, "flats")


class GradientPeak:
    """The most gradient bytes alive at once during backward: sampled each time autograd finishes a parameter's
    gradient. Register it before anything else hooks the parameters (ZeRO-2's hook frees gradients)."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.extra = lambda: []  # more gradient tensors to count (ZeRO-2's shards)
        self.peak = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._sample)

    def also_count(self, tensors):
        self.extra = tensors

    def reset(self):
        self.peak = 0

    def _sample(self, _):
        alive = {id(t): t for t in [*(p.grad for p in self.params), *self.extra()] if t is not None}
        self.peak = max(self.peak, sum(_local(t).numel() * t.element_size() for t in alive.values()))


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Activations(SavedActivations):
    """SavedActivations that leaves out every tensor `is_model_state(tensor)` says is a parameter (sharded, or
    gathered for this forward): parameters are model state, not activations. (SavedActivations' `exclude`
    takes fixed tensors; ZeRO-3's gathered parameters exist only while their unit runs, hence a predicate.)"""

    def __init__(self, is_model_state):
        super().__init__()
        self.is_model_state = is_model_state

    def _pack(self, tensor):
        return tensor if self.is_model_state(tensor) else super()._pack(tensor)


def built_layout(model, optimizer) -> dict:
    """What a sharded strategy built, from every rank: ZeroOptimizer's buckets (numel, S, each rank's [lo, hi))
    and Zero3's units (numel, S, bytes of the gathered buffer, which is the root)."""
    if is_zero_optimizer(optimizer):
        mine = [(f["flat"].numel(), f["shard_numel"], f["lo"], f["hi"], f["shard"].numel()) for f in optimizer.flats]
        everyone = [None] * dist.get_world_size(optimizer.group)
        dist.all_gather_object(everyone, mine, group=optimizer.group)
        return {
            "buckets": [
                {"numel": numel, "shard_numel": s, "ranges": [ranks[i][2:4] for ranks in everyone],
                 "inner_numels": [ranks[i][4] for ranks in everyone]}
                for i, (numel, s, *_) in enumerate(mine)
            ]
        }  # fmt: skip
    if is_zero3(model):
        return {
            "units": [
                {"numel": u.numel, "shard_numel": u.shard_numel, "root": u is model.root,
                 "gathered_bytes": u.full.numel() * u.full.element_size()}
                for u in model.units
            ]
        }  # fmt: skip
    return {}


@torch.no_grad()
def gradient_norms(model, optimizer) -> dict | None:
    """{parameter name: sum of squares of its full gradient averaged over ranks} after backward (a collective
    for sharded models), for DDP, Zero3 and FSDP2; None for ZeRO-1/2 (reduced only partly before the step)."""
    if is_zero_optimizer(optimizer):
        return None
    if is_zero3(model):
        norms = {}
        for unit, names in zip(model.units, model.names):
            grad = unit.shard.grad if unit.shard.grad is not None else torch.zeros_like(unit.shard)
            full = torch.empty(unit.shard_numel * dist.get_world_size(unit.group), dtype=grad.dtype, device=grad.device)
            dist.all_gather_single(full, grad.contiguous(), group=unit.group)
            offset = 0
            for shape, qualified in zip(unit.shapes, names):
                numel = shape.numel()
                norms[qualified[0]] = float(full[offset : offset + numel].double().pow(2).sum())
                offset += numel
        return norms
    module = getattr(model, "module", model)  # DDP wraps the model
    norms = {}
    for name, p in module.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        norms[name] = float(grad.double().pow(2).sum()) if grad is not None else 0.0
    return norms


def peak_bytes(model, optimizer, gradient_peak: GradientPeak, held: dict) -> dict:
    """Parameters and gradients at their largest during the last backward (bytes on this rank), beside `held`
    (what stays after the step). FSDP2 keeps its gathered parameters and unsharded gradients in buffers of its
    own: None there (on a GPU, torch.cuda.max_memory_allocated tells)."""
    if is_zero3(model):
        return {"params": held["params"] + model.peak_gathered_in_backward, "grads": gradient_peak.peak}
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return {"params": None, "grads": None}
    return {"params": held["params"], "grads": gradient_peak.peak}


def in_flight(model, optimizer) -> dict:
    """What exists only during backward, for utils.memory.peak_model_state_bytes: ZeRO-2's largest bucket of full
    gradients, ZeRO-3's gathered parameters (the root and the largest other unit, in elements)."""
    if is_zero_optimizer(optimizer) and optimizer.shard_gradients:
        return {"bucket_params": max(f["flat"].numel() for f in optimizer.flats)}
    if is_zero3(model):
        sizes = [u.full.numel() for u in model.units if u is not model.root]
        root = model.root.full.numel() if model.root is not None else 0
        return {"gathered_params": root + max(sizes, default=0), "gathered_bytes": model.units[0].full.element_size()}
    return {}
