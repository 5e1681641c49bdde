"""Lesson 09's command line beyond the shared one, and the checks that refuse what cannot run, in one line each,
before any rank waits for another."""

import torch

from utils.distributed_utils import Refusal

IMPLS = ("ring", "ulysses", "builtin")
CPU_REFUSAL = (
    "--impl builtin needs GPUs: torch's context_parallel replaces only the CUDA attention kernels (flash, "
    "efficient, cuDNN); on a CPU, F.scaled_dot_product_attention runs its own flash kernel, "
    "aten._scaled_dot_product_flash_attention_for_cpu, which context_parallel does not handle "
    "(NotImplementedError); use --impl ring or --impl ulysses"
)


def add_options(parser):
    parser.add_argument(
        "--impl", choices=IMPLS, default="ring",
        help="ring attention or Ulysses from scratch, or torch's context_parallel (GPUs only)",
    )  # fmt: skip
    parser.add_argument(
        "--cp-split", choices=("contiguous", "zigzag"), default="zigzag",
        help="how each sequence is cut over the ranks (zigzag evens the causal work of the ring)",
    )  # fmt: skip


def check_context_split(seq_len: int, world_size: int, split: str):
    """Refuse a sequence that does not cut into equal chunks."""
    pieces = world_size if split == "contiguous" else 2 * world_size
    if seq_len % pieces:
        fix = seq_len + pieces - seq_len % pieces
        per_rank = "1 chunk" if split == "contiguous" else "2 chunks"
        raise Refusal(
            f"--seq-len {seq_len} does not cut into {pieces} equal chunks (--cp-split {split}: {per_rank} per rank, "
            f"{world_size} ranks): use --seq-len {fix} (a multiple of {pieces}), or another number of ranks"
        )


def check_heads(n_heads: int, world_size: int):
    """Ulysses gives each rank H/N whole heads: refuse heads that do not split over the ranks."""
    if n_heads % world_size:
        raise Refusal(
            f"--impl ulysses gives each rank whole heads: --n-heads {n_heads} does not split over {world_size} "
            f"ranks; use --n-heads a multiple of {world_size} (and a --dim it divides), or --impl ring"
        )


def check_run(args, world_size: int, device: torch.device):
    if args.impl == "builtin" and device.type != "cuda":
        raise Refusal(CPU_REFUSAL)
    check_context_split(args.seq_len, world_size, args.cp_split)
    if args.impl == "ulysses":
        check_heads(args.n_heads, world_size)


# The reason CPU_REFUSAL gives, tried on this machine's torch: context_parallel on a world of one on the CPU.
CPU_ATTEMPT = """
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
q = torch.randn(1, 2, 8, 4)
try:
    with context_parallel(init_device_mesh("cpu", (1,)), buffers=[torch.arange(8)[None]], buffer_seq_dims=[1]):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    print("context_parallel ran on the CPU")
except NotImplementedError as error:
    print(f"NotImplementedError: {error}")
dist.destroy_process_group()
"""


def context_parallel_on_cpu() -> str:
    """What context_parallel does on this CPU, in a fresh process (it needs a process group): its last line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CPU_ATTEMPT], capture_output=True, text=True, timeout=120)
    return (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-1]
