"""Lesson 03: ZeRO and FSDP. Data parallelism that shards the optimizer state, the gradients, then the parameters.

DDP keeps a full copy of the parameters, gradients and optimizer state on every rank. ZeRO removes the
copies stage by stage: ZeRO-1 gives each rank 1/N of the optimizer state (ZeroOptimizer), ZeRO-2 also
1/N of the gradients (reduce-scatter instead of all-reduce), ZeRO-3 also 1/N of the parameters (Zero3:
each block's parameters are all-gathered just before they are used and freed right after). All are
built here from torch.distributed collectives, then replaced by PyTorch's FSDP2 (`fully_shard`) and its
hybrid form HSDP (shard inside a node, replicate across nodes), with bf16 compute and distributed
checkpoints that load at another world size. Every strategy trains exactly like one process.

    torchrun --nproc_per_node=4 solutions/03_zero_fsdp.py                        # FSDP2 (default)
    torchrun --nproc_per_node=4 solutions/03_zero_fsdp.py --strategy zero3       # the hand-written ZeRO-3
    torchrun --nproc_per_node=4 solutions/03_zero_fsdp.py --strategy all         # each strategy in turn
    torchrun --nproc_per_node=4 solutions/03_zero_fsdp.py --precision bf16 --save-dcp runs/ckpt
    torchrun --nproc_per_node=2 solutions/03_zero_fsdp.py --resume runs/ckpt --steps 400   # 4 ranks -> 2
    sbatch slurm/03_zero_fsdp_hsdp_2nodes.sbatch solutions --strategy hsdp       # 2 nodes x 4 GPUs
"""

import argparse
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, Refusal, destroy_process_group, print0, run_main, setup
from utils.lesson_03.checkpoint import resume, save_checkpoints
from utils.lesson_03.metrics import FirstStep, average, counting_allreduce_hook, report
from utils.lesson_03.options import lesson_parser, settle
from utils.metrics import write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import DEFAULT_LR, Logger, Throughput, batches, check_batches, model_config, parse_args

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}  # what each strategy shards

# --------------------------------------------------------------------------------------------------
# Bytes on the wire: every collective of the hand-written strategies goes through these three functions
# --------------------------------------------------------------------------------------------------

WIRE = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}  # bytes of the full tensor, per collective kind


def all_reduce(tensor, group=None, op=dist.ReduceOp.AVG):
    """The average over ranks (or `op`) of `tensor`, in place on every rank."""
    WIRE["all_reduce"] += tensor.numel() * tensor.element_size()
    dist.all_reduce(tensor, op=op, group=group)


def all_gather(full, shard, group=None):
    """Every rank's `shard`, concatenated in rank order, into `full` (world size x shard elements)."""
    WIRE["all_gather"] += full.numel() * full.element_size()
    dist.all_gather_single(full, shard, group=group)


def reduce_scatter(shard, full, group=None, op=dist.ReduceOp.AVG):
    """The average over ranks (or `op`) of `full`, of which this rank receives its own slice into `shard`."""
    WIRE["reduce_scatter"] += full.numel() * full.element_size()
    dist.reduce_scatter_single(shard, full, op=op, group=group)


# --------------------------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2: an optimizer that keeps state for 1/N of the parameters
# --------------------------------------------------------------------------------------------------


