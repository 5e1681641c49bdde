"""Lesson 06's plumbing: the full model back from a 3D layout, how each parameter is stored, what a step did.

full_parameters(stage, tp_group, shapes, keep)  # ({name: whole tensor}, checksum) on every rank
describe_placements(stage)                       # {name: how this rank stores it}, for the metrics
with measure_step(active) as seen: ...           # seen.activation_bytes, seen.collectives after the block
reference_gradient_norms(config, batch, steps)   # one process's clip_grad_norm_ totals on lesson 00's batches
draw_rank_groups({title: {dim: groups}}, 4, t)   # the notebook's picture of which groups leave a node
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from utils.collective_counter import CollectiveCounter
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
        self.ranges: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges saved in it
        self.storages = []  # keeps every storage seen alive until the block ends

    def _pack(self, tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter) and not isinstance(tensor, nn.Parameter) and local.numel():
            storage = local.untyped_storage()
            self.storages.append(storage)
            start = local.storage_offset() * local.element_size()
            reach = sum((size - 1) * stride for size, stride in zip(local.shape, local.stride())) + 1
            # Keyed by the storage itself (its C++ object), not by data_ptr(): fake tensors (utils/measure_at_scale.py)
            # all have address 0. Kept alive until the block ends, no key is reused.
            self.ranges.setdefault(storage._cdata, []).append((start, start + reach * local.element_size()))
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


@dataclass
class StepSeen:
    """What one measured step left: the bytes saved for backward, and the collectives this rank ran
    ({kind: [calls, bytes]}, None when not counted)."""

    activation_bytes: int = 0
    collectives: dict | None = None


@contextlib.contextmanager
def measure_step(active: bool, count_collectives: bool = True):
    """Measure the step run inside the block (when `active`): SavedActivations' bytes, and every collective with
    utils/collective_counter.py (FSDP2's all-gathers and reduce-scatters, TP's all-reduces; not the pipeline's
    sends). The counter sees every operation from Python, which slows the step: count_collectives=False where the
    step's times matter (a recorded timeline). Yields a StepSeen filled in when the block ends, or None."""
    if not active:
        yield None
        return
    seen = StepSeen()
    counter = CollectiveCounter() if count_collectives else contextlib.nullcontext()
    with SavedActivations() as saved, counter:
        yield seen
    seen.activation_bytes = saved.bytes
    if count_collectives:
        seen.collectives = counter.table().get("all", {})


def reference_gradient_norms(config, batch_size: int, steps: int, seed: int = 0) -> tuple[list[float], float]:
    """Lesson 00's training on one process (its batches of `batch_size` synthetic sequences, SGD at the course's
    learning rate), written out with PyTorch alone: the total gradient norm clip_grad_norm_ returns at each step,
    and the final parameters' checksum (utils.metrics.param_checksum) to show that it is lesson 00's run."""
    from torch.utils.data import DataLoader

    from utils.data import load_token_dataset
    from utils.metrics import param_checksum
    from utils.model import build_model, loss_fn
    from utils.training import DEFAULT_LR

    model = build_model(config, seed=seed)
    data = load_token_dataset("synthetic", config.seq_len, "train")
    order = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True, generator=order)
    optimizer = torch.optim.SGD(model.parameters(), lr=DEFAULT_LR["sgd"])
    norms = []
    for _, (inputs, targets) in zip(range(steps), loader):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
    return norms, param_checksum(model)


GROUP_COLOURS = {"tp": "#d62728", "dp": "#1f77b4", "pp": "#2ca02c", "dp_shard": "#17becf", "dp_replicate": "#9467bd"}


def draw_rank_groups(panels: dict[str, dict[str, list[list[int]]]], gpus_per_node: int, title: str):
    """One panel per entry {title: {dimension: its groups}}: the ranks on their nodes (each node's GPUs as a square
    grid, node 1 right of node 0), a line per pair of neighbours in a group, coloured by dimension; a link that
    leaves its node is bowed so that it passes no rank."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    side = math.isqrt(gpus_per_node)
    world = max(rank for groups in panels.values() for members in groups.values() for g in members for rank in g) + 1

    def where(rank):
        node, local = divmod(rank, gpus_per_node)
        return node * (1.2 * side + 1) + (local % side) * 1.2, -(local // side) * 1.2

    shown = {}
    with plt.rc_context({"font.size": 11, "axes.titlesize": 11, "legend.fontsize": 10}):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 3.4), constrained_layout=True)
        for ax, (name, groups) in zip(axes, panels.items()):
            for node in range(world // gpus_per_node):
                x0 = node * (1.2 * side + 1) - 0.5
                ax.add_patch(plt.Rectangle((x0, -1.2 * side + 0.7), 1.2 * side, 1.2 * side, fill=False, ls=":"))
                ax.text(x0 + 0.6 * side, 0.85, f"node {node}", ha="center")
            for dim, members in groups.items():
                for group in members:
                    for a, b in zip(group, group[1:]):
                        bow = 0.3 if a // gpus_per_node != b // gpus_per_node else 0.0
                        ax.annotate("", xy=where(b), xytext=where(a), arrowprops={
                            "arrowstyle": "-", "color": GROUP_COLOURS[dim], "linewidth": 2.5,
                            "connectionstyle": f"arc3,rad={bow}", "shrinkA": 9, "shrinkB": 9})  # fmt: skip
                shown[dim] = GROUP_COLOURS[dim]
            for rank in range(world):
                ax.text(*where(rank), str(rank), ha="center", va="center", bbox={"boxstyle": "circle", "fc": "white"})
            ax.set_xlim(-0.8, (world // gpus_per_node) * (1.2 * side + 1) - 0.6)
            ax.set_ylim(-1.2 * side - 0.2, 1.1)
            ax.set_aspect("equal")
            ax.axis("off")
            ax.set_title(name)
        words = {"tp": "TP group", "dp": "DP group", "pp": "PP group (a pipeline)", "dp_shard": "FSDP shard group",
                 "dp_replicate": "replica group (gradient all-reduce)"}  # fmt: skip
        handles = [Line2D([], [], color=colour, linewidth=2.5, label=words[dim]) for dim, colour in shown.items()]
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles))
        fig.suptitle(title, fontsize=12)
    return fig
