"""Lesson 03's measurements: what each strategy built, the bytes it holds at its peak, first-step gradients.

Plumbing for solutions/03_zero_fsdp.py, kept here so that the lesson's script reads as the technique. The script
says what it built: `zero_optimizer=` a ZeroOptimizer (read: its buckets `flats`, `group`, `shard_gradients`),
`zero3=` a Zero3 (read: `units`, `names`, `root`, `timeline`, `gathered_bytes()`, `holds()`, `full_state_dict()`,
`peak_gathered_in_backward`); nothing here guesses a strategy from the objects, so a learner's exercise is
measured exactly like the solution.
"""

import math
import time
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from utils.collective_counter import CountCollectives
from utils.distributed_utils import print0
from utils.gather import checksum
from utils.memory import model_state_bytes, peak_model_state_bytes
from utils.metrics import SavedActivations, param_checksum, state_bytes


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


def built_layout(zero_optimizer=None, zero3=None) -> dict:
    """What a sharded strategy built, from every rank: ZeroOptimizer's buckets (numel, S, each rank's [lo, hi))
    and Zero3's units (numel, S, bytes of the gathered buffer, which is the root, where each parameter sits)."""
    if zero_optimizer is not None:
        flats, group = zero_optimizer.flats, zero_optimizer.group
        mine = [(f["flat"].numel(), f["shard_numel"], f["lo"], f["hi"], f["shard"].numel()) for f in flats]
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        return {
            "buckets": [
                {"numel": numel, "shard_numel": s, "ranges": [ranks[i][2:4] for ranks in everyone],
                 "inner_numels": [ranks[i][4] for ranks in everyone]}
                for i, (numel, s, *_) in enumerate(mine)
            ]
        }  # fmt: skip
    if zero3 is not None:
        return {
            "units": [
                {"numel": u.numel, "shard_numel": u.shard_numel, "root": u is zero3.root,
                 "gathered_bytes": u.full.numel() * u.full.element_size(), "views": unit_views(u, names)}
                for u, names in zip(zero3.units, zero3.names)
            ]
        }  # fmt: skip
    return {}


def unit_views(unit, names) -> list:
    """Where each parameter of a Zero3 unit sits in its flat buffer: [qualified name, first element, end], in the
    buffer's order (a parameter shared under several names is listed under its first)."""
    views, offset = [], 0
    for shape, qualified in zip(unit.shapes, names):
        numel = math.prod(shape)
        views.append([qualified[0], offset, offset + numel])
        offset += numel
    return views


@torch.no_grad()
def gradient_norms(model, zero_optimizer=None, zero3=None) -> dict | None:
    """{parameter name: sum of squares of its full gradient averaged over ranks} after backward (a collective
    for sharded models), for DDP, Zero3 and FSDP2; None for ZeRO-1/2 (reduced only partly before the step)."""
    if zero_optimizer is not None:
        return None
    if zero3 is not None:
        norms = {}
        for unit, names in zip(zero3.units, zero3.names):
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


def peak_bytes(model, gradient_peak: GradientPeak, held: dict, zero3=None) -> dict:
    """Parameters and gradients at their largest during the last backward (bytes on this rank), beside `held`
    (what stays after the step). FSDP2 keeps its gathered parameters and unsharded gradients in buffers of its
    own: None there (on a GPU, torch.cuda.max_memory_allocated tells)."""
    if zero3 is not None:
        return {"params": held["params"] + zero3.peak_gathered_in_backward, "grads": gradient_peak.peak}
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return {"params": None, "grads": None}
    return {"params": held["params"], "grads": gradient_peak.peak}


def in_flight(zero_optimizer=None, zero3=None) -> dict:
    """What exists only during backward, for utils.memory.peak_model_state_bytes: ZeRO-2's largest bucket of full
    gradients, ZeRO-3's gathered parameters (the root and the largest other unit, in elements)."""
    if zero_optimizer is not None and zero_optimizer.shard_gradients:
        return {"bucket_params": max(f["flat"].numel() for f in zero_optimizer.flats)}
    if zero3 is not None:
        sizes = [u.full.numel() for u in zero3.units if u is not zero3.root]
        root = zero3.root.full.numel() if zero3.root is not None else 0
        return {"gathered_params": root + max(sizes, default=0), "gathered_bytes": zero3.units[0].full.element_size()}
    return {}


