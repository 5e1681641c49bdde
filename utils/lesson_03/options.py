"""Lesson 03's command line: the course's shared options plus the lesson's own, each validated once, so that
a wrong value ends at once with one line naming the option and the fix (utils/training.py's convention)."""

import argparse
import os
from pathlib import Path

import torch

from utils.distributed_utils import Refusal
from utils.training import base_parser, non_negative_float, positive_int


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def lesson_parser(description: str, strategies: list[str]) -> argparse.ArgumentParser:
    # --precision bf16 is this lesson's mixed precision (FSDP2's policy, Zero3's compute dtype, autocast for the
    # others): the shared --autocast is refused rather than ignored.
    parser = base_parser(description, without=("--autocast",))
    parser.add_argument("--strategy", choices=[*strategies, "all"], default="fsdp", help="all: each in turn")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    parser.add_argument("--replicas", type=positive_int, default=None, help="HSDP: replica groups (default: nodes)")
    parser.add_argument(
        "--reshard-after-forward",
        dest="reshard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="free gathered parameters after forward (gather again in backward)",
    )
    parser.add_argument(
        "--bucket-cap-mb", type=positive_float, default=25.0, help="ZeRO-2: gradients reduce-scattered per bucket"
    )
    parser.add_argument("--momentum", type=non_negative_float, default=0.0, help="SGD momentum (state to shard)")
    parser.add_argument("--save-dcp", type=Path, default=None, help="save a sharded (DCP) checkpoint folder")
    parser.add_argument("--resume", type=Path, default=None, help="a --save-dcp folder or a --checkpoint file")
    return parser


def settle(args, world_size: int, device: torch.device):
    """The options that depend on the job (HSDP's replicas: one per node), and the combinations refused."""
    if args.replicas is None:
        nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        args.replicas = nodes if nodes > 1 else (2 if world_size % 2 == 0 else 1)
    if args.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise Refusal("this GPU has no bf16: use --precision fp32")
    if args.strategy == "all" and (args.resume or args.save_dcp):
        raise Refusal("--resume and --save-dcp take one strategy: pass --strategy fsdp (or ddp, hsdp)")
    if (args.resume or args.save_dcp) and args.strategy not in ("ddp", "fsdp", "hsdp"):
        raise Refusal("--resume and --save-dcp work with the built-in strategies: ddp, fsdp or hsdp")
