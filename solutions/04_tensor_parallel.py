"""Lesson 04: tensor parallelism. Each rank holds a slice of every projection and computes a slice of its output.

One layer too big for one device is split across the ranks of a node: q/k/v and the MLP's up projection by
output features (column-parallel), o and down by input features (row-parallel), so a block needs one
all-reduce in attention and one in the MLP per forward (and their conjugates in backward). Every rank reads
the same batch; the TP size is the world size. N ranks train like one process on the same batch (compare
with lesson 00): the same model, to within float32 rounding (the partial sums are added in another order).

With --sequence-parallel, the norms and residual adds work on 1/N of the sequence and each all-reduce becomes
an all-gather (entering a region) + a reduce-scatter (leaving it): the same bytes. What it saves, and what
it does not: the norms' inputs and statistics and the residual stream are kept for 1/N of the tokens; the
norms' gathered outputs, which q/k/v and up keep for backward, stay whole. Korthikanti et al. (2022) and
Megatron-LM keep only the 1/N slice there too and all-gather it again in backward: 34 sbh/t bytes per layer
(fp16, attention scores aside), where this version keeps 4 sbh (t-1)/t more (s sequence, b batch, h width).

    torchrun --nproc_per_node=2 solutions/04_tensor_parallel.py                          # DTensor parallelize_module
    torchrun --nproc_per_node=4 solutions/04_tensor_parallel.py --tp-impl scratch        # the hand-written f/g layers
    torchrun --nproc_per_node=4 solutions/04_tensor_parallel.py --sequence-parallel      # + sequence parallelism
    sbatch slurm/04_tensor_parallel.sbatch solutions                                     # 1 node x 4 GPUs
"""

import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader

from utils.collective_counter import CollectiveCounter
from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, Refusal, destroy_process_group, print0, run_main, save0, setup
from utils.gather import checksum, full_parameters
from utils.lesson_04.checks import check_layers
from utils.lesson_04.layout import describe
from utils.metrics import SavedActivations, state_bytes, write_metrics
from utils.model import ModelConfig, build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    batches,
    build_optimizer,
    check_batches,
    model_config,
    parameter_groups,
    parse_args,
)

