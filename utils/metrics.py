"""The metrics file every lesson script writes with --metrics-out, so runs can be compared.

Tests, notebooks and learners compare a 1-process run with an N-process run, or a hand-written
parallelism with PyTorch's built-in, through these numbers. The parameter checksum is computed on
the full parameters, so it is the same however the model is sharded across ranks.
"""

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from utils import monitor
from utils.distributed_utils import is_dtensor, is_root_process
from utils.gather import checksum, whole


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def param_checksum(model: torch.nn.Module) -> float:
    """Sum of squares of all full parameters, in float64: equal for equal models, however sharded (DTensors)."""
    return checksum(whole(p) for p in model.parameters())


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds for parameters, gradients and optimizer state."""

    def nbytes(tensors):
        return sum(_local(t).numel() * t.element_size() for t in tensors if t is not None)

    optimizer_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            optimizer_tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "params": nbytes(p for p in model.parameters()),
        "grads": nbytes(p.grad for p in model.parameters()),
        "optimizer": nbytes(optimizer_tensors),
    }


def host_name() -> str:
    """The Slurm node name where there is one (several nodes may share a host), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def write_metrics(path, **fields):
    """Write `fields` plus world size and each rank's host as JSON. Call on every rank.

    With --watch, every rank's samples so far go in too, under "monitor" (a list: one record per rank)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    hosts = [host_name()] * world_size
    if world_size > 1:
        dist.all_gather_object(hosts, host_name())  # a collective: every rank must call write_metrics
    sampler = monitor.running()
    if sampler is not None:
        records = [sampler.record()] * world_size
        if world_size > 1:  # only where every rank watches: --watch is on the command line all ranks share
            dist.all_gather_object(records, sampler.record())
        fields["monitor"] = records
    if path and is_root_process():
        record = {"world_size": world_size, "hosts": hosts, **fields}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_metrics(path) -> dict:
    return json.loads(Path(path).read_text())


class SavedActivations:
    """Bytes autograd keeps for backward (activations), measured while a forward and backward run inside:

        with SavedActivations(exclude=model.parameters()) as saved:
            loss_fn(model(x), y).backward()
        saved.peak_bytes   # the most bytes held at once between the forward and the backward

    Every tensor an operation saves for its backward passes through `saved_tensors_hooks`; we count each
    storage once while any saved reference to it lives, so a tensor saved by two operations counts once.
    Parameters (which layers also save) are excluded: they are model state, not activations.
    """

    def __init__(self, exclude=()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.held: dict[int, list] = {}  # storage -> [bytes, number of saved references alive]
        self.current_bytes = self.peak_bytes = 0

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, tensor):
        key = _storage_key(tensor)
        if key in self.excluded:
            return tensor
        entry = self.held.setdefault(key, [_local(tensor).untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        return _SavedReference(tensor, key, self)

    def _unpack(self, packed):
        return packed.tensor if isinstance(packed, _SavedReference) else packed

    def _release(self, key):
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self.held[key]


class _SavedReference:
    """What autograd stores instead of a saved tensor; freeing it (after backward) releases the bytes."""

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner._release(self.key)


def _storage_key(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()
