"""What an expert-parallel run records for its log and its metrics file, and the full model it saves.

The lesson's MoE layers leave, after each forward: aux_loss (this rank's load-balancing loss), chosen and kept (the
choices per expert before and after the capacity), sent and received (rows to and from each rank) and seconds
(time in the experts and in the combine, summed). ExpertRecord turns them into the run's figures, all ranks
together, with one all-reduce a step.
"""

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from utils.gather import checksum as sum_of_squares


@contextmanager
def timed(seconds: dict, name: str, device: torch.device):
    """Add the block's wall time to seconds[name]. On a GPU, after its queued work is done (kernels and NCCL
    collectives run asynchronously: without the synchronisation the time would be that of queueing them)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    yield
    synchronize()
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


class ExpertRecord:
    """Step by step: the loss and each layer's load-balancing loss (means over the ranks), each expert's choices
    and kept rows (all ranks together); the rows each rank sent and received in step 1; each rank's seconds in its
    experts and in the combine, summed over the steps after the first (step 1 warms up)."""

    def __init__(self, layers, n_experts: int):
        self.layers, self.n_experts = list(layers), n_experts
        self.losses, self.aux_losses, self.chosen, self.kept, self.splits = [], [], [], [], []

    def step(self, loss: torch.Tensor) -> tuple[float, list[float]]:
        """After a step: (the mean loss over the ranks, each layer's mean load-balancing loss)."""
        world_size, n_layers = dist.get_world_size(), len(self.layers)
        summed = torch.cat([
            loss.detach().view(1) / world_size,
            torch.stack([block.mlp.aux_loss.detach() for block in self.layers]) / world_size,
            *[torch.cat([block.mlp.chosen, block.mlp.kept]).to(loss.dtype) for block in self.layers],
        ])  # fmt: skip
        dist.all_reduce(summed)
        self.losses.append(summed[0].item())
        self.aux_losses.append(summed[1 : 1 + n_layers].tolist())
        counts = summed[1 + n_layers :].view(n_layers, 2, self.n_experts).round().long().tolist()
        self.chosen.append([layer[0] for layer in counts])
        self.kept.append([layer[1] for layer in counts])
        if not self.splits:
            self.splits = [(list(block.mlp.sent), list(block.mlp.received)) for block in self.layers]
            for block in self.layers:
                block.mlp.seconds.clear()  # time the steps after the first
        return self.losses[-1], self.aux_losses[-1]

    @property
    def dropped(self) -> list:
        """[step][layer]: the choices dropped, all ranks together."""
        return [[sum(c) - sum(k) for c, k in zip(*step)] for step in zip(self.chosen, self.kept)]

    def busiest_expert(self, step: int = -1) -> float:
        """The most chosen expert's choices over the even share (total / E), the worst layer: 1 = balanced."""
        return max(max(layer) * self.n_experts / sum(layer) for layer in self.chosen[step])

    def line(self, step: int) -> str:
        aux = " ".join(f"{value:.3f}" for value in self.aux_losses[-1])
        return (
            f"step {step:4d}  loss {self.losses[-1]:.4f}  aux per layer {aux}  dropped {sum(self.dropped[-1])}  "
            f"busiest expert {self.busiest_expert():.2f} x the even share"
        )

    def metrics(self, all_to_all_bytes: int) -> dict:
        """The metrics file's part of it (every rank calls it): all_to_all_bytes, this rank's all-to-all input
        bytes in step 1."""
        mine = {
            "bytes": all_to_all_bytes,
            "send_splits": [sent for sent, _ in self.splits],  # [layer][rank]: rows to each rank, step 1
            "recv_splits": [received for _, received in self.splits],  # [layer][rank]: rows from each rank
            "seconds": [dict(block.mlp.seconds) for block in self.layers],  # [layer]{"experts", "combine"}
        }
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {
            "losses": self.losses,
            "aux_losses": self.aux_losses,  # [step][layer]
            "expert_choices": self.chosen,  # [step][layer][expert]: choices before the capacity, all ranks together
            "expert_load": self.kept,  # [step][layer][expert]: rows each expert processed
            "dropped": self.dropped,  # [step][layer]
            "timed_steps": len(self.losses) - 1,
            "per_rank": everyone,  # what each rank sent, received and spent (the list above)
        }


def full_weights(model, device: torch.device, keep: bool) -> tuple[dict | None, float]:
    """(every parameter of the whole MoE model where `keep`, each layer's experts gathered from every rank and
    stacked in expert order; the sum of their squares in float64, on every rank: the checksum one process's model
    has). Every rank must call it."""
    mine = {name: p.detach().cpu() for name, p in model.named_parameters() if ".experts." in name}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # rank r holds experts r E/N ... (r+1) E/N - 1: rank order is expert order
    full = {name: p.detach().cpu() for name, p in model.named_parameters() if ".experts." not in name}
    full.update({name: torch.cat([part[name] for part in everyone]) for name in mine})
    checksum = torch.tensor(sum_of_squares(full.values()), dtype=torch.float64, device=device)
    dist.broadcast(checksum, src=0)  # rank 0's figure everywhere (the same sums, added in the same order)
    return (full if keep else None), float(checksum)