# --------------------------------------------------------------------------------------------------
# Bytes on the wire, held bytes, checksums
# --------------------------------------------------------------------------------------------------


def wire_volume(wire: dict) -> int:
    """In units of 'one reduce-scatter or one all-gather of the data': an all-reduce is both, so it counts twice.
    A ring moves (N-1)/N of this volume through each rank's link (the bus bytes)."""
    return 2 * wire["all_reduce"] + wire["all_gather"] + wire["reduce_scatter"]


def counting_allreduce_hook(wire: dict, bucket):
    """DDP's own all-reduce of a gradient bucket, counted into `wire` like the hand-written collectives:
    model.register_comm_hook(WIRE, counting_allreduce_hook)."""
    wire["all_reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


def mesh_groups(mesh) -> dict:
    """FSDP2's process groups by their mesh dimension's name: "shard" (and "replicate" for HSDP)."""
    return {name: mesh.get_group(name) for name in mesh.mesh_dim_names}


def full_checksum(model, zero3=None) -> float:
    if zero3 is not None:
        return checksum(zero3.full_state_dict().values())
    return param_checksum(model)


def held_bytes(model, optimizer, zero_optimizer=None) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds now (measured from its tensors)."""
    held = state_bytes(model, optimizer)  # model.parameters() (local shards of DTensors), .grad, optimizer.state
    if zero_optimizer is not None:  # ZeRO-2 keeps its gradient shards on the inner optimizer's tensors
        flats = zero_optimizer.flats
        held["grads"] += sum(f["shard"].grad.numel() * 4 for f in flats if f["shard"].grad is not None)
    return held


def optimizer_checksum(model, optimizer, hand_written=False) -> float | None:
    """Sum of squares of the full optimizer state (a collective for sharded models); None for the hand-written
    strategies (ZeRO-1/2/3: their optimizers hold flat shards, not the model's parameters)."""
    if hand_written:
        return None
    state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))[1]["state"]
    return sum(float(v.double().pow(2).sum()) for s in state.values() for v in s.values() if v.dim() > 0)


