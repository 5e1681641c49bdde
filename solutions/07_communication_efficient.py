"""Lesson 07: communication-efficient training. Lesson 02's DDP loop, sending fewer bytes per step.

DDP averages every gradient in full precision at every step. When the network is the bottleneck, send
less: cast the gradients to 16 bits (fp16, bf16), keep only the k largest entries (top-k, with error
feedback), round them to a few bits per entry (stochastic rounding, scaled by max|x| as TernGrad does; QSGD
scales by the L2 norm), send a low-rank approximation (PowerSGD), or communicate only every H steps (Local SGD,
post-local SGD). Each method is a DDP
communication hook (`register_comm_hook`) or a change to the loop, and every byte that any method hands
to a collective is counted the same way: what this rank sends on a ring (an all-reduce of B bytes over
n ranks sends 2(n-1)/n x B, an all-gather of B bytes from each rank sends (n-1) x B).
Compare this file with solutions/02_data_parallel.py: the difference is the lesson.

    torchrun --nproc_per_node=4 solutions/07_communication_efficient.py --method none       # plain DDP
    torchrun --nproc_per_node=4 solutions/07_communication_efficient.py --method topk --topk-ratio 0.01
    torchrun --nproc_per_node=4 solutions/07_communication_efficient.py --method quantize --bits 8
    torchrun --nproc_per_node=4 solutions/07_communication_efficient.py --method localsgd --local-steps 4
    torchrun --nproc_per_node=4 solutions/07_communication_efficient.py --method powersgd --powersgd-rank 1
    sbatch slurm/07_communication_efficient.sbatch solutions --method fp16                  # 2 nodes x 4 GPUs
"""

import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, DistributedSampler

from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, Refusal, destroy_process_group, print0, run_main, save0, setup
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    autocast,
    base_parser,
    batches,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
    positive_int,
)

METHODS = ["none", "fp16", "bf16", "topk", "quantize", "powersgd", "localsgd", "postlocal"]
BITS = [2, 4, 8, 16, 32]  # codes travel as bytes: 4 two-bit or 2 four-bit codes per byte; 32 = no rounding


# --------------------------------------------------------------------------------------------------
# Counting bytes: every method's collectives pass through torch.distributed's all-reduce or an all-gather
# --------------------------------------------------------------------------------------------------


def ring_bytes(collective: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for a collective on a ring of `group_size` ranks (lesson 01's bus bytes).

    all-reduce of B bytes: 2(n-1)/n x B (reduce-scatter then all-gather), whatever n is.
    all-gather of B bytes from each rank: (n-1) x B, which grows with n: the price of sparse and
    quantized methods, whose per-rank contributions cannot simply be added up on the way.
    """
    n = group_size
    return 2 * (n - 1) / n * nbytes if collective == "all_reduce" else (n - 1) * nbytes


# The functions counted, and the ring collective each is. A hook may gather under any of three names:
# all_gather_into_tensor is torch < 2.13's name, deprecated in 2.13, where it no longer goes through
# dist.all_gather_single, so each name is wrapped.
COUNTED = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
           "all_gather": "all_gather"}  # fmt: skip


class WireTap:
    """Counts what this rank hands to collectives while `counting()` is on: the same count for every method.

    The built-in hooks (fp16, PowerSGD, post-local SGD) and PeriodicModelAverager call
    torch.distributed.all_reduce; our own hooks call all_reduce and an all-gather. install() wraps those
    functions (COUNTED), so the hooks we wrote and the hooks we did not are measured by the same code.
    """

    def __init__(self):
        self.active = False
        self.sent = 0.0  # ring bytes sent since the last take()
        self.payload = 0  # bytes of the tensors handed to collectives since the last take()
        self.rounds = 0  # ring rounds since the last take(): each pays the link's latency (alpha) once

    def install(self):
        self._originals = {name: getattr(dist, name) for name in COUNTED}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(COUNTED[name], original))

    def uninstall(self):
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _counted(self, collective, original):
        def call(*args, **kwargs):
            # all_reduce(tensor, op, group, ...); the all-gathers (output, tensor, group, ...): the group comes third
            tensor = args[0] if collective == "all_reduce" else args[1]
            self._add(collective, tensor, kwargs.get("group", args[2] if len(args) > 2 else None))
            return original(*args, **kwargs)

        return call

    def _add(self, collective, tensor, group):
        if self.active:
            nbytes = tensor.numel() * tensor.element_size()
            self.payload += nbytes
            n = dist.get_world_size(group)
            self.sent += ring_bytes(collective, nbytes, n)
            self.rounds += 2 * (n - 1) if collective == "all_reduce" else n - 1

    @contextmanager
    def counting(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def take(self) -> tuple[float, int, int]:
        """(ring bytes sent, payload bytes, ring rounds) since the last call."""
        taken = self.sent, self.payload, self.rounds
        self.sent, self.payload, self.rounds = 0.0, 0, 0
        return taken


def checked(hook, bucket_sizes: dict):
    """Wrap a communication hook: note each bucket's size, and check that the hook's Future holds one tensor
    of exactly that size (DDP silently accepts a larger one and scrambles the gradients)."""

    def wrapper(state, bucket):
        size = bucket.buffer().numel()
        bucket_sizes[bucket.index()] = size

        def check(future):
            value = future.value()
            if not torch.is_tensor(value) or value.numel() != size:
                got = f"a {type(value).__name__}" if not torch.is_tensor(value) else f"{value.numel()} values"
                raise CourseError(f"the communication hook returned {got} for a bucket of {size} gradients")
            return value

        return hook(state, bucket).then(check)

    return wrapper


# --------------------------------------------------------------------------------------------------
# The methods built from scratch: DDP communication hooks and the Local SGD average
# --------------------------------------------------------------------------------------------------


def allreduce_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain DDP as a communication hook: the reference every other method is compared with."""
    # TODO 1: a DDP communication hook. Return at once a Future that DDP waits on later; its result must be one
    #   tensor of the bucket's size: these gradients averaged over the group's ranks.
    # HINT 1: DDP calls the hook while backward is still running. How can a collective start now and finish
    #   later, and how do you attach the work that must happen once it has finished?
    # HINT 2: start an asynchronous all-reduce (a sum) of the bucket's flat tensor on `group`; take the Future of
    #   the work it returns; chain onto it a function that divides the summed tensor by the group's size.
    # HINT 3: dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future() is a Future of a list that
    #   holds the summed buffer: return future.then(lambda fut: fut.value()[0].div_(n)), n = the group's size.
    # BEGIN SOLUTION
    buffer = bucket.buffer()
    n = dist.get_world_size(group)
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0].div_(n))
    # END SOLUTION


