"""How lesson 04's script reports a parameter's layout on this rank, for both of its implementations.

describe(model, "blocks.0.attention.q_proj.weight")   # {"type", "placements", "global_shape", "local_shape"}
"""

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


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