def buckets(params, cap_mb: float) -> list[list]:
    """params in reverse order (backward produces the last layer's gradients first), cut into groups of at most
    cap_mb megabytes (a parameter larger than that is a bucket of its own). cap_mb=math.inf: one bucket."""
    result, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() * p.element_size() > cap_mb * 2**20:
            result.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    return result + [current] if current else result


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (shard_gradients=False) or ZeRO-2 (True) around any torch optimizer class:

        optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

    Each parameter group's trainable parameters are cut into buckets (in reverse order: the order in which
    backward produces their gradients; one bucket per group for ZeRO-1) and become views of one flat buffer
    per bucket. Each rank owns one contiguous slice of each bucket (TODO 1), and the inner optimizer holds
    state for those slices only. ZeRO-2 reduce-scatters
    a bucket's gradients as soon as backward has produced all of them and frees the full ones, so at most
    about a bucket of full gradients exists at a time. state_dict() is this rank's shard (its inner optimizer's).
    """

    def __init__(self, params, optimizer_cls, *, shard_gradients=False, bucket_cap_mb=25.0, group=None, **kwargs):
        super().__init__(params, kwargs)
        self.group, self.shard_gradients = group, shard_gradients
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.flats = []  # one per bucket: {params, flat, lo, hi, shard_numel, shard, ready}
        inner_groups = []
        for param_group in self.param_groups:
            params = [p for p in param_group["params"] if p.requires_grad]  # frozen ones stay as they are
            shards = []
            for bucket in buckets(params, bucket_cap_mb if shard_gradients else math.inf):
                numel = sum(p.numel() for p in bucket)
                flat = torch.zeros(numel, dtype=bucket[0].dtype, device=bucket[0].device)
                offset = 0
                for p in bucket:  # the model's parameters become views of the flat buffer: updating it updates them
                    flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                # TODO 1: this rank's shard of the optimizer state. The ranks own equal contiguous slices of the
                #   bucket (the last may be shorter) that cover it exactly; the inner optimizer is given this
                #   rank's alone, so it keeps state for 1/N of the parameters.
                # HINT 1: if every rank's slice has the same size S and together they cover the bucket, what must S
                #   be when the bucket's size does not divide by N? Where does rank r's slice start and end?
                # HINT 2: S is the bucket's size over the world size, rounded up; this rank's slice starts at
                #   rank * S and ends S later, both ends clipped to the bucket's size; the shard is a view of that
                #   slice of the flat buffer (not a copy: stepping it must update the model's parameters).
                # HINT 3: Each rank owns the slice [lo, hi) of the flat buffer, S = ceil(numel / world_size)
                #   elements from rank * S (clipped to numel, so the last rank's may be shorter), and gives the
                #   inner optimizer that slice alone: the view flat[lo:hi], not a copy.
                # BEGIN SOLUTION
                shard_numel = math.ceil(numel / self.world_size)
                lo, hi = min(self.rank * shard_numel, numel), min((self.rank + 1) * shard_numel, numel)
                shard = flat[lo:hi]
                # EXERCISE
                # shard_numel, lo, hi = numel, 0, numel  # every rank steps everything: DDP's optimizer
                # shard = flat
                # END SOLUTION
                self.flats.append(
                    dict(params=bucket, flat=flat, lo=lo, hi=hi, shard_numel=shard_numel, shard=shard, ready=set())
                )
                shards.append(shard)
            options = {k: v for k, v in param_group.items() if k != "params"}
            inner_groups.append({**options, "params": shards})
        self.optimizer = optimizer_cls(inner_groups)
        self.state = self.optimizer.state  # what this rank holds: the state of its shard only
        self._bucket_of = {p: flat for flat in self.flats for p in flat["params"]}
        self._next_bucket = len(self.flats)  # ZeRO-2: the next bucket to reduce-scatter (all done: none pending)
        if shard_gradients:
            for p in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._gradient_ready)

    @torch.no_grad()
    def step(self, closure=None):
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):  # lr schedules change the outer
            inner.update({k: v for k, v in outer.items() if k != "params"})
        if self.shard_gradients:
            self.reduce_scatter_remaining()  # buckets backward did not complete (unused parameters)
        # TODO 2: the ZeRO-1 step. Each rank's inner optimizer updates its own slice from the gradient averaged
        #   over ranks (ZeRO-2 has reduced it already); afterwards every rank holds all the new parameters. Use the
        #   counting collectives above.
        # HINT 1: the inner optimizer sees only this rank's slice: where does that slice's gradient come from in
        #   ZeRO-1, and once it has stepped, how does each rank learn what the others updated? A collective that
        #   gathers needs pieces of one size: what about the last, shorter slice?
        # HINT 2: for each bucket, ZeRO-1 only: average the padded gradient (_padded_gradients) across ranks and
        #   give the shard its [lo, hi) part as .grad. Step the inner optimizer. Then for each bucket: pad this
        #   rank's updated slice to S elements, all-gather the N padded slices, copy the first numel elements
        #   back into the flat buffer; let go of ZeRO-1's gradient view.
        # HINT 3: (a) ZeRO-1 only: all-reduce the full padded gradient (`all_reduce`) and hand the inner optimizer
        #   its slice [lo, hi) as the shard's .grad. (b) Step the inner optimizer: it updates this rank's slice of
        #   `flat` in place. (c) Pad this rank's slice to S elements, `all_gather` into a buffer of N x S elements,
        #   copy its first numel elements into `flat` (all-gather needs equal pieces: hence the padding).
        # BEGIN SOLUTION
        for flat in self.flats:
            if not self.shard_gradients:
                full = self._padded_gradients(flat)
                all_reduce(full, self.group)
                flat["shard"].grad = full[flat["lo"] : flat["hi"]]
        self.optimizer.step()
        for flat in self.flats:
            mine = torch.zeros(flat["shard_numel"], dtype=flat["flat"].dtype, device=flat["flat"].device)
            mine[: flat["hi"] - flat["lo"]] = flat["shard"]
            gathered = torch.empty(flat["shard_numel"] * self.world_size, dtype=mine.dtype, device=mine.device)
            all_gather(gathered, mine, self.group)
            flat["flat"].copy_(gathered[: flat["flat"].numel()])
            if not self.shard_gradients:
                flat["shard"].grad = None  # a view of the full gradient buffer: do not keep it alive
        # EXERCISE
        # raise NotImplementedError("TODO 2: the ZeRO-1 step")
        # END SOLUTION

    def _padded_gradients(self, flat) -> torch.Tensor:
        """A bucket's gradients in one flat buffer padded to N x S (zeros for parameters unused in this step)."""
        full = torch.zeros(flat["shard_numel"] * self.world_size, dtype=flat["flat"].dtype, device=flat["flat"].device)
        offset = 0
        for p in flat["params"]:
            if p.grad is not None:
                full[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        return full

    def _gradient_ready(self, param):
        """ZeRO-2: autograd has accumulated param's gradient. Reduce-scatter every complete bucket, in list order
        (lesson 02's rule: every rank must issue the same collectives in the same order)."""
        if self._next_bucket == len(self.flats):  # the last backward reduced every bucket: this is a new one
            self._next_bucket = 0
        self._bucket_of[param]["ready"].add(param)
        while self._next_bucket < len(self.flats):
            flat = self.flats[self._next_bucket]
            if len(flat["ready"]) < len(flat["params"]):
                return  # wait for the rest of this bucket's gradients
            self.reduce_scatter_bucket(flat)
            self._next_bucket += 1

    def reduce_scatter_remaining(self):
        """ZeRO-2, at the step: the buckets backward left incomplete (a parameter without a gradient), and those
        a later backward filled again while waiting for them (gradient accumulation)."""
        for i, flat in enumerate(self.flats):
            if i >= self._next_bucket or flat["ready"]:
                self.reduce_scatter_bucket(flat)
        self._next_bucket = len(self.flats)

    def reduce_scatter_bucket(self, flat):
        """ZeRO-2: average a bucket's gradients across ranks, keeping only this rank's shard of them."""
        flat["ready"] = set()
        full = self._padded_gradients(flat)
        # TODO 3: ZeRO-2's gradient reduce-scatter, one bucket at a time during backward. This rank receives only
        #   the average over ranks of its own slice of the bucket's gradients, added to what its shard holds
        #   already (accumulation); the bucket's full gradients are released at once.
        # HINT 1: which collective leaves each rank with the average of its own slice only, moving half the bytes
        #   of an all-reduce? Once this rank has that, who still needs the bucket's full gradients?
        # HINT 2: reduce-scatter the padded bucket into an S-element buffer with the counting `reduce_scatter`;
        #   set the bucket's parameters' gradients to None; take the first hi - lo elements (the last rank's slice
        #   may be shorter) and add them to the shard's .grad (or make them its .grad if it has none).
        # HINT 3: `reduce_scatter(received, full, self.group)` into a new received = torch.empty(S) (not into the
        #   shard itself): each rank receives the average of its own S elements. Then p.grad = None for the bucket's
        #   parameters, and the shard's .grad becomes received[: hi - lo], added to any gradient already there.
        #   Same bytes on the wire as DDP's all-reduce (= reduce-scatter + all-gather, with the all-gather of the
        #   parameters after the step).
        # BEGIN SOLUTION
        reduced = torch.empty(flat["shard_numel"], dtype=full.dtype, device=full.device)
        reduce_scatter(reduced, full, self.group)
        for p in flat["params"]:
            p.grad = None
        mine = reduced[: flat["hi"] - flat["lo"]]
        shard = flat["shard"]
        shard.grad = mine if shard.grad is None else shard.grad + mine
        # EXERCISE
        # raise NotImplementedError("TODO 3: ZeRO-2's gradient reduce-scatter")
        # END SOLUTION

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)  # the model's full gradients
        self.optimizer.zero_grad(set_to_none)  # the shard's

    def state_dict(self):
        return {"rank": self.rank, "world_size": self.world_size, "shard": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict):
        if (state_dict["rank"], state_dict["world_size"]) != (self.rank, self.world_size):
            raise CourseError("a ZeroOptimizer state dict loads only at the same rank and world size")
        self.optimizer.load_state_dict(state_dict["shard"])


