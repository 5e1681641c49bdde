"""The planner's memory against what PyTorch allocates for a 70B-like course model, measured on a laptop.

    python -m utils.measure_at_scale                                   # 80 blocks, width 8192, 64 GPUs: dp 8 x tp 8
    python -m utils.measure_at_scale --dp 4 --tp 8 --pp 2 --optimizer adamw
    python -m utils.measure_at_scale --vocab 50257 --dp 64 --tp 1      # a vocabulary FSDP2 must pad

    from utils.measure_at_scale import SEVENTY_B, measure_model_state, measure_block_activations, table
    print(table(measure_model_state(SEVENTY_B, dp=8, tp=8, pp=1)))

Nothing is allocated, yet every byte is PyTorch's own. torch's fake process group puts one rank of a 64-GPU job in
this process (its collectives return at once); the model is built on the meta device (shapes, no memory) and given
the course's own built-in layout: lesson 06's parallelize_builtin, that is lesson 04's DTensor tensor parallelism on
the tp sub-mesh, lesson 05's pipeline stage, FSDP2 on the dp sub-mesh. Then, one rank at a time:

- parameters: the bytes of the storages behind the rank's local shards. FSDP2 keeps each tensor's shard in a buffer
  of ceil(rows / dp) rows on every rank (the padded shard; the parameter is a view of its first rows), so the
  padding is in the storage.
- gradients: FSDP2 reduce-scatters a group's gradients into one buffer of those padded shards and hands out views of
  it (foreach_reduce in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the gradients hold the padded
  bytes of the parameters. Optimizer state: torch creates it at the first step, like the parameter's local shard
  (AdamW's two moments are zeros_like(parameter), SGD's momentum a clone of the gradient view): unpadded. Its step
  counters are 0-d tensors on the host, not counted (as utils/metrics.py's state_bytes leaves them out).
  run_step=True measures both instead of deriving them: a forward, backward and optimizer step of the rank's stage
  under FakeTensorMode (a few seconds per rank), then the storages behind p.grad and the optimizer's state.
- activations: one block at real width and sequence length runs under FakeTensorMode, and utils.memory's
  ActivationFootprint counts what autograd saves for backward (saved-tensor hooks, each byte of storage once).
  Full recomputation is torch.utils.checkpoint around the block (non-reentrant): it saves only the block's input,
  through the same hooks. Selective recomputation is checkpoint with create_selective_checkpoint_contexts and a
  policy that keeps every matmul's output (and the attention kernel's) and recomputes the rest (the norms, the
  GELU, the residual adds, the collectives); what the policy keeps sits in the checkpoint's cache, not behind the
  hooks, so the cache is read after the forward and its tensors are counted with the same rule.

Each number is set beside utils.planner's: rank_model_state (precision fp32, ZeRO-3: FSDP2's state between steps),
and activation_bytes_per_layer + the per-layer part of omitted_activation_bytes (fused attention, no dropout). The
command prints both, every difference and the saved tensors behind it, and exits with 1 when anything differs.
The kernels are the CPU's, so bf16 differs from a GPU in one known place: the CPU's LayerNorm keeps its mean and 1/std
in bf16, CUDA's in fp32 (the planner's 4 bytes; in fp32 the two agree).
"""

import argparse
import contextlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from utils import planner
from utils.course.lessons import lesson
from utils.lesson_06.placements import output_not_a_view
from utils.memory import ActivationFootprint, human
from utils.model import ModelConfig, TransformerLM

OPTIMIZERS = ("sgd", "momentum", "adamw")  # the planner's names (utils/memory.py's OPTIMIZER_STATE)
RECOMPUTE = ("none", "selective", "full")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape:
    """The course's model (utils/model.py) at a real size: its sizes, as ModelConfig and as the planner name them."""

    layers: int = 80
    hidden: int = 8192
    heads: int = 64
    vocab: int = 128256
    seq_len: int = 4096

    def __str__(self):
        return (
            f"{self.layers} blocks of width {self.hidden} ({self.heads} heads, MLP {4 * self.hidden}), vocabulary "
            f"{self.vocab}, {self.seq_len} positions"
        )

    def config(self, layers: int | None = None) -> ModelConfig:
        return ModelConfig(self.vocab, self.seq_len, self.hidden, self.heads, layers or self.layers)  # MLP: 4 x width

    def for_planner(self) -> planner.Model:
        return planner.Model(0, self.layers, self.hidden, self.heads, self.vocab, self.seq_len)  # params unused here