class TopKState:
    """Top-k's settings and its error-feedback memory: what this rank did not send yet, one tensor per parameter.

    Kept per parameter, not per bucket: DDP rebuilds its buckets after the first step (in the order the
    gradients became ready), so bucket 0 of step 2 may hold other parameters, in another order, than bucket 0
    of step 1. bucket.parameters() lists a bucket's parameters in the order of their gradients in
    bucket.buffer(); error_of() and keep() translate between that flat layout and the per-parameter memory.
    The memory is training state: a checkpoint that leaves it out resumes with other updates (state_dict()).
    """

    def __init__(self, ratio: float, group=None):
        self.ratio, self.group = ratio, group
        self.errors = {}  # parameter -> what this rank did not send yet of its gradient (error feedback)

    def error_of(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's error feedback as one flat tensor in the layout of bucket.buffer() (zeros at first)."""
        grad = bucket.buffer()
        parts = [self.errors.get(p, torch.zeros_like(p)).reshape(-1) for p in bucket.parameters()]
        return torch.cat(parts).to(grad.dtype) if parts else torch.zeros_like(grad)

    def keep(self, bucket: dist.GradBucket, flat_error: torch.Tensor):
        """Store a flat error (bucket.buffer()'s layout) back per parameter."""
        params = bucket.parameters()
        for p, error in zip(params, flat_error.split([p.numel() for p in params])):
            self.errors[p] = error.view_as(p)

    def state_dict(self, module: torch.nn.Module) -> dict:
        """The error memory by parameter name, for a checkpoint (each rank saves its own: they differ)."""
        return {name: self.errors[p].clone() for name, p in module.named_parameters() if p in self.errors}

    def load_state_dict(self, module: torch.nn.Module, state: dict):
        parameters = dict(module.named_parameters())
        self.errors = {parameters[name]: error.to(parameters[name].device) for name, error in state.items()}


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsification with error feedback: each rank sends its k largest entries (value and index)."""
    grad = bucket.buffer()
    n = dist.get_world_size(state.group)
    k = min(grad.numel(), max(1, math.ceil(state.ratio * grad.numel())))
    # TODO 2: top-k with error feedback. Each rank sends the k largest-magnitude entries of its gradient plus
    #   what it held back, with 32-bit positions, and holds back the rest per parameter. Return a Future of
    #   the ranks' average; a failed collective must raise.
    # HINT 1: the ranks pick different positions, so an all-reduce cannot add their entries up. What must travel
    #   with each sent number, and what does a rank remember of the numbers it did not send?
    # HINT 2: add the bucket's held-back error (state.error_of) to the gradient; take the k entries of largest
    #   magnitude; store the rest, the sent entries zeroed, with state.keep. All-gather every rank's k values
    #   and k int32 positions asynchronously; once both have arrived (and raised if they failed), add every
    #   rank's values at their positions into zeros of the bucket's size and divide by the group's size.
    # HINT 3: corrected = grad + state.error_of(bucket); indices = corrected.abs().topk(k).indices; values =
    #   corrected[indices]; corrected[indices] = 0; state.keep(bucket, corrected); dist.all_gather_single(
    #   all_values, values, group=state.group, async_op=True).get_future() and the same for indices.int(), into
    #   buffers of n x k; return torch.futures.collect_all([...]).then(decode), where decode calls
    #   torch.futures.wait_all(collected.value()), then returns torch.zeros_like(grad).index_add_(0,
    #   all_indices.long(), all_values).div_(n).
    # BEGIN SOLUTION
    corrected = grad + state.error_of(bucket)
    indices = corrected.abs().topk(k, sorted=False).indices
    values = corrected[indices]
    corrected[indices] = 0
    state.keep(bucket, corrected)  # what was not sent goes into the next step's gradient
    all_values = values.new_empty(n * k)
    all_indices = torch.empty(n * k, dtype=torch.int32, device=grad.device)
    futures = [
        dist.all_gather_single(all_values, values, group=state.group, async_op=True).get_future(),
        dist.all_gather_single(all_indices, indices.int(), group=state.group, async_op=True).get_future(),
    ]

    def decode(collected):
        torch.futures.wait_all(collected.value())  # raises if a collective failed
        return torch.zeros_like(grad).index_add_(0, all_indices.long(), all_values).div_(n)

    return torch.futures.collect_all(futures).then(decode)
    # EXERCISE
    # raise NotImplementedError("TODO 2: top-k with error feedback")
    # END SOLUTION


def quantize(x: torch.Tensor, bits: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with x ~ codes x scale: integers in [-L, L], L = 2^(bits-1) - 1, rounded at random so
    that the mean of codes x scale over many draws is x (unbiased). bits = 32: x itself, scale 1."""
    if bits == 32:
        return x.clone(), torch.ones((), dtype=x.dtype, device=x.device)
    levels = 2 ** (bits - 1) - 1
    # TODO 3: stochastic rounding. One number per tensor scales x so that its largest magnitude becomes L; each
    #   entry then becomes one of its two neighbouring integers, drawn from `generator` so that the mean is exact.
    #   Codes: int8 for bits <= 8, else int16.
    # HINT 1: a value 0.3 of the way from one integer to the next: with what probability must it go to the upper
    #   one for its expected value to stay where it was? And what if x is all zeros?
    # HINT 2: scale = max|x| / L (1 if x is all zeros); divide x by it; take the integer below each entry; add 1
    #   where a uniform draw from `generator` falls below the entry's fractional part; clamp to [-L, L] (rounding
    #   can push the largest entry just past L); cast to the code's dtype.
    # HINT 3: top = x.abs().max(); scale = top / levels (or torch.ones((), ...)); scaled = x / scale; low =
    #   scaled.floor(); up = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) < scaled -
    #   low; codes = (low + up).clamp_(-levels, levels).to(torch.int8 if bits <= 8 else torch.int16); return codes,
    #   scale.
    # BEGIN SOLUTION
    top = x.abs().max()
    scale = top / levels if top > 0 else torch.ones((), dtype=x.dtype, device=x.device)
    scaled = x / scale
    low = scaled.floor()
    up = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled - low
    codes = (low + up).clamp_(-levels, levels).to(torch.int8 if bits <= 8 else torch.int16)
    return codes, scale
    # EXERCISE
    # raise NotImplementedError("TODO 3: stochastic rounding")
    # END SOLUTION


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(scale.dtype) * scale


def to_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes as the bytes that go on the wire (uint8: every backend gathers bytes, gloo and NCCL have no
    int16 collectives). 2- and 4-bit codes are packed 4 and 2 to a byte: ceil(N x bits / 8) bytes."""
    if bits not in (2, 4):
        return codes.reshape(-1).view(torch.uint8)  # int8, int16 or float32 codes: their own bytes
    per_byte = 8 // bits
    unsigned = (codes.reshape(-1).to(torch.int32) + 2 ** (bits - 1) - 1).to(torch.uint8)  # [-L, L] -> [0, 2L]
    unsigned = torch.nn.functional.pad(unsigned, (0, -unsigned.numel() % per_byte)).view(-1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (unsigned << shifts).sum(1, dtype=torch.uint8)  # the fields do not overlap: sum = bitwise or


def from_bytes(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """to_bytes undone, row by row: data (rows x bytes, uint8) -> codes (rows x numel)."""
    rows = data.shape[0]
    if bits not in (2, 4):
        dtype = {8: torch.int8, 16: torch.int16, 32: torch.float32}[bits]
        return data.view(dtype).view(rows, numel)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
    unsigned = (data.unsqueeze(-1) >> shifts) & (2**bits - 1)  # rows x bytes x codes per byte
    return unsigned.view(rows, -1)[:, :numel].to(torch.int8) - (2 ** (bits - 1) - 1)


class QuantizeState:
    def __init__(self, bits: int, seed: int, device, group=None):
        self.bits, self.group = bits, group
        self.generator = torch.Generator(device=device).manual_seed(seed)  # each rank its own draws


def quantize_hook(state: QuantizeState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Each rank sends its gradients as a few bits per entry plus one scale; every rank decodes them all."""
    grad = bucket.buffer()
    n = dist.get_world_size(state.group)
    # TODO 4: exchange quantized gradients. Every rank sends its bucket quantized (TODO 3) as packed bytes, with
    #   its scaling number; return a Future of the mean of every rank's decoded gradients. Different scales cannot
    #   be summed on the way; a failed collective must raise.
    # HINT 1: each rank's codes mean something only with its own scale. So can an all-reduce add them up? What
    #   must every rank receive from every other, and how does it turn that back into gradients?
    # HINT 2: quantize the bucket and pack the codes into bytes (to_bytes); all-gather the bytes (n x their size)
    #   and the scales (n values) asynchronously; once both have arrived (raising if either failed), unpack n rows
    #   of codes (from_bytes), dequantize row r with rank r's scale, sum the rows, divide by n.
    # HINT 3: codes, scale = quantize(grad, state.bits, state.generator); data = to_bytes(codes, state.bits); two
    #   dist.all_gather_single(..., async_op=True).get_future() (data into n x data.numel(), scale.reshape(1) into
    #   n); torch.futures.collect_all([...]).then(decode); decode: torch.futures.wait_all(collected.value()), then
    #   dequantize(from_bytes(all_data.view(n, -1), bits, grad.numel()), all_scales.view(n, 1)).sum(0).div_(n).
    # BEGIN SOLUTION
    codes, scale = quantize(grad, state.bits, state.generator)
    data = to_bytes(codes, state.bits)
    all_data = data.new_empty(n * data.numel())
    all_scales = scale.new_empty(n)
    futures = [
        dist.all_gather_single(all_data, data, group=state.group, async_op=True).get_future(),
        dist.all_gather_single(all_scales, scale.reshape(1), group=state.group, async_op=True).get_future(),
    ]

    def decode(collected):
        torch.futures.wait_all(collected.value())  # raises the collectives' errors
        all_codes = from_bytes(all_data.view(n, -1), state.bits, grad.numel())
        return dequantize(all_codes, all_scales.view(n, 1)).sum(0).div_(n)

    return torch.futures.collect_all(futures).then(decode)
    # EXERCISE
    # raise NotImplementedError("TODO 4: exchange quantized gradients")
    # END SOLUTION


def local_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Local SGD between averages: no communication, each rank keeps its own gradient."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def average_parameters(module: torch.nn.Module, group=None):
    """Local SGD's synchronisation: replace every rank's parameters with their mean over the ranks."""
    # TODO 5: average the parameters. Afterwards every rank holds the mean over the group of the ranks' parameters,
    #   exchanged in one collective rather than one per tensor, and written in place outside autograd.
    # HINT 1: one collective for all the tensors needs them side by side in one tensor. Which utilities flatten a
    #   list of tensors into one and copy it back? And why must autograd not record the write?
    # HINT 2: under torch.no_grad(): flatten the parameters into one vector; all-reduce it on `group` (a sum);
    #   divide by the group's size; copy the vector back into the parameters.
    # HINT 3: flat = parameters_to_vector(params); dist.all_reduce(flat, group=group);
    #   vector_to_parameters(flat.div_(dist.get_world_size(group)), params).
    # BEGIN SOLUTION
    with torch.no_grad():
        params = list(module.parameters())
        flat = parameters_to_vector(params)
        dist.all_reduce(flat, group=group)
        vector_to_parameters(flat.div_(dist.get_world_size(group)), params)
    # EXERCISE
    # raise NotImplementedError("TODO 5: average the parameters")
    # END SOLUTION


def bf16_hook(group, bucket):
    """default_hooks.bf16_compress_hook under another name: DDP refuses that name without CUDA and NCCL,
    though gloo all-reduces bfloat16 well."""
    return default_hooks.bf16_compress_hook(group, bucket)


def register_method(model: DistributedDataParallel, args, device, rank: int, bucket_sizes: dict):
    """Give the DDP model the method's communication hook; return post-local SGD's averager (else None)."""
    hook, state, averager = None, None, None
    if args.method in ("none", "localsgd"):
        hook = allreduce_hook if args.method == "none" else local_hook
    elif args.method == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif args.method == "bf16":
        hook = bf16_hook
    elif args.method == "topk":
        hook, state = topk_hook, TopKState(args.topk_ratio)
    elif args.method == "quantize":
        hook, state = quantize_hook, QuantizeState(args.bits, seed=args.seed * 1000 + rank, device=device)
    elif args.method == "powersgd":
        hook = powerSGD_hook.powerSGD_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.compress_start,  # full all-reduce first: DDP settles its buckets
            use_error_feedback=True,
            warm_start=True,
            random_seed=args.seed,
        )
    elif args.method == "postlocal":
        # Gradients are all-reduced within groups of --local-group-size ranks (a node: a fast link) at every
        # step; the parameters are averaged over all ranks every --local-steps steps. (subgroup=None would
        # make one group per node from the GPUs per node, which needs CUDA.)
        subgroup, _ = dist.new_subgroups(group_size=args.local_group_size)
        hook = post_localSGD_hook.post_localSGD_hook
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=subgroup, start_localSGD_iter=args.compress_start
        )
        averager = PeriodicModelAverager(period=args.local_steps, warmup_steps=args.compress_start)
    model.register_comm_hook(state, checked(hook, bucket_sizes))
    return averager