def average(loss) -> float:
    """The loss averaged over ranks (each rank computed it on its own slice of the global batch)."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def is_model_state(model, zero3, tensor) -> bool:
    """Does `tensor` share memory with a parameter (sharded, or gathered for this forward)?"""
    if zero3 is not None:
        return zero3.holds(tensor)
    pointer = tensor.untyped_storage().data_ptr()
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return any(p.untyped_storage().data_ptr() == pointer for p in local)


# --------------------------------------------------------------------------------------------------
# The first step of a strategy, measured; the record of a finished one; the summary rank 0 prints
# --------------------------------------------------------------------------------------------------


class FirstStep:
    """What lesson 03 measures in a strategy's first step, written into `record` as it becomes known (so that a
    run stopped at an unfinished TODO still reports what it built):

        probe = FirstStep(model, WIRE)                 # before wrapping: it sees every full gradient
        model, optimizer, ... = wrap(...)
        probe.wrapped(model, optimizer, mesh, record, zero_optimizer=..., zero3=...)  # what the strategy built
        with probe.measuring(step == first):           # activations, FSDP2's own collectives, ZeRO-3's timeline
            loss = ...; probe.after_forward(loss); loss.backward(); probe.after_backward()
        optimizer.step(); probe.after_step()           # the hand-written collectives' bytes of one step
        probe.finish(estimate, counted, device)        # the record of the finished strategy

    Every step's time, from entering `measuring` to the end of `after_step` (forward, backward, optimizer step and
    their communication; not the data loading, the logging or the loss's averaging), goes into
    record["step_times_s"]. The first step also pays for the measuring and for one-off set-up work.
    """

    def __init__(self, model, wire: dict):
        self.wire, self.active = wire, False
        self.gradient_peak = GradientPeak(model.parameters())
        self.step_started = None

    def wrapped(self, model, optimizer, mesh, record: dict, zero_optimizer=None, zero3=None):
        """What the strategy built: the model and optimizer it trains, FSDP2's mesh (or None), and the lesson's own
        pieces when it built them (zero_optimizer: a ZeroOptimizer, ZeRO-1/2; zero3: the Zero3 module)."""
        self.model, self.optimizer, self.mesh, self.record = model, optimizer, mesh, record
        self.zero_optimizer, self.zero3 = zero_optimizer, zero3
        record.update(built_layout(zero_optimizer, zero3))
        if zero_optimizer is not None:
            self.gradient_peak.also_count(lambda flats=zero_optimizer.flats: [f["shard"].grad for f in flats])
        if zero3 is not None:
            self.gradient_peak = GradientPeak(zero3.parameters())  # the shards: autograd accumulates their gradients
        for key in self.wire:
            self.wire[key] = 0

    @contextmanager
    def measuring(self, active: bool):
        self.step_started = _clock()
        self.active = active
        if not active:
            yield
            return
        # Activations: bytes autograd saves for backward, not counting parameters (gathered ones included).
        saved = Activations(partial(is_model_state, self.model, self.zero3))
        library = CountCollectives(mesh_groups(self.mesh)) if self.mesh is not None else nullcontext()
        if self.zero3 is not None:
            self.zero3.timeline = []  # every gather and free of this step, in order
        with saved, library:
            yield
        self.record["activation_bytes"] = saved.peak_bytes
        if isinstance(library, CountCollectives):
            self.record["library_wire_bytes"] = library.bytes

    def after_forward(self, loss):
        if self.active:
            self.record["first_loss"] = average(loss)
            if self.zero3 is not None:
                self.record["gathered_bytes_after_forward"] = self.zero3.gathered_bytes()
                self.record["forward_events"] = len(self.zero3.timeline)
            self.gradient_peak.reset()

    def after_backward(self):
        if self.active:
            self.record["first_gradients"] = gradient_norms(self.model, self.zero_optimizer, self.zero3)
            held = held_bytes(self.model, self.optimizer, self.zero_optimizer)
            self.record["peak_bytes_in_backward"] = peak_bytes(self.model, self.gradient_peak, held, self.zero3)
            if self.zero3 is not None:
                self.record["gather_timeline"], self.zero3.timeline = self.zero3.timeline, None

    def after_step(self):
        if self.step_started is not None:
            self.record.setdefault("step_times_s", []).append(_clock() - self.step_started)
            self.step_started = None
        if self.active:
            self.record["wire_bytes_per_step"] = dict(self.wire)
            self.active = False

    def checksums(self) -> dict:
        """The full parameters' and optimizer state's checksums now (collectives for sharded models)."""
        hand_written = self.zero_optimizer is not None or self.zero3 is not None
        return {"param_checksum": full_checksum(self.model, self.zero3),
                "optimizer_checksum": optimizer_checksum(self.model, self.optimizer, hand_written)}  # fmt: skip

    def finish(self, estimate: dict, counted: bool, device):
        """A finished strategy's record: what it holds after the step beside the estimator's prediction (held and
        peak), checksums, and the hand-written strategies' bytes on the wire (`counted`)."""
        record, zero3 = self.record, self.zero3
        wire = record.get("wire_bytes_per_step")
        record.update(
            **self.checksums(),
            bytes_per_rank=held_bytes(self.model, self.optimizer, self.zero_optimizer),
            estimated_bytes_per_rank=model_state_bytes(**estimate),
            estimated_peak_bytes_in_backward=peak_model_state_bytes(
                **estimate, **in_flight(self.zero_optimizer, zero3)
            ),
            gathered_bytes_after_step=zero3.gathered_bytes() if zero3 is not None else None,
            wire_bytes_per_step=wire if counted else None,
            wire_volume_per_step=wire_volume(wire) if counted and wire else None,
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        )
        if device.type == "cuda":
            print0(f"{record['strategy']:>5}: peak GPU memory {record['peak_memory_bytes']:,} bytes (after wrapping)")


def _clock() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
    return time.perf_counter()


def report(results: dict):
    """Rank 0 prints, for each finished strategy, its bytes per rank beside the estimator's, and the rest."""
    for strategy, m in results.items():
        if "stopped" in m:
            continue
        held, estimate, peak = m["bytes_per_rank"], m["estimated_bytes_per_rank"], m["peak_bytes_in_backward"]
        print0(
            f"{strategy:>5}: bytes per rank params {held['params']:,} grads {held['grads']:,} optimizer "
            f"{held['optimizer']:,} (estimator: {estimate['params']:,} / {estimate['grads']:,} / "
            f"{estimate['optimizer']:,}) | activations {m['activation_bytes']:,}"
            + (f" | peak grads in backward {peak['grads']:,}" if peak["grads"] is not None else "")
            + (f" | wire volume {m['wire_volume_per_step']:,} per step" if m["wire_volume_per_step"] else "")
        )
