"""Lesson 05's plumbing: what the pipeline script needs besides the technique itself.

- `check_builtin_available`: refuse a built-in schedule this torch does not have, in one line;
- `full_parameters`: every stage's parameters gathered into the full model's state dict, and its checksum;
- `batches`: endless batches from a loader, as lesson 00 takes them.
"""

import torch
import torch.distributed as dist

from utils.distributed_utils import CourseError


def check_builtin_available(class_name: str | None):
    """Refuse `torch.distributed.pipelining.<class_name>` when this torch lacks it (None: nothing to check)."""
    from torch.distributed import pipelining

    if class_name is not None and not hasattr(pipelining, class_name):
        raise CourseError(
            f"torch {torch.__version__} has no torch.distributed.pipelining.{class_name}; choose another --schedule "
            "or a newer torch"
        )


def full_parameters(stage_modules, names: list[str]) -> tuple[float, dict]:
    """(checksum, full state dict): gathered from every stage, in the full model's order (a collective).

    The checksum adds each parameter's sum of squares (float64) in the full model's order, so it is bit for bit
    utils.metrics.param_checksum of the same parameters in one process. The stages together must hold exactly
    the model's parameters, each once: asserted."""
    local = {name: p.detach().cpu() for module in stage_modules for name, p in module.named_parameters()}
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    held = [name for part in everything for name in part]
    assert sorted(held) == sorted(names), f"the stages do not hold each of the model's parameters once: {held[:4]}"
    merged = {name: tensor for part in everything for name, tensor in part.items()}
    checksum = sum(float(merged[name].double().pow(2).sum()) for name in names)
    return checksum, {name: merged[name] for name in names}


def batches(loader):
    """Endless batches: start another pass over the data whenever one ends (as lesson 00 does)."""
    while True:
        yield from loader