def main():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, default="none", help="how gradients (or models) are averaged")
    parser.add_argument("--topk-ratio", type=float, default=0.01, help="topk: fraction of entries each rank sends")
    parser.add_argument(
        "--bits", type=int, choices=BITS, default=8, help="quantize: bits per entry on the wire (32: no rounding)"
    )
    parser.add_argument("--powersgd-rank", type=positive_int, default=1, help="powersgd: rank of the approximation")
    parser.add_argument("--local-steps", type=positive_int, default=4, help="localsgd/postlocal: steps per average")
    parser.add_argument(
        "--compress-start", type=positive_int, default=2, help="powersgd/postlocal: full all-reduce steps first"
    )
    parser.add_argument(
        "--local-group-size", type=positive_int, default=None, help="postlocal: ranks per gradient group (a node)"
    )
    args = parse_args(parser)
    if not 0 < args.topk_ratio <= 1:
        parser.error(f"argument --topk-ratio: must be in (0, 1], got {args.topk_ratio}; e.g. 0.01 sends 1%")
    if args.method == "powersgd" and args.compress_start < 2:
        parser.error("argument --compress-start: PowerSGD with error feedback needs at least 2; use 2")
    local_rank, rank, device, world_size = setup(args.seed)
    if args.local_group_size is None:
        args.local_group_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if args.method == "postlocal" and world_size % args.local_group_size:
        raise Refusal(
            f"--local-group-size {args.local_group_size} does not divide the {world_size} ranks into equal groups; "
            f"choose a divisor of {world_size} (the ranks per node)"
        )
    print0(f"global batch {args.batch_size * world_size} sequences = {args.batch_size} per rank x {world_size} ranks")

    # Data: as in lesson 02, every rank reads its own slice of each global batch.
    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args, world_size)
    sampler = DistributedSampler(
        train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    device_ids = [device] if device.type == "cuda" else None
    model = DistributedDataParallel(model, device_ids=device_ids)
    bucket_sizes = {}  # bucket index -> gradients in it, as the hook saw them
    averager = register_method(model, args, device, rank, bucket_sizes)
    optimizer = build_optimizer(model.parameters(), args)
    wire = WireTap()
    wire.install()
    print0(
        f"{args.dataset}: {len(loader)} batches per rank per epoch | model: {count_parameters(config):,} parameters"
        f" | {args.optimizer} | --method {args.method} | device {device.type}"
    )

    logger = Logger(args, total_steps=args.steps)
    throughput = Throughput(device)
    losses, sent, payload, rounds, spread = [], [], [], [], []
    checksums = torch.zeros(world_size, dtype=torch.float64, device=device)
    batch_iterator = batches(loader, sampler)  # endless, reshuffled every epoch (set_epoch)
    for step in range(1, args.steps + 1):
        inputs, targets = next(batch_iterator)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        with wire.counting():  # the gradients' communication happens inside backward, in the hook
            with autocast(args, device):  # bf16 forward with --autocast bf16; the gradients stay float32
                loss = loss_fn(model(inputs), targets)
            loss.backward()
        optimizer.step()
        with wire.counting():  # the methods that average models do it after the optimizer step
            if args.method == "localsgd" and step % args.local_steps == 0:
                average_parameters(model.module)
            if averager is not None:
                averager.average_parameters(model.parameters())
        bytes_sent, bytes_payload, ring_rounds = wire.take()
        sent.append(bytes_sent)
        payload.append(bytes_payload)
        rounds.append(ring_rounds)

        # Not counted (not part of training): the loss for logging, and how far the ranks' models drifted apart.
        mine = torch.tensor([param_checksum(model.module)], dtype=torch.float64, device=device)
        dist.all_gather_single(checksums, mine)
        spread.append(float(checksums.max() - checksums.min()))
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        throughput.step(inputs.numel() * world_size)
        logger.log(step, loss=losses[-1], bytes_sent=bytes_sent, tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}  sent {bytes_sent:12,.0f} bytes")
    logger.close()
    wire.uninstall()

    tokens_per_s = throughput.tokens_per_s
    per_step = sum(sent) / len(sent)
    print0(f"throughput: {tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    print0(f"--method {args.method}: sent {per_step:,.0f} bytes per step on average (ring model, per rank)")
    if args.checkpoint:
        state = {"model": model.module.state_dict(), "config": vars(config)}
        save0(state, args.checkpoint)
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=tokens_per_s,
        param_checksum=param_checksum(model.module),
        bytes_per_rank=state_bytes(model, optimizer),
        optimizer=args.optimizer,
        dataset=args.dataset,
        method=args.method,
        topk_ratio=args.topk_ratio,
        bits=args.bits,
        powersgd_rank=args.powersgd_rank,
        local_steps=args.local_steps,
        compress_start=args.compress_start,
        local_group_size=args.local_group_size,
        bucket_sizes=[bucket_sizes[i] for i in sorted(bucket_sizes)],
        bytes_sent=sent,
        payload_bytes=payload,
        ring_rounds=rounds,
        bytes_sent_per_step=per_step,
        rank_spread=spread,
    )
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    del model, optimizer, averager  # before the process group goes (lesson 02: gloo's teardown)
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: ranks that drift apart (TODO 6; the notebook's last section, `make check LESSON=07`)
# --------------------------------------------------------------------------------------------------


def random_k_positions(numel: int, k: int, seed: int, step: int, rank: int) -> torch.Tensor:
    """Random-k sparsification's choice at `step`: which k of a gradient's `numel` entries this rank (`rank`)
    sends. No positions go on the wire: utils/lesson_07/lab.py all-reduces the k values at these positions,
    averages them and writes them back there, on live ranks."""
    # TODO 6: lab, ranks that drift apart. With the exercise's code every rank trains without an error, yet after
    #   the first step the ranks' parameters differ. Fix it so that every rank keeps the same model, sending k
    #   distinct entries that change from step to step.
    # HINT 1: An all-reduce adds up the i-th value of every rank. Which entry of its gradient did each rank put at
    #   place i, and what decided that?
    # HINT 2: The positions must be the same on every rank and new at every step: draw them from a generator
    #   seeded from what all ranks share (the seed and the step), never from the rank (or the global generator).
    # HINT 3: generator = torch.Generator().manual_seed(seed * 1_000_003 + step); return
    #   torch.randperm(numel, generator=generator)[:k].
    # BEGIN SOLUTION
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)  # every rank draws the same positions
    return torch.randperm(numel, generator=generator)[:k]
    # EXERCISE
    # generator = torch.Generator().manual_seed(seed * 1000 + rank + step)  # seeded as QuantizeState seeds its own
    # return torch.randperm(numel, generator=generator)[:k]
    # END SOLUTION


if __name__ == "__main__":
    run_main(main)