# --------------------------------------------------------------------------------------------------
# Tensor parallelism from scratch: the collectives as autograd functions
# --------------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd may still use
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (the collective works on dim 0: move `dim` there and back)."""
    n = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's 1/N slice along `dim`."""
    n = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/N slice of `x` along `dim` (no communication)."""
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def f_or_g(x: torch.Tensor, group, which: str, backward: bool) -> torch.Tensor:
    """What f (which="f", entering a tensor-parallel region) or g (which="g", leaving it) does to x: in forward,
    or in backward (backward=True: x is the gradient coming back). The two autograd functions below call it."""
    # TODO 1: the conjugate pair f and g. Return x summed over the ranks, or x unchanged, for f (entering a
    #   tensor-parallel region) and g (leaving it), in forward and in backward. Where is a value whole, where a
    #   partial sum?
    # HINT 1: Inside the region each rank holds a slice of the layer. Which tensors are then whole and identical on
    #   every rank, and which are only this rank's share of a sum? A share must be summed; a whole value must not.
    # HINT 2: f's forward: the input is already whole everywhere. f's backward: each rank's slice contributes part of
    #   the input's gradient. g's forward: each rank holds a partial sum of the output. g's backward: the output's
    #   gradient is whole. So f sums in backward only, g in forward only.
    # HINT 3: which == "f": _all_reduce(x, group) when backward, else x.view_as(x) (the identity, as a new tensor
    #   for autograd). which == "g": the reverse, x.view_as(x) when backward, else _all_reduce(x, group).
    # BEGIN SOLUTION
    if which == "f":  # entering: the input is whole on every rank, its gradient a partial sum
        return _all_reduce(x, group) if backward else x.view_as(x)
    return x.view_as(x) if backward else _all_reduce(x, group)  # leaving: the reverse
    # END SOLUTION


class CopyToParallelRegion(torch.autograd.Function):
    """f, where a tensor-parallel region begins (what it does each way is TODO 1's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return f_or_g(x, group, "f", backward=False)

    @staticmethod
    def backward(ctx, grad):
        return f_or_g(grad, ctx.group, "f", backward=True), None  # one gradient per forward input: none for group


class ReduceFromParallelRegion(torch.autograd.Function):
    """g, where a tensor-parallel region ends (what it does each way is TODO 1's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return f_or_g(x, group, "g", backward=False)

    @staticmethod
    def backward(ctx, grad):
        return f_or_g(grad, ctx.group, "g", backward=True), None


class Split(torch.autograd.Function):
    """Keep this rank's slice along `dim` in forward; all-gather the slices' gradients in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class Gather(torch.autograd.Function):
    """All-gather along `dim` in forward for a computation every rank repeats in full (so each rank's gradient
    is already complete); keep this rank's slice of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


def _shard(tensor: torch.Tensor, dim: int, group) -> nn.Parameter:
    """This rank's slice of a full weight along `dim`, as a parameter that remembers how to gather it back."""
    shard = nn.Parameter(_split(tensor.detach(), dim, group).clone())
    shard.tp_dim = dim  # full_parameters() gathers along this dimension
    return shard


class ColumnParallelLinear(nn.Module):
    """nn.Linear with its output features split over the ranks: rank r computes outputs [r*out/N, (r+1)*out/N).

    Built from the full layer: this rank keeps its rows of the weight [out, in] and its slice of the bias, so
    N ranks hold exactly the one-process layer between them. copy_input: apply f to the input (a standalone
    layer); False where the block applied f once for several layers (q, k and v read the same input).
    gather_output: all-gather the output slices into the full output.
    """

    def __init__(self, linear: nn.Linear, group, copy_input: bool = True, gather_output: bool = False):
        super().__init__()
        self.group, self.copy_input, self.gather_output = group, copy_input, gather_output
        n = dist.get_world_size(group)
        if linear.out_features % n:
            raise CourseError(f"{linear.out_features} output features do not split over {n} ranks")
        self.in_features, self.out_features = linear.in_features, linear.out_features // n  # local sizes
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO 2: the column-parallel forward. Return this rank's output features of the whole layer ([..., in] ->
        #   [..., out / N]), or all of them when the layer gathers its output; a layer that copies its input enters the
        #   region itself.
        # HINT 1: This rank holds some rows of the weight and their bias: what does a linear layer with only those rows
        #   compute? And what must the input pass through first so that its gradient comes back whole?
        # HINT 2: If copy_input, pass x through f. Apply the local linear with this rank's weight and bias. If
        #   gather_output, concatenate the ranks' output slices along the last dimension (an autograd function above).
        # HINT 3: x = CopyToParallelRegion.apply(x, self.group) if self.copy_input; y = F.linear(x, self.weight,
        #   self.bias); return Gather.apply(y, -1, self.group) if self.gather_output, else y.
        # BEGIN SOLUTION
        if self.copy_input:
            x = CopyToParallelRegion.apply(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return Gather.apply(y, -1, self.group) if self.gather_output else y
        # END SOLUTION


class RowParallelLinear(nn.Module):
    """nn.Linear with its input features split over the ranks: rank r multiplies input features
    [r*in/N, (r+1)*in/N) by the matching columns of the weight, a partial sum of the whole output.

    Built from the full layer: this rank keeps its columns of the weight and a copy of the WHOLE bias (added
    once, after the partial outputs are summed). input_is_parallel: the input arrives already split (the output
    of a column-parallel layer); else it is split here. sequence_parallel: leave the region with a
    reduce-scatter along the sequence (TODO 5) instead of g's all-reduce.
    """

    def __init__(self, linear: nn.Linear, group, input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.leave = ReduceScatterSequence if sequence_parallel else ReduceFromParallelRegion  # g, or SP's g
        n = dist.get_world_size(group)
        if linear.in_features % n:
            raise CourseError(f"{linear.in_features} input features do not split over {n} ranks")
        self.in_features, self.out_features = linear.in_features // n, linear.out_features  # local sizes
        self.weight = _shard(linear.weight, 1, group)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO 3: the row-parallel forward. Return the whole layer's output, on every rank, from this rank's
        #   input features (cut here unless they arrive cut): each rank's product is a partial sum, and the bias
        #   belongs to the sum, once.
        # HINT 1: Rank r multiplies its input features by the matching columns of the weight: what is its result,
        #   and how do the ranks' results make the layer's output? How many times may the bias enter that total?
        # HINT 2: Unless input_is_parallel, keep this rank's slice of the last dimension. Apply the local linear
        #   without the bias. Leave the region with self.leave (g, or sequence parallelism's g). Add the bias.
        # HINT 3: if not self.input_is_parallel: x = Split.apply(x, -1, self.group); then
        #   y = self.leave.apply(F.linear(x, self.weight), self.group); return y + self.bias.
        # BEGIN SOLUTION
        if not self.input_is_parallel:
            x = Split.apply(x, -1, self.group)
        y = self.leave.apply(F.linear(x, self.weight), self.group)
        return y + self.bias
        # END SOLUTION


def check_tensor_parallel_size(config: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool):
    """Refuse a TP size that cannot split the heads, the MLP or (with SP) the sequence into equal whole parts."""
    hidden = config.mlp_ratio * config.dim
    if config.n_heads % tp:
        raise Refusal(
            f"a TP size of {tp} does not divide --n-heads {config.n_heads} (each rank needs whole heads): "
            f"launch a number of processes that divides {config.n_heads}, or choose --n-heads as a multiple of {tp}"
        )
    if hidden % tp:
        raise Refusal(f"a TP size of {tp} does not divide the MLP width {hidden}: choose a --dim that {tp} divides")
    if sequence_parallel and seq_len % tp:
        raise Refusal(
            f"--sequence-parallel splits --seq-len {seq_len} over {tp} ranks: choose a --seq-len that {tp} divides"
        )


def tensor_parallel_block(block: nn.Module, group, sequence_parallel: bool = False):
    """Shard one Block of utils/model.py in place: q/k/v/up column-parallel, o/down row-parallel."""
    enter = GatherSequence if sequence_parallel else CopyToParallelRegion  # f, or SP's f (TODO 5)
    # TODO 4: a tensor-parallel block. Shard the block in place: each of its six projections replaced by a parallel
    #   layer built from it (which way each?), and attention and the MLP each entering their region once, through
    #   `enter`, with register_forward_pre_hook.
    # HINT 1: Which projections produce a slice of their output features for the next layer, and which consume such a
    #   slice? q, k and v read the same input: how many times should that input pass through f?
    # HINT 2: q, k, v and up become ColumnParallelLinear (copy_input=False: the hook applies f once); o and down
    #   RowParallelLinear, with sequence_parallel passed on. Then a forward pre-hook on block.attention and on
    #   block.mlp replaces their input by enter.apply(input, group).
    # HINT 3: for q_proj, k_proj, v_proj: setattr(attention, name, ColumnParallelLinear(<its layer>, group,
    #   copy_input=False)); mlp.up_proj likewise; attention.o_proj = RowParallelLinear(attention.o_proj, group,
    #   sequence_parallel=sequence_parallel), mlp.down_proj likewise; for attention and mlp:
    #   module.register_forward_pre_hook(lambda module, args: (enter.apply(args[0], group),)).
    # BEGIN SOLUTION
    attention, mlp = block.attention, block.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group, copy_input=False))
    attention.o_proj = RowParallelLinear(attention.o_proj, group, sequence_parallel=sequence_parallel)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group, copy_input=False)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel=sequence_parallel)
    for module in (attention, mlp):
        module.register_forward_pre_hook(lambda module, args: (enter.apply(args[0], group),))
    # END SOLUTION