# --------------------------------------------------------------------------------------------------
# ZeRO-3: parameters sharded too, gathered block by block just in time
# --------------------------------------------------------------------------------------------------


class _Unit:
    """Parameters gathered and freed together (one block, or the root's leftovers): one flat fp32 buffer,
    padded to N x S elements, of which this rank keeps the S-element `shard` (an nn.Parameter: the master
    weights the optimizer steps). `full` is the gathered buffer in the compute dtype, allocated only while needed.
    """

    def __init__(self, module, params, locations, compute_dtype, group):
        self.module, self.locations, self.group = module, locations, group
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = math.ceil(self.numel / world_size)
        flat = torch.zeros(self.shard_numel * world_size, dtype=params[0].dtype, device=params[0].device)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[: self.numel])
        self.shard = nn.Parameter(flat[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone())
        self.full = torch.empty(flat.numel(), dtype=compute_dtype or flat.dtype, device=flat.device)
        self.gathered, self.awaiting_gradients = True, False
        self.on_change = None  # called with (unit, "gather" or "free"): the lesson's timeline of gathered bytes
        self.free()

    def free(self):
        self.full.untyped_storage().resize_(0)  # the views stay; their memory goes until the next gather
        self.gathered = False
        if self.on_change:
            self.on_change(self, "free")

    def gather(self):
        """All-gather the full parameters into `full` (a no-op if they are there already)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        # TODO 4: all-gather a unit's full parameters, in the compute precision, into the unit's gathered buffer.
        #   Autograd saved views of that buffer for backward: refilling it must not count as an in-place change of
        #   them (_unsafe_preserve_version_counter, as FSDP2 does).
        # HINT 1: what does each rank contribute, in which dtype, and where does the gathered result go? Which
        #   autograd bookkeeping must the refill neither trigger nor record?
        # HINT 2: outside autograd (no_grad), and with the buffer's version counter preserved, all-gather this
        #   rank's shard, detached and cast to the buffer's dtype, into the buffer with the counting `all_gather`.
        # HINT 3: with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
        #   all_gather(self.full, <the shard, detached, .to(self.full.dtype)>, self.group) (a private API: FSDP2
        #   itself refills its gathered parameters under it, in _fsdp_param_group.py).
        # BEGIN SOLUTION
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            all_gather(self.full, self.shard.detach().to(self.full.dtype), self.group)
        # EXERCISE
        # raise NotImplementedError("TODO 4: all-gather a unit's full parameters")
        # END SOLUTION
        self.gathered = True
        if self.on_change:
            self.on_change(self, "gather")

    def attach(self):
        """Point the module's parameter names at views of `full`, through an autograd function whose backward
        turns the views' gradients into this rank's shard gradient."""
        views = _UnitParameters.apply(self, self.shard)
        for view, names in zip(views, self.locations):
            for module, name in names:
                setattr(module, name, view)  # a plain tensor attribute: the registered parameter is gone
        self.awaiting_gradients = torch.is_grad_enabled()

    def views(self):
        offsets = [0]
        for shape in self.shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        return tuple(self.full[a:b].view(shape) for a, b, shape in zip(offsets, offsets[1:], self.shapes))

    def reduce_gradients(self, grads) -> torch.Tensor:
        """The views' gradients (None for unused ones) -> this rank's shard of their average over ranks (fp32)."""
        # TODO 5: reduce-scatter the gradients into the owner's shard. Return this rank's part of the gradients
        #   averaged over ranks, reduced in fp32 and laid out as the unit's buffer (missing gradients count as
        #   zeros); the unit then awaits no more gradients, nor needs its gathered parameters.
        # HINT 1: the shard is a slice of one padded flat buffer: how do the views' gradients line up with it, and
        #   in which dtype should ranks add them? What is left to release once backward is done with the unit?
        # HINT 2: copy each gradient (reshaped flat, cast to the shard's dtype) at its offset in a zero buffer
        #   of N x S elements, in the order of the unit's shapes; reduce-scatter that buffer into a tensor shaped
        #   like the shard; free the unit, mark it as no longer awaiting gradients, return the result.
        # HINT 3: Copy the gradients (cast to the shard's dtype, fp32: reduce in full precision) into one flat
        #   zero buffer of N x S elements, in the order of self.shapes; `reduce_scatter` it into an S-element tensor
        #   (torch.empty_like(self.shard)); self.free(); self.awaiting_gradients = False; return it (autograd
        #   accumulates it into self.shard.grad).
        # BEGIN SOLUTION
        full = torch.zeros(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)
        offset = 0
        for grad, shape in zip(grads, self.shapes):
            if grad is not None:
                full[offset : offset + math.prod(shape)].copy_(grad.reshape(-1))
            offset += math.prod(shape)
        shard_grad = torch.empty_like(self.shard)
        reduce_scatter(shard_grad, full, self.group)
        self.free()
        self.awaiting_gradients = False
        return shard_grad
        # EXERCISE
        # raise NotImplementedError("TODO 5: reduce-scatter the gradients into the owner's shard")
        # END SOLUTION


class _UnitParameters(torch.autograd.Function):
    """shard -> the unit's full parameters as views of the gathered buffer; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, unit, shard):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient arrives as None
        return unit.views()

    @staticmethod
    def backward(ctx, *grads):
        return None, ctx.unit.reduce_gradients(grads)


class Zero3(nn.Module):
    """ZeRO-3 around `module`: one unit per block of `module.blocks` (or of `units`), one for the rest (the root).

    Before a unit's forward its parameters are all-gathered, after it they are freed (reshard_after_forward),
    and gathered again when backward reaches the unit (TODO 6); its gradients are then
    reduce-scattered into each rank's shard. compute_dtype (e.g. torch.bfloat16) is the dtype of the gathered
    parameters and of the compute; shards, gradients and optimizer state stay fp32. Parameters that do not
    require grad stay unsharded; a parameter shared by several units belongs to the root. output_tensors finds
    the tensors in what a unit returns (default: this script's output_tensors, TODO 8).
    """

    def __init__(self, module, compute_dtype=None, units=None, reshard_after_forward=True, group=None,
                 output_tensors=None):  # fmt: skip
        super().__init__()
        self.module, self.reshard_after_forward = module, reshard_after_forward
        self.output_tensors = output_tensors or globals()["output_tensors"]  # defined below, with the lab
        submodules = list(units if units is not None else getattr(module, "blocks", []))
        owners = {}  # parameter -> the units that use it
        for i, submodule in enumerate(submodules):
            for p in submodule.parameters():
                owners.setdefault(p, set()).add(i)
        names = {}  # parameter -> every (module, attribute) that holds it, and its qualified names
        for qualified, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                owner_name, _, attribute = qualified.rpartition(".")
                names.setdefault(p, []).append((module.get_submodule(owner_name), attribute, qualified))
        self.names = []  # for full_state_dict: qualified names per unit, per parameter
        self.units = []
        groups = [(submodules[i], [p for p in names if owners.get(p) == {i}]) for i in range(len(submodules))]
        groups.append((module, [p for p in names if len(owners.get(p, ())) != 1]))
        for submodule, params in groups:
            if not params:
                continue
            locations = [[(m, a) for m, a, _ in names[p]] for p in params]
            self.names.append([[q for _, _, q in names[p]] for p in params])
            self.units.append(_Unit(submodule, params, locations, compute_dtype, group))
            for m, a, _ in (entry for p in params for entry in names[p]):
                # nn.Module keeps parameters in the private dict _parameters: removing them there is how a
                # registered parameter stops being one (FSDP1 did the same); `attach` sets plain tensors instead.
                m._parameters.pop(a, None)  # a module shared by two blocks is listed twice
        self.shards = nn.ParameterList([unit.shard for unit in self.units])
        self.timeline = None  # a list to record [unit, "gather"/"free", bytes gathered after it] into, or None
        for unit in self.units:
            unit.on_change = self._record
        self.root = self.units[-1] if self.units and self.units[-1].module is module else None
        self._callback_queued = False
        self.peak_gathered_in_backward = 0  # bytes of gathered parameters, at most, while backward ran
        for unit in self.units:
            if unit is not self.root:
                unit.module.register_forward_pre_hook(lambda m, args, unit=unit: self._before_forward(unit))
                unit.module.register_forward_hook(lambda m, args, out, unit=unit: self._after_forward(unit, out))

    def _before_forward(self, unit):
        unit.gather()
        unit.attach()

    def _after_forward(self, unit, output):
        # TODO 6: the ZeRO-3 schedule after a unit's forward. Return the output; release the unit's gathered
        #   parameters unless reshards(unit) says to keep them, and make sure backward gathers them again just
        #   before the unit's own backward runs.
        # HINT 1: backward reaches a unit through the gradients of what the unit returned: what can run at that
        #   moment, before the unit's own backward? Which method of this class gathers a unit for backward?
        # HINT 2: free the unit when reshards(unit) is true; for each tensor found in the output (the function
        #   this module was given for that) that requires grad, register a gradient hook that calls
        #   _before_backward with the unit and returns the gradient.
        # HINT 3: if self.reshards(unit), unit.free(); then for each tensor of self.output_tensors(output) that
        #   requires grad, tensor.register_hook(a lambda of grad, with unit bound as a default argument, returning
        #   self._before_backward(unit, grad)). Return the output.
        # BEGIN SOLUTION
        if self.reshards(unit):
            unit.free()
        for tensor in self.output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit, grad))
        return output
        # EXERCISE
        # raise NotImplementedError("TODO 6: the ZeRO-3 schedule after a unit's forward")
        # END SOLUTION

    def _record(self, unit, event):
        if self.timeline is not None:
            name = "root" if unit is self.root else f"unit {self.units.index(unit)}"
            self.timeline.append([name, event, self.gathered_bytes()])

    def reshards(self, unit) -> bool:
        """Free this unit after its forward? Not the root: its forward ends the model's, and backward starts
        with it at once (the head), so freeing it would only gather it again (FSDP2's default for its root too)."""
        return self.reshard_after_forward and unit is not self.root

    def _before_backward(self, unit, grad):
        """Gather the unit's parameters again; at the first unit of a backward, have autograd call
        finish_gradient_synchronization once the whole backward has run."""
        unit.gather()
        self.peak_gathered_in_backward = max(self.peak_gathered_in_backward, self.gathered_bytes())
        if not self._callback_queued:
            self._callback_queued = True
            # The autograd engine's end-of-backward callback: not public API, but what FSDP2 itself uses
            # (_fsdp_state.py) to finish a backward; the deprecated Variable class is the only way to reach it.
            Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        return grad

    def forward(self, *args, **kwargs):
        if self.root is None:
            return self.module(*args, **kwargs)
        self._before_forward(self.root)
        return self._after_forward(self.root, self.module(*args, **kwargs))

    def finish_gradient_synchronization(self):
        """Reduce-scatter (zeros) for units whose parameters were all unused, and free everything. Idempotent:
        runs at the end of every backward, and may be called again."""
        self._callback_queued = False
        for unit in self.units:
            if unit.awaiting_gradients:  # its backward never ran: every rank must still join the reduce-scatter
                grad = unit.reduce_gradients([None] * len(unit.shapes))
                unit.shard.grad = grad if unit.shard.grad is None else unit.shard.grad + grad
            if unit.gathered:
                unit.free()

    def holds(self, tensor) -> bool:
        """Is `tensor` a view of gathered parameters (model state, not an activation)?"""
        pointer = tensor.untyped_storage().data_ptr()
        return any(u.gathered and u.full.untyped_storage().data_ptr() == pointer for u in self.units)

    def gathered_bytes(self) -> int:
        return sum(u.full.untyped_storage().nbytes() for u in self.units)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The full fp32 parameters under the original module's names (a collective), plus unsharded state."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}  # frozen params, buffers
        for unit, unit_names in zip(self.units, self.names):
            full = torch.empty(unit.shard_numel * dist.get_world_size(unit.group), dtype=unit.shard.dtype,
                               device=unit.shard.device)  # fmt: skip
            dist.all_gather_single(full, unit.shard.detach(), group=unit.group)
            offset = 0
            for shape, qualified in zip(unit.shapes, unit_names):
                for name in qualified:
                    state[name] = full[offset : offset + math.prod(shape)].view(shape).clone()
                offset += math.prod(shape)
        return state


