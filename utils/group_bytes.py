"""Bytes that a library's own collectives move, counted per process group (lesson 03: FSDP2 and HSDP).

    with CountCollectives({"shard": mesh.get_group("shard"), "replicate": mesh.get_group("replicate")}) as wire:
        loss_fn(model(x), y).backward()
    wire.bytes   # {"shard": {"all_gather": ..., "reduce_scatter": ...}, "replicate": {"all_reduce": ...}}

FSDP2 calls `torch.distributed`'s functions by name at the moment it communicates (`dist.all_gather_single`,
`dist.reduce_scatter_single`, `dist.all_reduce`; older releases `all_gather_into_tensor` and
`reduce_scatter_tensor`), so wrapping those names while a step runs sees every byte it sends. Bytes are those
of the full tensor of each collective (the gathered output, the reduce-scatter input), as the lesson's own
counters count them. A group that is not named is counted under "other".
"""

import inspect

import torch.distributed as dist

# name in torch.distributed -> (kind, the argument that is the full tensor)
COUNTED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


class CountCollectives:
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