def parallelize_scratch(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """The hand-written tensor (and sequence) parallelism of the whole model; embeddings, norms and head replicated."""
    for block in model.blocks:
        tensor_parallel_block(block, group, sequence_parallel)
    if sequence_parallel:
        # The embeddings' output is whole on every rank: keep this rank's part of the sequence for the blocks.
        model.blocks[0].register_forward_pre_hook(lambda module, args: (Split.apply(args[0], 1, group),))
        # The final norm works on the sequence slice; the replicated head needs the whole sequence again.
        model.norm.register_forward_hook(lambda module, args, output: Gather.apply(output, 1, group))
    return model


# --------------------------------------------------------------------------------------------------
# Sequence parallelism: the residual stream split along the sequence between the regions
# --------------------------------------------------------------------------------------------------


def sequence_f_or_g(x: torch.Tensor, group, which: str, backward: bool) -> torch.Tensor:
    """What SP's f (which="f", entering a tensor-parallel region) or SP's g (which="g", leaving it) does to x along
    the sequence (dim 1): in forward, or in backward (backward=True: x is the gradient coming back)."""
    # TODO 5: the sequence-parallel pair. TODO 1 along the sequence (dim 1): return x gathered from every rank, or
    #   summed over the ranks and cut to this rank's tokens, for SP's f and g, in forward and in backward.
    # HINT 1: Between the regions each rank holds 1/N of the tokens. Inside, the layers need every token, and what
    #   leaves a row-parallel layer is a partial sum. Which of the four cases gathers, which sums and cuts?
    # HINT 2: SP's f: forward gathers the sequence; its backward receives partial gradients of every token, so it sums
    #   them and keeps this rank's tokens. SP's g: forward sums the partial outputs and keeps this rank's tokens; its
    #   backward gathers. All-reduce = reduce-scatter + all-gather: the same bytes as TODO 1's pair.
    # HINT 3: which == "f": _reduce_scatter(x, 1, group) when backward, else _all_gather(x, 1, group).
    #   which == "g": _all_gather(x, 1, group) when backward, else _reduce_scatter(x, 1, group).
    # BEGIN SOLUTION
    if which == "f":  # entering: every token needed; the gradients coming back are partial sums
        return _reduce_scatter(x, 1, group) if backward else _all_gather(x, 1, group)
    return _all_gather(x, 1, group) if backward else _reduce_scatter(x, 1, group)  # leaving: the reverse
    # END SOLUTION


class GatherSequence(torch.autograd.Function):
    """SP's f, where the sequence-parallel part hands over to tensor parallelism (TODO 5)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_f_or_g(x, group, "f", backward=False)

    @staticmethod
    def backward(ctx, grad):
        return sequence_f_or_g(grad, ctx.group, "f", backward=True), None


class ReduceScatterSequence(torch.autograd.Function):
    """SP's g, where tensor parallelism hands back to the sequence-parallel part (TODO 5)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_f_or_g(x, group, "g", backward=False)

    @staticmethod
    def backward(ctx, grad):
        return sequence_f_or_g(grad, ctx.group, "g", backward=True), None


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters that, with sequence parallelism, only see this rank's part of the sequence:
    the norms and the row-parallel layers' biases (added after the reduce-scatter). Their gradients are partial."""
    params = [p for name, p in model.named_parameters() if "norm" in name]
    for module in model.modules():
        if isinstance(module, RowParallelLinear) and module.sequence_parallel:
            params.append(module.bias)
    return params


def allreduce_sequence_parallel_grads(model: nn.Module, group):
    """After backward, with sequence parallelism: complete the partial gradients (one all-reduce for all)."""
    params = [p for p in sequence_parallel_parameters(model) if p.grad is not None]
    # TODO 6: sequence-parallel gradients. Give every parameter of `params` its full gradient, in one collective:
    #   each rank's norms and row-parallel biases saw only its part of the sequence.
    # HINT 1: Each rank's gradient of a norm's weight covers its own tokens only: how do the ranks' gradients make
    #   the whole one? And how do you send many small tensors in one collective instead of one each?
    # HINT 2: Flatten every gradient and concatenate them into one buffer; all-reduce it (a sum) over the group;
    #   split the buffer back into pieces of each gradient's size and copy each into its gradient.
    # HINT 3: flat = torch.cat([p.grad.flatten() for p in params]); dist.all_reduce(flat, group=group); then for p,
    #   piece in zip(params, flat.split([p.numel() for p in params])): p.grad.copy_(piece.view_as(p.grad)).
    # BEGIN SOLUTION
    if not params:
        return
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat, group=group)
    for p, summed in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(summed.view_as(p.grad))
    # END SOLUTION