# --------------------------------------------------------------------------------------------------
# The built-in: FSDP2 on a 1-D mesh, HSDP on a 2-D mesh (replicate x shard)
# --------------------------------------------------------------------------------------------------


def apply_fsdp(model, mesh, reshard_after_forward=True, mp_policy=None):
    """FSDP2: each block its own unit (gathered and freed on its own), then the root for what is left."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    # TODO 7: shard the model with FSDP2 (fully_shard): each block its own unit with the options given, then the
    #   root for what is left, which backward needs at once after forward. On a 2-D mesh the same calls give HSDP.
    # HINT 1: fully_shard groups the parameters of the module it is called on, minus those of modules already
    #   sharded: in which order must the calls come? Which unit gains nothing from being freed after forward?
    # HINT 2: call fully_shard on every block with the mesh, reshard_after_forward and the mixed-precision
    #   policy; then on the model itself with the mesh and the policy, leaving its reshard_after_forward alone.
    # HINT 3: Call fully_shard(block, mesh=..., reshard_after_forward=..., mp_policy=...) on every block of
    #   model.blocks, then once on the model itself (the root: embeddings, final norm, head), leaving its
    #   reshard_after_forward at the default (the root is not resharded after forward: backward needs it at once).
    # BEGIN SOLUTION
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root keeps its default: see Zero3.reshards
    # EXERCISE
    # raise NotImplementedError("TODO 7: shard the model with FSDP2")
    # END SOLUTION
    return model


def apply_hsdp(model, mesh, reshard_after_forward=True, mp_policy=None):
    """HSDP: mesh is 2-D, ("replicate", "shard"): shard within a row (a node), all-reduce across rows (nodes)."""
    assert mesh.ndim == 2, "HSDP needs a 2-D mesh (replicate, shard)"
    return apply_fsdp(model, mesh, reshard_after_forward, mp_policy)


def hsdp_mesh(device, world_size, replicas):
    """A replicas x (world_size / replicas) mesh: row r holds the consecutive ranks of one node."""
    if world_size % replicas:
        raise Refusal(f"--replicas {replicas} does not divide the world size {world_size}: choose a divisor")
    return init_device_mesh(device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def optimizer_class(args):
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    if args.optimizer == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": args.momentum}
    return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.0}


def wrap(strategy, model, args, device, world_size):
    """(model, optimizer, shard_ranks, padded_params, mesh) for a strategy: the ranks state is sharded over, the
    elements of the sharded buffers after padding (what utils.memory needs to predict each rank's bytes), and
    FSDP2's device mesh (None for the others)."""
    cls, kwargs = optimizer_class(args)
    bf16 = args.precision == "bf16"
    n_params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        model.register_comm_hook(WIRE, counting_allreduce_hook)  # DDP's all-reduces, counted too
        return model, cls(model.parameters(), **kwargs), 1, n_params, None
    if strategy in ("zero1", "zero2"):
        optimizer = ZeroOptimizer(
            model.parameters(), cls, shard_gradients=strategy == "zero2", bucket_cap_mb=args.bucket_cap_mb, **kwargs
        )
        padded = sum(f["shard_numel"] * world_size for f in optimizer.flats)  # each bucket padded on its own
        return model, optimizer, world_size, padded, None
    if strategy == "zero3":
        model = Zero3(model, compute_dtype=torch.bfloat16 if bf16 else None, reshard_after_forward=args.reshard)
        padded = sum(u.shard_numel * world_size for u in model.units)
        return model, cls(model.parameters(), **kwargs), world_size, padded, None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if strategy == "fsdp":
        mesh, shard_ranks = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",)), world_size
        model = apply_fsdp(model, mesh, args.reshard, policy)
    else:
        mesh = hsdp_mesh(device, world_size, args.replicas)
        shard_ranks = mesh.size(1)
        print0(f"HSDP mesh (replicate x shard): {mesh.mesh.tolist()}")
        model = apply_hsdp(model, mesh, args.reshard, policy)
    padded = sum(math.ceil(p.shape[0] / shard_ranks) * shard_ranks * math.prod(p.shape[1:]) for p in model.parameters())
    return model, cls(model.parameters(), **kwargs), shard_ranks, padded, mesh


def train(args, strategy, device, rank, world_size, record: dict):
    """Train one strategy for --steps steps; fill `record` with its metrics as they become known (so that a run
    stopped at an unfinished TODO still reports what it built)."""
    config = model_config(args)
    train_set = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train_set), args, world_size)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = build_model(config, seed=args.seed).to(device)
    probe = FirstStep(model, WIRE)  # before wrapping: it sees each gradient before ZeRO-2 frees it
    model, optimizer, shard_ranks, padded, mesh = wrap(strategy, model, args, device, world_size)
    if device.type == "cuda":  # after wrapping: the peak of training, not of the unsharded model built first
        torch.cuda.reset_peak_memory_stats(device)
    record.update(strategy=strategy, precision=args.precision, shard_ranks=shard_ranks, padded_params=padded)
    zero_optimizer = optimizer if strategy in ("zero1", "zero2") else None  # the lesson's own pieces, measured
    probe.wrapped(model, optimizer, mesh, record, zero_optimizer, zero3=model if strategy == "zero3" else None)
    start = 0
    if args.resume:
        start = resume(args.resume, model, optimizer, config)
        record.update({f"loaded_{name}": value for name, value in probe.checksums().items()})
        print0(f"resumed from {args.resume} after step {start}")

    data = batches(loader, sampler)
    for _ in range(start):  # the batches the checkpointed run already trained on
        next(data)
    autocast = args.precision == "bf16" and strategy in ("ddp", "zero1", "zero2")
    throughput, losses = Throughput(device), []
    logger = Logger(argparse.Namespace(**{**vars(args), "log_dir": args.log_dir / strategy}), args.steps - start)
    for step in range(start + 1, args.steps + 1):
        inputs, targets = (t.to(device) for t in next(data))
        optimizer.zero_grad(set_to_none=True)
        with probe.measuring(step == start + 1), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(inputs), targets)
            probe.after_forward(loss)
            loss.backward()
            probe.after_backward()
        optimizer.step()
        probe.after_step()
        losses.append(average(loss))
        record.update(losses=losses, steps=len(losses), first_step=start + 1)
        throughput.step(inputs.numel() * world_size)
        logger.log(step, loss=losses[-1])
        if step % args.log_every == 0 or step == args.steps:
            print0(f"{strategy:>5} step {step:4d}  loss {losses[-1]:.4f}")

    logger.close()
    optimizer_name = "adam" if args.optimizer == "adamw" else "momentum" if args.momentum else "sgd"
    estimate = dict(n_params=count_parameters(config), dp=shard_ranks, stage=STAGE[strategy], precision="fp32",
                    optimizer=optimizer_name, padded_params=padded)  # fmt: skip
    record.update(final_loss=losses[-1] if losses else None, tokens_per_s=throughput.tokens_per_s,
                  n_params=estimate["n_params"], stage=STAGE[strategy],
                  replicas=world_size // shard_ranks if strategy == "hsdp" else None)  # fmt: skip
    counted = strategy in ("ddp", "zero1", "zero2", "zero3")  # the lesson's own counters; FSDP2's: library_wire
    probe.finish(estimate, counted, device)
    save_checkpoints(args, model, optimizer, strategy, start + len(losses), config)
    del model, optimizer  # DDP and FSDP hold the process group: free them before it goes
    return record


def main():
    # FSDP2 warns that the root returns a view (the head's output): the loss only reads it, never changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    args = parse_args(lesson_parser(__doc__.splitlines()[0], STRATEGIES))
    local_rank, rank, device, world_size = setup(args.seed)
    settle(args, world_size, device)
    strategies = STRATEGIES if args.strategy == "all" else [args.strategy]
    print0(
        f"{world_size} ranks x {args.batch_size} sequences | {count_parameters(model_config(args)):,} parameters"
        f" | {args.optimizer} | {args.precision} | device {device.type}"
    )
    results, stopped = {}, None
    for strategy in strategies:
        results[strategy] = {}
        try:
            train(args, strategy, device, rank, world_size, results[strategy])
        except NotImplementedError as error:  # an unfinished TODO: the other strategies may not need it
            if args.strategy != "all" or not str(error).startswith("TODO"):
                raise
            results[strategy]["stopped"] = str(error)
            stopped = stopped or error
            print0(f"{strategy:>5} stopped: {error} is not done yet")
    report(results)
    last = results[strategies[-1]]
    write_metrics(args.metrics_out, **last, strategies=results if args.strategy == "all" else None)
    if not stopped:
        print0(f"FINISHED {args.strategy}: {last['steps']} steps, final loss {last['final_loss']:.4f}")
    destroy_process_group()
    if stopped:  # every finished strategy is reported above; now name the first unfinished TODO
        raise stopped


# --------------------------------------------------------------------------------------------------
# Debugging lab: a ZeRO-3 unit never gathered again (TODO 8; notebook section 12, `make check LESSON=03`)
# --------------------------------------------------------------------------------------------------


def output_tensors(output) -> list:
    """The tensors in what a unit's forward returned: Zero3 hooks each one to gather the unit again before its
    backward (TODO 6). A block may return a tensor, or tuples, lists and dicts of them, nested."""
    # TODO 8: lab, a unit never gathered again. In the exercise, ZeRO-3 trains the course model, whose blocks
    #   return a tensor; the lab's model, whose blocks return a dict (a hidden state and an auxiliary loss),
    #   fails in backward on every rank. Which unit's parameters does backward read, what state are they in,
    #   and why did no hook gather them again? Fix this function.
    # HINT 1: run the lab (notebook section 12) and read which units were gathered again after being freed.
    #   What does this function return for a dict?
    # HINT 2: a dict's tensors are its values, and a value may itself be a tuple, a list or a dict: every
    #   tensor at any depth needs its hook, or backward reaches that unit with its parameters freed.
    # HINT 3: turn a dict into the list of its values before the tuple/list case, which recurses into each
    #   item; everything else is a tensor (a list of it) or nothing.
    # BEGIN SOLUTION
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in output_tensors(item)]
    return [output] if torch.is_tensor(output) else []
    # EXERCISE
    # if isinstance(output, (tuple, list)):
    #     return [tensor for item in output for tensor in output_tensors(item)]
    # return [output] if torch.is_tensor(output) else []
    # END SOLUTION


if __name__ == "__main__":
    run_main(main)
