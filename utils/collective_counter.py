"""Count the collectives a piece of code runs on this rank, and the bytes of the tensors they work on: the course's
bytes-on-the-wire counters in one place, two ways.

CollectiveCounter sees every collective that passes through the dispatcher, grouped by phase (lessons 04, 06, 09, 10):

    counter = CollectiveCounter()
    counter.self_check(device)            # once: refuse to count on a release where collectives go unseen
    with counter.phase("forward"):
        loss = loss_fn(model(x), y)
    counter.table()                      # {"forward": {"all_reduce": [calls, bytes], ...}}
    CollectiveCounter(device=device)     # also: refuse a collective whose tensors are not on `device`'s kind

What is counted: every call of c10d's ops (what `dist.all_reduce` & co. run, their `*_coalesced` forms, all-to-all,
broadcast) and of the functional collectives DTensor and FSDP2 issue (`_c10d_functional`), grouped into five kinds:
all_reduce, all_gather, reduce_scatter, all_to_all, broadcast. Point-to-point send/recv and barriers are not
counted. The bytes are those of the WHOLE tensor a collective works on (an all-reduce's tensor, an all-gather's
output, a reduce-scatter's or an all-to-all's input): on a ring each rank sends (N-1)/N of it, twice for an
all-reduce.

CountCollectives counts, per process group, the bytes a library's own collectives move (lesson 03: FSDP2 and HSDP):

    with CountCollectives({"shard": mesh.get_group("shard"), "replicate": mesh.get_group("replicate")}) as wire:
        loss_fn(model(x), y).backward()
    wire.bytes   # {"shard": {"all_gather": ..., "reduce_scatter": ...}, "replicate": {"all_reduce": ...}}

FSDP2 calls `torch.distributed`'s functions by name at the moment it communicates (`dist.all_gather_single`,
`dist.reduce_scatter_single`, `dist.all_reduce`; older releases `all_gather_into_tensor` and
`reduce_scatter_tensor`), so wrapping those names while a step runs sees every byte it sends, with the group it
went to. Bytes are those of the full tensor (the gathered output, the reduce-scatter input), as above. A group
that is not named is counted under "other".

How CollectiveCounter counts, and what it relies on (internal, may change between releases; `self_check`
notices when it does):
- `torch.utils._python_dispatch.TorchDispatchMode`, a private module: the mode sees every aten op, so it is
  slow (a Python call per op). Count one step, time the others.
- the op names of the `c10d` and `_c10d_functional` namespaces (`torch.ops.c10d.allreduce_`,
  `torch.ops._c10d_functional.all_gather_into_tensor`, ... listed in KINDS below) and their argument order.
- `torch._ops.HigherOrderOperator`, which passes through, and DTensor: for a DTensor op the mode returns
  NotImplemented, so that DTensor first turns it into plain-tensor ops and collectives, which then come through
  here. Other tensor subclasses (FakeTensor while DTensor propagates shapes) pass through as plain ops. A
  collective issued without going through the dispatcher is not seen.
"""

import inspect
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from utils.distributed_utils import CourseError, loaded_dtensor_class

# op name -> (kind, where the whole tensor is: "first" = the first argument (an all-reduce's tensors, a c10d
# all-gather's output, a functional reduce-scatter's input), "second" = the second argument (a c10d
# reduce-scatter's or all-to-all's input), "first x n" = the first argument times the group size (a functional
# all-gather gets only its input)).
KINDS = {
    "c10d": {
        "allreduce_": ("all_reduce", "first"),
        "allreduce_coalesced_": ("all_reduce", "first"),
        "allgather_": ("all_gather", "first"),
        "_allgather_base_": ("all_gather", "first"),
        "allgather_coalesced_": ("all_gather", "first"),
        "allgather_into_tensor_coalesced_": ("all_gather", "first"),
        "reduce_scatter_": ("reduce_scatter", "second"),
        "_reduce_scatter_base_": ("reduce_scatter", "second"),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
        "alltoall_": ("all_to_all", "second"),
        "alltoall_base_": ("all_to_all", "second"),
        "broadcast_": ("broadcast", "first"),
    },
    "_c10d_functional": {
        "all_reduce": ("all_reduce", "first"),
        "all_reduce_": ("all_reduce", "first"),
        "all_reduce_coalesced": ("all_reduce", "first"),
        "all_reduce_coalesced_": ("all_reduce", "first"),
        "all_gather_into_tensor": ("all_gather", "first x n"),
        "all_gather_into_tensor_out": ("all_gather", "first x n"),
        "all_gather_into_tensor_coalesced": ("all_gather", "first x n"),
        "reduce_scatter_tensor": ("reduce_scatter", "first"),
        "reduce_scatter_tensor_out": ("reduce_scatter", "first"),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", "first"),
        "all_to_all_single": ("all_to_all", "first"),
        "broadcast": ("broadcast", "first"),
        "broadcast_": ("broadcast", "first"),
    },
}