# --------------------------------------------------------------------------------------------------
# The built-in: DTensor's parallelize_module
# --------------------------------------------------------------------------------------------------


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Tensor (and sequence) parallelism of the course model on a 1-D DeviceMesh (or a TP sub-mesh of a larger one).

    A sharded weight becomes a DTensor: a local tensor plus placements on the mesh (Shard(d): split along dim d;
    Replicate(): whole on every rank; Partial(): every rank holds a summand, the value is their sum, reduced
    when something needs it whole). With SP the norms' gradients are Partial until the optimizer step reads them:
    a gradient read before step() (for clipping or logging) through to_local() is this rank's partial sum.
    """
    check_tensor_parallel_size(model.config, tp_mesh.size(), model.config.seq_len, sequence_parallel)
    # TODO 7: the same layout with DTensor. Give parallelize_module a plan {submodule path: style} that shards each
    #   block as tensor_parallel_block does (q, k, v sharing one backward collective) and, with SP, splits the norms
    #   and the residual activations by sequence.
    # HINT 1: Which of ColwiseParallel and RowwiseParallel matches a column- and a row-parallel layer? Between the
    #   regions, is the residual stream Replicate() or Shard(1)? What must attention's and the MLP's input become?
    # HINT 2: Per block: ColwiseParallel for q/k/v/up; RowwiseParallel for o/down, output_layouts the stream's layout;
    #   PrepareModuleInput on "attention" and "mlp" from the stream's layout to Replicate(), use_local_output=False
    #   (one DTensor input: one backward collective). With SP: SequenceParallel() on the two norms; on the model,
    #   "blocks.0" takes Replicate() to Shard(1), "norm" is SequenceParallel(), "head" takes Shard(1) to Replicate().
    # HINT 3: stream = Shard(1) if sequence_parallel else Replicate(); enter = PrepareModuleInput(input_layouts=
    #   stream, desired_input_layouts=Replicate(), with use_local_output=False); for each block:
    #   parallelize_module(block, tp_mesh, {"attention": enter, "attention.q_proj": ColwiseParallel(), ...,
    #   the o and down projections: RowwiseParallel(output_layouts=stream), "mlp": enter, ...}); with SP add the norms,
    #   then parallelize_module(model, tp_mesh, {...}) with use_local_output=True on "blocks.0" and "head".
    # BEGIN SOLUTION
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between the regions
    enter = PrepareModuleInput(input_layouts=stream, desired_input_layouts=Replicate(), use_local_output=False)
    for block in model.blocks:
        plan = {
            "attention": enter,
            "attention.q_proj": ColwiseParallel(),
            "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp": enter,
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan["attn_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        plan = {
            "blocks.0": PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
            ),
            "norm": SequenceParallel(),
            "head": PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
            ),
        }
        parallelize_module(model, tp_mesh, plan)
    # END SOLUTION
    return model


# --------------------------------------------------------------------------------------------------
# Training: every rank of the tensor-parallel group reads the same batch
# --------------------------------------------------------------------------------------------------


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: the parity checks need it
    parser.add_argument(
        "--tp-impl", choices=["scratch", "dtensor"], default="dtensor", help="hand-written layers or parallelize_module"
    )
    parser.add_argument("--sequence-parallel", action="store_true", help="split norms and residuals by sequence")
    args = parse_args(parser)
    local_rank, rank, device, world_size = setup(args.seed)
    tp = world_size  # every rank is in the one tensor-parallel group
    config = model_config(args)
    check_tensor_parallel_size(config, tp, args.seq_len, args.sequence_parallel)

    # Data: every rank of a tensor-parallel group reads the SAME batch (lesson 00's loader, same seed).
    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args, 1)  # no data parallelism: each rank needs the whole batch
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator)

    # The full model on every rank (same seed), then sliced: each rank keeps its shards of the same weights.
    tp_mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    group = tp_mesh.get_group()
    model = build_model(config, seed=args.seed).to(device)
    if args.tp_impl == "scratch":
        # Check the hand-written pieces on small layers first, in TODO order: a mistake stops here, named.
        sequence_pair = (GatherSequence, ReduceScatterSequence) if args.sequence_parallel else None
        check_layers(group, device, f=CopyToParallelRegion, g=ReduceFromParallelRegion, column=ColumnParallelLinear,
                     row=RowParallelLinear, block=tensor_parallel_block, sequence_pair=sequence_pair)  # fmt: skip
        model = parallelize_scratch(model, group, args.sequence_parallel)
    else:
        model = apply_tensor_parallel(model, tp_mesh, args.sequence_parallel)
    optimizer = build_optimizer(parameter_groups(model), args)
    examples = {
        name: describe(model, name) for name in ("blocks.0.attention.q_proj.weight", "blocks.0.mlp.down_proj.weight")
    }
    print0(
        f"{args.dataset}: {len(train)} blocks of {args.seq_len + 1} tokens | model: {count_parameters(config):,} "
        f"parameters | TP {tp} ({args.tp_impl}{', sequence parallel' if args.sequence_parallel else ''}) | "
        f"{args.optimizer} | batch {args.batch_size} | device {device.type}"
    )
    for name, info in examples.items():
        print0(
            f"  {name}: {info['type']}, placements {', '.join(info['placements'])}, "
            f"shape {info['global_shape']}, local shape {info['local_shape']}"
        )

    # The first step is measured (collectives, saved activations: both slow it down), the others are timed.
    counter = CollectiveCounter(device=device)  # also checks that DTensor's collectives get `device` tensors
    counter.self_check(device, group)
    logger = Logger(args, total_steps=args.steps)
    throughput = Throughput(device, warmup=1)
    losses, activation_bytes = [], None
    data = batches(loader)
    for step in range(1, args.steps + 1):
        inputs, targets = next(data)
        inputs, targets = inputs.to(device), targets.to(device)
        first = step == 1
        counted = counter.phase if first else lambda phase: nullcontext()
        with SavedActivations(exclude=model.parameters()) if first else nullcontext() as saved:
            with counted("forward"):
                loss = loss_fn(model(inputs), targets)  # every rank computes the same, whole loss
            optimizer.zero_grad(set_to_none=True)
            with counted("backward"):
                loss.backward()
        with counted("step"):  # gradient synchronisation (the optimizer's, or ours with scratch SP) and the update
            if args.tp_impl == "scratch" and args.sequence_parallel:
                allreduce_sequence_parallel_grads(model, group)
            optimizer.step()
        if first:
            activation_bytes = saved.peak_bytes
        losses.append(loss.item())
        throughput.step(inputs.numel())  # every rank trained on the same tokens
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    collectives = counter.table()  # {phase: {kind: [calls, bytes of the whole tensors]}}, step 1
    summary = [
        f"{phase}: " + ", ".join(f"{n} {kind}" for kind, (n, _) in by_kind.items())
        for phase, by_kind in collectives.items()
    ]
    print0(
        f"collectives in step 1: {' | '.join(summary)} | activations saved for backward: {activation_bytes:,} bytes "
        "per rank"
    )
    tokens_per_s = throughput.tokens_per_s
    print0(f"throughput: {tokens_per_s:,.0f} tokens/s on {world_size} x {device.type} (steps 2 to {args.steps})")
    full = full_parameters(model, group)
    if args.checkpoint:
        save0({"model": {k: v.cpu() for k, v in full.items()}, "config": vars(config)}, args.checkpoint)
        print0(f"saved the full model to {args.checkpoint}")
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=tokens_per_s,
        param_checksum=checksum(full.values()),
        bytes_per_rank=state_bytes(model, optimizer),
        optimizer=args.optimizer,
        dataset=args.dataset,
        tp_size=tp,
        tp_impl=args.tp_impl,
        sequence_parallel=args.sequence_parallel,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        dim=args.dim,
        n_layers=args.n_layers,
        collectives_step1=collectives,
        activation_bytes=activation_bytes,
        examples=examples,
    )
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    del model, optimizer
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: ranks that train without an error and disagree (TODO 8; notebook section 8, `make check LESSON=04`)
# --------------------------------------------------------------------------------------------------


def train_parallel_mlp(embed: nn.Linear, up: nn.Linear, down: nn.Linear, inputs, targets, steps: int, lr: float, group):
    """Train h + down(gelu(up(h))), h = embed(inputs), with SGD for `steps` steps on the same batch on every rank of
    `group`: the MLP split as in a block (up column-parallel, down row-parallel), embed whole on every rank. The
    layers arrive whole and identical on every rank. Returns this rank's loss at every step."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    embed_weight = nn.Parameter(embed.weight.detach().clone())  # replicated
    up_weight = nn.Parameter(up.weight.detach().chunk(n, dim=0)[rank].clone())  # this rank's output features
    up_bias = nn.Parameter(up.bias.detach().chunk(n)[rank].clone())
    down_weight = nn.Parameter(down.weight.detach().chunk(n, dim=1)[rank].clone())  # this rank's input features
    down_bias = nn.Parameter(down.bias.detach().clone())  # whole, like RowParallelLinear's
    optimizer = torch.optim.SGD([embed_weight, up_weight, up_bias, down_weight, down_bias], lr=lr)
    losses = []
    for _ in range(steps):
        h = F.linear(inputs, embed_weight)
        # TODO 8: lab, ranks that train without an error and disagree. In the exercise this function trains without an
        #   error. Run it on 2 ranks (notebook section 8): does every rank report the same losses? Do they match
        #   one process's? What does each rank hold after its slice of down, and what should the residual add
        #   receive? Fix the MLP with the autograd functions of TODO 1.
        # HINT 1: After its slice of down, does a rank hold the MLP's output or a part of it? And does the gradient that
        #   reaches h from the MLP hold everything, on each rank?
        # HINT 2: The row-parallel product must be summed over the ranks (g) before the bias and the residual add; the
        #   MLP's input must pass through f so that h's gradient is summed in backward.
        # HINT 3: hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias)); y = h +
        #   ReduceFromParallelRegion.apply(<hidden times down_weight>, group) + down_bias.
        # BEGIN SOLUTION
        hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias))  # f: h's gradient summed
        y = h + ReduceFromParallelRegion.apply(F.linear(hidden, down_weight), group) + down_bias  # g, then the bias
        # EXERCISE
        # hidden = F.gelu(F.linear(CopyToParallelRegion.apply(h, group), up_weight, up_bias))
        # y = h + F.linear(hidden, down_weight) + down_bias
        # END SOLUTION
        loss = F.mse_loss(y, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    run_main(main)
