"""How each parameter of a 3D stage is stored on this rank, and the one change FSDP2's last stage needs.

describe_placements(stage)   # {name: how this rank stores it}, for the metrics
local_numel(stage)           # the parameters this rank holds
output_not_a_view(stage)     # the last stage returns logits of its own, not a view (else FSDP2 warns)
"""

from torch import nn
from torch.distributed.tensor import DTensor


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


def local_numel(module: nn.Module) -> int:
    """The parameters this rank holds: a DTensor's local shard, a hand-written TP shard, or a whole tensor."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


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