def _nbytes(value) -> int:
    """Bytes of a tensor, or of every tensor in (nested) lists of them."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _whole_bytes(where: str, args) -> int:
    if where == "first":
        return _nbytes(args[0])
    if where == "second":
        return _nbytes(args[1])
    return _nbytes(args[0]) * args[1]  # "first x n": (input(s), group_size, group_name)


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by phase: `with counter.phase(name):` (or `with counter:` for the phase "all")."""

    def __init__(self, device: torch.device | None = None):
        """device: also check that every counted collective's tensors are on this kind of device (NCCL rejects
        CPU tensors, gloo GPU ones); this sees the functional collectives that the dist.* wrappers of
        COURSE_CHECK_DEVICE=1 do not (DTensor's, FSDP2's)."""
        super().__init__()
        self.calls, self.bytes = Counter(), Counter()  # (phase, kind) -> count / bytes
        self.current, self.device = "all", device

    @contextmanager
    def phase(self, name: str):
        self.current = name
        try:
            with self:
                yield self
        finally:
            self.current = "all"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        dtensor = loaded_dtensor_class()
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            return NotImplemented  # let DTensor turn its op into plain-tensor ops and collectives first
        kind = KINDS.get(func.namespace, {}).get(func._overloadpacket.__name__)
        if kind is not None:
            if self.device is not None:
                self._check_device(func, args)
            self.calls[self.current, kind[0]] += 1
            self.bytes[self.current, kind[0]] += _whole_bytes(kind[1], args)
        return func(*args, **kwargs)

    def _check_device(self, func, args):
        for value in args:
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                for t in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
                    if isinstance(t, torch.Tensor) and t.device.type != self.device.type:
                        raise CourseError(
                            f"{func} got a tensor on {t.device}, but this rank's collectives run on {self.device}: "
                            "create it on `device` (from setup()) or move the model there"
                        )

    def table(self) -> dict[str, dict[str, list[int]]]:
        """{phase: {kind: [calls, bytes]}}: phases in the order they ran, kinds sorted by name."""
        result = {}
        for phase, kind in self.calls:  # phases in the order they ran
            result.setdefault(phase, {})[kind] = [self.calls[phase, kind], self.bytes[phase, kind]]
        return {phase: dict(sorted(kinds.items())) for phase, kinds in result.items()}

    def self_check(self, device: torch.device, group=None):
        """Raise a CourseError unless a plain dist.all_reduce run under the counter is counted (it would be missed
        silently on a release whose collectives stop passing through the dispatcher or change their names)."""
        probe = CollectiveCounter()
        with probe:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        if probe.calls != Counter({("all", "all_reduce"): 1}):
            raise CourseError(
                f"utils/collective_counter.py counted {dict(probe.calls) or 'nothing'} for one dist.all_reduce with "
                f"torch {torch.__version__}: its op names (KINDS) no longer match this release; update them"
            )


# name in torch.distributed -> (kind, the argument that is the full tensor): what CountCollectives wraps
COUNTED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


class CountCollectives:
    """Bytes per process group and kind, of the collectives called by their torch.distributed names in the block."""

    def __init__(self, groups: dict):
        self.groups = groups  # label -> ProcessGroup
        self.bytes: dict[str, dict[str, int]] = {}
        self._saved = {}

    def _label(self, group) -> str:
        for label, known in self.groups.items():
            if known is group:
                return label
        return "other"

    def _wrap(self, name, function):
        kind, full = COUNTED[name]
        signature = inspect.signature(function)

        def counted(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments  # by position or by name, as the caller chose
            tensor = given[full]
            per_group = self.bytes.setdefault(self._label(given.get("group")), {})
            per_group[kind] = per_group.get(kind, 0) + tensor.numel() * tensor.element_size()
            return function(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in COUNTED:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, function in self._saved.items():
            setattr(dist, name, function)
        self._saved = {}
