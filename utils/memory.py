"""Model-state memory per data-parallel rank: parameters, gradients and optimizer state under ZeRO stages 0-3.

    from utils.memory import model_state_bytes
    model_state_bytes(7.5e9, dp=64, stage=2, precision="mixed", optimizer="adam")
    # {'params': ..., 'grads': ..., 'optimizer': ...}   bytes held by each rank

    python -m utils.memory --params 7.5e9 --dp 64 --stage 2 --precision mixed --optimizer adam
    python -m utils.memory --params 7.5e9 --dp 64                 # every stage, as the ZeRO paper's table

The command line defaults to the paper's mixed precision, the function to fp32: lesson 03's runs (fp32, and bf16
compute with fp32 master state) hold what precision="fp32" predicts. The planner (utils/planner/) defaults to "bf16",
what bf16 training keeps today.

The rule (Rajbhandari et al., "ZeRO", 2020): with Psi parameters and dp data-parallel ranks,
- stage 0 (DDP) replicates everything:           params Psi, grads Psi, optimizer state Psi  (x bytes each)
- stage 1 shards the optimizer state:            optimizer state Psi / dp
- stage 2 also shards the gradients:             grads Psi / dp
- stage 3 also shards the parameters (FSDP):     params Psi / dp
Bytes per element: fp32 training keeps 4 (params) + 4 (grads) + K (optimizer: 8 for Adam's two moments,
0 for plain SGD). Mixed precision as in the paper ("mixed", fp16) keeps 2 + 2 + K with K = 12 for Adam (an fp32
master copy of the parameters plus the two fp32 moments): 16 bytes a parameter. bf16 training ("bf16") keeps its
gradients in fp32, 2 + 4 + 12 = 18 bytes: bf16's 8-bit mantissa loses small gradients summed over micro-batches, so
Megatron-LM accumulates and reduces them in fp32 whenever it trains in bf16 (its main_grad buffers), and torchtitan's
FSDP2 reduces them in fp32 (reduce_dtype); with a distributed optimizer (ZeRO-1) that is 6 + 12/dp. Training with
bf16 compute but fp32 sharded weights (FSDP2's MixedPrecisionPolicy(param_dtype=bf16), the lesson's
Zero3(compute_dtype=bf16)) holds fp32 state: use precision="fp32" for it.

Padding: a sharded tensor of n elements split over dp ranks is padded to a multiple of dp, so each rank
holds ceil(n / dp) elements. `padded_params` is the total after padding (every sharded buffer rounded up);
each rank's shard is padded_params / dp. `padded_numel(sizes, dp)` computes it for a list of buffers.

Activations beside the model state: `with ActivationFootprint() as saved: ...` then `saved.bytes`, every byte the
tensors saved for backward reach (lesson 06's micro-batch, utils/measure_at_scale.py's block at real size).
"""

import argparse
import math

import torch
from torch import nn

from utils.distributed_utils import is_dtensor

PRECISIONS = {"fp32": (4, 4), "mixed": (2, 2), "bf16": (2, 4)}  # bytes per element of (parameters, gradients)
OPTIMIZER_STATE = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8}  # fp32 bytes of state per parameter
MASTER_COPY = {"fp32": 0, "mixed": 4, "bf16": 4}  # 16-bit parameters need an fp32 copy in the optimizer
STAGES = {0: "DDP (replicated)", 1: "ZeRO-1 (optimizer)", 2: "ZeRO-2 (+ gradients)", 3: "ZeRO-3 (+ parameters)"}


def bytes_per_param(precision: str = "fp32", optimizer: str = "adam") -> dict:
    """Bytes per parameter of (params, grads, optimizer) before any sharding: 4+4+8 fp32 Adam, 2+2+12 mixed (the
    ZeRO paper's fp16), 2+4+12 bf16 (fp32 gradients)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, not {optimizer!r}")
    params, grads = PRECISIONS[precision]
    return {"params": params, "grads": grads, "optimizer": OPTIMIZER_STATE[optimizer] + MASTER_COPY[precision]}


def padded_numel(sizes, dp: int) -> int:
    """Total elements once each flat buffer of `sizes` elements is padded to a multiple of dp."""
    return sum(math.ceil(int(n) / dp) * dp for n in sizes)


def model_state_bytes(
    n_params: float,
    dp: int = 1,
    stage: int = 0,
    precision: str = "fp32",
    optimizer: str = "adam",
    padded_params: int | None = None,
) -> dict:
    """Bytes of parameters, gradients and optimizer state that one rank holds (the largest shard).

    n_params: parameters in the model (Psi). dp: ranks the state is sharded over. stage: 0 (DDP) to 3.
    padded_params: elements after padding the sharded buffers (default: n_params rounded up to a multiple of dp).
    Replicated state counts n_params elements; sharded state counts padded_params / dp.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, not {dp}")
    n_params = int(n_params)
    padded = padded_numel([n_params], dp) if padded_params is None else int(padded_params)
    if padded % dp or padded < n_params:
        raise ValueError(f"padded_params={padded} must be a multiple of dp={dp} and at least n_params={n_params}")
    shard = padded // dp
    per = bytes_per_param(precision, optimizer)
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return {kind: per[kind] * (shard if sharded[kind] else n_params) for kind in ("params", "grads", "optimizer")}