# Llama 3 70B's depth, width, heads and vocabulary in the course's block: 66.6e9 parameters (count_parameters), its
# MLP two 4h-wide matrices where Llama's SwiGLU has three 3.5h-wide ones.
SEVENTY_B = ModelShape()


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` under torch's fake process group (collectives return at once)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: measure in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard's), each storage once."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # the storage's identity: meta storages all sit at 0
    return sum(storages.values())


# --------------------------------------------------------------------------------------------------
# Model state: parameters, gradients and optimizer state of one rank
# --------------------------------------------------------------------------------------------------


@dataclass
class StateRow:
    layout: str
    stage: int
    rank: int
    place: tuple  # (pp, dp, tp) coordinates
    measured: dict  # bytes of params, grads, optimizer
    predicted: dict  # utils.planner.rank_model_state
    how: str  # "derived" (grads and optimizer from the parameters' storages) or "run" (a fake step)

    @property
    def equal(self) -> bool:
        return self.measured == self.predicted

    def differences(self) -> str:
        return ", ".join(
            f"{kind} {self.measured[kind] - self.predicted[kind]:+,} B"
            for kind in self.measured
            if self.measured[kind] != self.predicted[kind]
        )


def ranks_to_measure(dp: int, tp: int, pp: int) -> list[int]:
    """The first, a middle and the last stage; in each, the first and the last DP rank (FSDP2's shards differ only
    there: the last rank's chunk of a tensor whose rows dp does not divide is the short one) at tp coordinate 0."""
    stages = sorted({0, pp // 2, pp - 1})
    return [stage * dp * tp + replica * tp for stage in stages for replica in sorted({0, dp - 1})]


def build_rank_stage(shape: ModelShape, dp: int, tp: int, pp: int):
    """This rank's pipeline stage of the meta-device model, laid out by lesson 06's parallelize_builtin on the
    (pp, dp, tp) mesh; call inside fake_world."""
    threed = lesson("06")
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=threed.DIMS)
    with torch.device("meta"):
        model = TransformerLM(shape.config())
    return threed.parallelize_builtin(model, mesh, mesh.get_coordinate()[0])


def derived_state(stage: nn.Module, optimizer: str) -> dict:
    """Parameters measured (their storages: FSDP2's padded shards); gradients and optimizer state as torch allocates
    them (see the module's docstring): the padded shards again, and per parameter 0, 1 or 2 unpadded copies."""
    params = list(stage.parameters())
    unpadded = sum(p.to_local().numel() * p.element_size() for p in params)
    copies = {"sgd": 0, "momentum": 1, "adamw": 2}[optimizer]
    return {"params": storage_bytes(params), "grads": storage_bytes(params), "optimizer": copies * unpadded}


def stepped_state(stage: nn.Module, optimizer: str, hidden: int) -> dict:
    """One forward, backward and optimizer step of the stage under FakeTensorMode (a few tokens: no shard depends on
    the sequence), then the storages that hold the parameters, the gradients and the optimizer's state."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if stage.last:
        output_not_a_view(stage)  # as lesson 06 does: FSDP2 warns when a wrapped module returns a view
    with FakeTensorMode(allow_non_fake_inputs=True):
        stage.to_empty(device="cpu")  # FSDP2 re-creates its padded shards as fake tensors
        tokens = 8
        x = torch.zeros(1, tokens, dtype=torch.long) if stage.first else torch.zeros(1, tokens, hidden)
        stage(x).float().sum().backward()
        if optimizer == "adamw":
            step = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        else:
            step = torch.optim.SGD(stage.parameters(), lr=1e-3, momentum=0.9 if optimizer == "momentum" else 0.0)
        step.step()
    params = list(stage.parameters())
    state = [v for per_param in step.state.values() for v in per_param.values() if torch.is_tensor(v) and v.dim()]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
    }


def measure_model_state(
    shape: ModelShape, dp: int, tp: int, pp: int, ranks=None, optimizer: str = "sgd", run_step: bool = False
) -> list[StateRow]:
    """The model state of each rank in `ranks` (default ranks_to_measure) of a dp x tp x pp job, beside the planner's
    rank_model_state for its stage (fp32, ZeRO-3)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {optimizer!r}")
    threed, world = lesson("06"), dp * tp * pp
    grid = threed.Layout(pp=pp, dp=dp, tp=tp)
    layout = planner.Layout(dp, tp, pp, 1, 1, zero=3)
    rows = []
    for rank in ranks_to_measure(dp, tp, pp) if ranks is None else ranks:
        place = threed.coordinates(rank, grid)
        with fake_world(rank, world):
            stage = build_rank_stage(shape, dp, tp, pp)
            measured = stepped_state(stage, optimizer, shape.hidden) if run_step else derived_state(stage, optimizer)
        predicted = planner.rank_model_state(
            shape.for_planner(), layout, place["pp"], precision="fp32", optimizer=optimizer
        )
        rows.append(
            StateRow(
                f"dp {dp} x tp {tp} x pp {pp}", place["pp"], rank, (place["pp"], place["dp"], place["tp"]),
                measured, {kind: int(n) for kind, n in predicted.items()}, "run" if run_step else "derived",
            )
        )  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------
# Activations: what one block saves for backward
# --------------------------------------------------------------------------------------------------


@dataclass
class SavedTensor:
    name: str  # the module that saved it, and the operation that made it
    shape: tuple
    dtype: str
    bytes: int  # the bytes it adds to the count (0 when it shares memory with one counted before: not listed)


@dataclass
class ActivationRow:
    dtype: str
    tp: int
    sequence_parallel: bool
    recompute: str
    measured: int
    formula: float  # planner.activation_bytes_per_layer
    omitted: float  # the per-layer part of planner.omitted_activation_bytes
    sbh: int  # s x b x h values of this dtype, in bytes: the formula's unit
    saved: list = field(default_factory=list)  # SavedTensor, in the order autograd saved them

    @property
    def predicted(self) -> float:
        return self.formula + self.omitted

    @property
    def equal(self) -> bool:
        return self.measured == self.predicted

    def differences(self) -> str:
        extra = self.measured - self.predicted
        return f"measured {extra:+,.0f} B ({extra / self.sbh:+.4g} sbh)"


class _Producers(TorchDispatchMode):
    """Names the operation that made each storage (the first whose output lives in it) and the module it ran in.
    Keeps every storage alive until the block ends, so that no freed storage's address names another."""

    def __init__(self, where):
        super().__init__()
        self.where, self.made, self.storages = where, {}, []

    def name(self, tensor, what: str):
        storage = (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()
        if storage._cdata not in self.made:
            self.made[storage._cdata] = what
            self.storages.append(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        op = func.name().removeprefix("aten::").removeprefix("_c10d_functional::")
        for index, tensor in enumerate(outputs):
            self.name(tensor, f"{op}{f'[{index}]' if len(outputs) > 1 else ''} in {self.where() or 'block'}")
        return out


class _Listed(ActivationFootprint):
    """ActivationFootprint that also lists each tensor it counts: the module that saved it (`where()`) and the
    operation that made it (`producers`)."""

    def __init__(self, where, producers: _Producers):
        super().__init__()
        self.where, self.producers, self.saved = where, producers, []

    def _pack(self, tensor):  # autograd's saved-tensor hook
        self.count(tensor, f"{self.where() or 'block'} saves")
        return tensor

    def count(self, tensor, who: str):
        before = self.bytes
        ActivationFootprint._pack(self, tensor)
        added = self.bytes - before
        if added:
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            made = self.producers.made.get(local.untyped_storage()._cdata, "?")
            dtype = str(local.dtype).removeprefix("torch.")
            self.saved.append(SavedTensor(f"{who} {made}", tuple(local.shape), dtype, added))


@contextlib.contextmanager
def _module_path(block: nn.Module):
    """A function that names the innermost submodule of `block` running now (forward hooks keep a stack)."""
    stack, handles = [], []
    for name, module in block.named_modules():
        if name:
            # prepend: the module's own hooks (DTensor's input and output redistribution) run inside its name
            enter = module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name), prepend=True)
            leave = module.register_forward_hook(lambda m, a, out: stack.pop() and None)  # None keeps the output
            handles += [enter, leave]
    try:
        yield lambda: stack[-1] if stack else ""
    finally:
        for handle in handles:
            handle.remove()


MATMULS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


def keep_matmuls(ctx, op, *args, **kwargs):
    """Selective recomputation's policy: keep the matmuls' and the attention kernel's outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(caches: list):
    """checkpoint's context_fn for keep_matmuls; `caches` collects the cache that holds what the policy keeps."""

    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts(keep_matmuls)
        caches.append(forward.storage)
        return forward, recompute

    return context_fn


def _count_cached(saved: _Listed, caches: list):
    """Count what selective checkpointing's cache holds: per op and call, the outputs it kept (torch wraps each)."""
    for cache in caches:
        for calls in cache.values():
            for outputs in calls.values():
                for wrapped in torch.utils._pytree.tree_leaves(outputs):
                    if torch.is_tensor(getattr(wrapped, "val", None)):
                        saved.count(wrapped.val, "the policy keeps")


def measured_block(shape: ModelShape, tp: int, sequence_parallel: bool, recompute: str, dtype, micro_batch: int):
    """Bytes saved for backward by one block (a middle one: its input is the previous block's output as TP leaves it,
    split over the sequence under SP), and the saved tensors. Call inside fake_world(0, tp)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)) if tp > 1 else None  # outside: it reads its ranks
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build the parameters in it (no conversion of fake tensors afterwards)
        try:
            model = TransformerLM(shape.config(layers=2))
        finally:
            torch.set_default_dtype(default)
        if mesh is not None:
            lesson("04").apply_tensor_parallel(model, mesh, sequence_parallel)
        block = model.blocks[1]  # blocks[0] under SP also splits the sequence it receives: not a middle block
        tokens = shape.seq_len // (tp if sequence_parallel else 1)
        x = torch.randn(micro_batch, tokens, shape.hidden, dtype=dtype, requires_grad=True)
        caches = []
        with _module_path(block) as where, _Producers(where) as producers, _Listed(where, producers) as saved:
            producers.name(x, "the block's input")
            if recompute == "none":
                block(x)
            elif recompute == "full":
                checkpoint(block, x, use_reentrant=False)
            else:
                checkpoint(block, x, use_reentrant=False, context_fn=_selective(caches))
            _count_cached(saved, caches)
        return saved.bytes, saved.saved


def measure_block_activations(
    shape: ModelShape = SEVENTY_B,
    tp: int = 8,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype: str = "fp32",
    micro_batch: int = 1,
) -> ActivationRow:
    """One block's saved bytes beside the planner's: activation_bytes_per_layer (fused attention, no dropout: the
    course's model) and the per-layer part of omitted_activation_bytes (a middle stage of one layer)."""
    if recompute not in RECOMPUTE or dtype not in DTYPES:
        raise ValueError(f"recompute is one of {RECOMPUTE} and dtype one of {tuple(DTYPES)}")
    sp = sequence_parallel and tp > 1
    with fake_world(0, tp):
        measured, saved = measured_block(shape, tp, sp, recompute, DTYPES[dtype], micro_batch)
    s, b, h, a = shape.seq_len, micro_batch, shape.hidden, shape.heads
    value_bytes = DTYPES[dtype].itemsize
    formula = planner.activation_bytes_per_layer(
        s, b, h, a, tp, sp, recompute, value_bytes, dropout=False, fused_attention=True, framework="torch"
    )
    middle = planner.Layout(1, tp, 3, b, 1, zero=0, recompute=recompute, sequence_parallel=sp, fused_attention=True)
    three = planner.Model(0, 3, h, a, shape.vocab, s)  # stage 1 of 3: one layer, no embedding, no head, no loss
    omitted = planner.omitted_activation_bytes(three, middle, stage=1, layers=1)
    return ActivationRow(dtype, tp, sp, recompute, measured, formula, omitted, s * b * h * value_bytes, saved)


def activation_rows(
    shape: ModelShape, tp: int, dtypes=("fp32",), recomputes=RECOMPUTE, micro_batch: int = 1
) -> list[ActivationRow]:
    """Each recomputation mode, with and without sequence parallelism (only without at tp = 1), in each dtype."""
    options = [False, True] if tp > 1 else [False]
    return [
        measure_block_activations(shape, tp, sp, recompute, dtype, micro_batch)
        for dtype in dtypes
        for sp in options
        for recompute in recomputes
    ]


# --------------------------------------------------------------------------------------------------
# Tables and the command line
# --------------------------------------------------------------------------------------------------


def table(rows) -> str:
    """Measured beside predicted, one line per row (StateRow or ActivationRow), and what differs."""
    lines = []
    if any(isinstance(row, StateRow) for row in rows):
        lines.append(
            f"{'layout':<20} {'stage':>5} {'rank':>4} {'(pp,dp,tp)':>11} {'params B':>15} {'grads B':>15} "
            f"{'optimizer B':>15}  vs utils.planner.rank_model_state"
        )
        for row in (row for row in rows if isinstance(row, StateRow)):
            m = row.measured
            verdict = "equal" if row.equal else f"DIFFERS: {row.differences()}"
            lines.append(
                f"{row.layout:<20} {row.stage:>5} {row.rank:>4} {str(row.place).replace(' ', ''):>11} "
                f"{m['params']:>15,} {m['grads']:>15,} {m['optimizer']:>15,}  {verdict}"
            )
    if any(isinstance(row, ActivationRow) for row in rows):
        lines.append(
            f"{'dtype':<5} {'tp':>3} {'SP':>3} {'recompute':>9} {'measured B':>14} {'formula B':>14} "
            f"{'+ omitted B':>12} {'measured':>9}  vs the planner"
        )
        for row in (row for row in rows if isinstance(row, ActivationRow)):
            verdict = "equal" if row.equal else f"DIFFERS: {row.differences()}"
            lines.append(
                f"{row.dtype:<5} {row.tp:>3} {'yes' if row.sequence_parallel else 'no':>3} {row.recompute:>9} "
                f"{row.measured:>14,} {row.formula:>14,.0f} {row.omitted:>12,.0f} {human(row.measured):>9}  {verdict}"
            )
    return "\n".join(lines)


def saved_tensors(row: ActivationRow) -> str:
    """The tensors behind one activation row, each in bytes and in units of s x b x h values."""
    return "\n".join(
        f"    {item.name:<58} {str(list(item.shape)):>20} {item.dtype:>8} {item.bytes:>13,} B "
        f"{item.bytes / row.sbh:>7.4g} sbh"
        for item in row.saved
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.measure_at_scale",
        description="Model state and activations of the course's model at real size, measured under a fake process "
        "group with meta and fake tensors (nothing allocated), beside utils.planner's prediction.",
    )
    add = parser.add_argument
    add("--layers", type=int, default=SEVENTY_B.layers, help="blocks (default 80)")
    add("--hidden", type=int, default=SEVENTY_B.hidden, help="width (default 8192; the MLP is 4 x wider)")
    add("--heads", type=int, default=SEVENTY_B.heads, help="attention heads (default 64)")
    add("--vocab", type=int, default=SEVENTY_B.vocab, help="vocabulary (default 128256)")
    add("--seq-len", type=int, default=SEVENTY_B.seq_len, help="sequence length (default 4096)")
    add("--gpus", type=int, default=64, help="ranks in the job (default 64)")
    add("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    add("--pp", type=int, default=1, help="pipeline stages (default 1)")
    add("--dp", type=int, help="data-parallel size (default: --gpus / (tp x pp))")
    add("--ranks", help="global ranks to measure, comma-separated (default: the first and last DP rank of the "
        "first, a middle and the last stage)")  # fmt: skip
    add("--optimizer", choices=OPTIMIZERS, default="sgd", help="optimizer state to count (default sgd: none)")
    add("--run-step", action="store_true", help="measure gradients and optimizer state by running a fake step")
    add("--micro-batch", type=int, default=1, help="sequences in the measured block's micro-batch (default 1)")
    add("--dtype", choices=[*DTYPES, "both"], default="fp32",
        help="the measured block's dtype (default fp32; in bf16 a CPU's LayerNorm keeps bf16 statistics, CUDA's "
        "fp32)")  # fmt: skip
    add("--recompute", default=",".join(RECOMPUTE), help="recomputation modes to measure (default: all three)")
    args = parser.parse_args(argv)
    sizes = [args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.gpus, args.tp, args.pp]
    if min(sizes + [args.micro_batch, args.dp or 1]) < 1:
        parser.error("every size must be positive")
    dp = args.dp or args.gpus // (args.tp * args.pp)
    if dp * args.tp * args.pp != args.gpus:
        parser.error(f"--dp {dp} x --tp {args.tp} x --pp {args.pp} is not --gpus {args.gpus}: change one of them")
    if args.hidden % args.heads or args.heads % args.tp or args.seq_len % args.tp or args.layers < args.pp:
        parser.error(
            f"--heads must divide --hidden, --tp must divide --heads and --seq-len, and --pp ({args.pp}) may not "
            f"exceed --layers ({args.layers})"
        )
    try:
        ranks = None if args.ranks is None else [int(rank) for rank in args.ranks.split(",")]
    except ValueError:
        parser.error("--ranks takes integers like 0,7,63")
    if ranks and not all(0 <= rank < args.gpus for rank in ranks):
        parser.error(f"--ranks must lie in 0..{args.gpus - 1}")
    recomputes = tuple(args.recompute.split(","))
    if not set(recomputes) <= set(RECOMPUTE):
        parser.error(f"--recompute takes some of {','.join(RECOMPUTE)}, comma-separated")
    shape = ModelShape(args.layers, args.hidden, args.heads, args.vocab, args.seq_len)

    state = measure_model_state(shape, dp, args.tp, args.pp, ranks, args.optimizer, args.run_step)
    how = "measured by a fake step" if args.run_step else "from FSDP2's padded shards and torch's optimizer rules"
    print(
        f"Model state per rank: {shape}, {args.gpus} ranks, fp32 {args.optimizer}, FSDP2 (ZeRO-3); gradients and "
        f"optimizer state {how}"
    )
    print(table(state))
    dtypes = tuple(DTYPES) if args.dtype == "both" else (args.dtype,)
    blocks = activation_rows(shape, args.tp, dtypes, recomputes, args.micro_batch)
    print(
        f"\nOne block's activations saved for backward, s={args.seq_len} b={args.micro_batch} h={args.hidden} "
        f"a={args.heads} t={args.tp} (fake tensors, the CPU's kernels: in bf16 its LayerNorm keeps bf16 statistics, "
        f"CUDA's fp32); formula: activation_bytes_per_layer (fused attention, no dropout), + omitted: the norms' "
        f"statistics and the attention's log-sum-exp (utils.planner.omitted_activation_bytes, one middle layer)"
    )
    print(table(blocks))
    for row in blocks:
        if not row.equal:
            print(f"\n{row.dtype} tp {row.tp} SP {'yes' if row.sequence_parallel else 'no'} {row.recompute}: "
                  f"{row.differences()}; saved tensors (sbh = {row.sbh:,} B):")  # fmt: skip
            print(saved_tensors(row))
    differing = sum(not row.equal for row in state + blocks)
    print(f"\n{differing} of {len(state) + len(blocks)} rows differ from the planner" if differing else "\nall equal")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