def peak_model_state_bytes(
    n_params: float,
    dp: int = 1,
    stage: int = 0,
    precision: str = "fp32",
    optimizer: str = "adam",
    padded_params: int | None = None,
    bucket_params: int = 0,
    gathered_params: int = 0,
    gathered_bytes: int | None = None,
) -> dict:
    """Model state at its largest during backward: what model_state_bytes says a rank holds, plus what exists
    only while backward runs.

    - stages 0 and 1: every full gradient exists before it is reduced: the same as held (grads: Psi).
    - stage 2, reduce-scattered bucket by bucket during backward: the gradient shard plus one bucket of full
      gradients (bucket_params elements) waiting for its reduce-scatter. Reduced only after backward (one
      bucket of Psi), stage 2 would peak where stage 1 does.
    - stage 3: the parameter shard plus the gathered parameters (gathered_params elements, gathered_bytes each:
      2 when they are gathered in bf16; default, the parameters' own bytes). The lesson's ZeRO-3 holds the root
      and one block at once during backward.
    """
    held = model_state_bytes(n_params, dp, stage, precision, optimizer, padded_params)
    per = bytes_per_param(precision, optimizer)
    if stage == 2:
        held["grads"] += per["grads"] * int(bucket_params)
    if stage == 3:
        held["params"] += (per["params"] if gathered_bytes is None else gathered_bytes) * int(gathered_params)
    return held


def human(nbytes: float) -> str:
    """Bytes in decimal units, as the ZeRO paper counts them (1 GB = 1e9 bytes)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def table(n_params: float, dp: int, precision: str, optimizer: str, stages=(0, 1, 2, 3)) -> str:
    """One line per stage: the bytes of each kind of state per rank, and their total."""
    lines = [f"{'stage':<24}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}"]
    for stage in stages:
        state = model_state_bytes(n_params, dp, stage, precision, optimizer)
        cells = "".join(f"{human(state[k]):>{w}}" for k, w in (("params", 10), ("grads", 10), ("optimizer", 11)))
        lines.append(f"{stage} {STAGES[stage]:<22}{cells}{human(sum(state.values())):>10}")
    return "\n".join(lines)


class ActivationFootprint:
    """The memory the tensors autograd keeps for backward reach while the block runs (saved_tensors_hooks): every
    byte saved in the block, each once, whether or not it is freed before the block ends (what one micro-batch's
    forward adds; utils.metrics.SavedActivations measures the peak held at once instead).

        with ActivationFootprint() as saved:
            loss = model(tokens)...
        saved.bytes      # the memory the saved tensors reach, each byte once

    What counts: every tensor an operation saves for its backward (its own, or a view of another), except the
    parameters and views of them (model state, counted by model_state_bytes). A saved tensor reaches a byte range
    of its storage (offset to its last element); ranges of one storage are merged, so views that share memory
    (the heads are views of a projection's output; a micro-batch is a slice of the batch) count once, and a slice
    counts only the bytes it reaches, not its whole batch. A DTensor counts its local shard. The storages are
    kept alive until the block ends, so that no freed address is reused and counted twice."""

    def __init__(self):
        self.ranges: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges saved in it
        self.storages = []  # keeps every storage seen alive until the block ends

    def _pack(self, tensor):
        local = tensor._local_tensor if is_dtensor(tensor) else tensor
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


def main(argv=None):
    parser = argparse.ArgumentParser(description="Model-state memory per rank under ZeRO stages 0-3.")
    parser.add_argument("--params", type=float, required=True, help="parameters in the model, e.g. 7.5e9")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks the state is sharded over")
    parser.add_argument("--stage", type=int, choices=sorted(STAGES), default=None, help="one stage (default: all)")
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="mixed",
        help="mixed (default, the ZeRO paper's): fp16 parameters and gradients + an fp32 master copy; bf16: bf16 "
        "parameters, fp32 gradients (as bf16 training accumulates and reduces them) + an fp32 master copy; fp32: "
        "fp32 training, and also autocast or FSDP2's bf16 policy, which keep fp32 parameters and gradients "
        "(model_state_bytes() defaults to fp32)",
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE), default="adam")
    args = parser.parse_args(argv)
    if args.dp < 1 or args.params < 1:
        parser.error("--params and --dp must be at least 1")
    per = bytes_per_param(args.precision, args.optimizer)
    print(
        f"{args.params:.3g} parameters, {args.dp} data-parallel ranks, {args.precision} precision, {args.optimizer}: "
        f"{per['params']} + {per['grads']} + {per['optimizer']} bytes per parameter"
    )
    stages = sorted(STAGES) if args.stage is None else [args.stage]
    print(table(args.params, args.dp, args.precision, args.optimizer, stages))


if __name__ == "__main__":
    main()
