"""Lesson 10's own command line, and the checks that refuse what cannot run, each in one line."""

import argparse

from utils.distributed_utils import Refusal
from utils.training import base_parser, non_negative_float, parse_args, positive_int

DEFAULT_CAPACITY_FACTOR = 1.25  # one of Switch's training values (GShard's top-2 capacity 2S/E is 1.0 here)


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_expert_options(parser):
    """--experts, --top-k, --dispatch, --capacity-factor, --aux-loss-weight, --impl."""
    parser.add_argument("--experts", type=positive_int, default=4, help="experts per MoE layer (divisible by ranks)")
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token")
    parser.add_argument(
        "--dispatch", choices=("dropless", "padded"), default="dropless",
        help="dropless: every choice travels, uneven splits; padded: fixed buffers of `capacity` rows per expert",
    )  # fmt: skip
    parser.add_argument(
        "--capacity-factor", type=positive_float, default=None,
        help=f"--dispatch padded only: capacity = ceil(C x T x k / E) per rank (default {DEFAULT_CAPACITY_FACTOR})",
    )  # fmt: skip
    parser.add_argument("--aux-loss-weight", type=non_negative_float, default=0.01, help="load-balancing loss weight")
    parser.add_argument(
        "--impl", choices=("scratch", "builtin"), default="scratch",
        help="the all-to-all's autograd: written here (scratch) or torch.distributed.nn.functional's (builtin)",
    )  # fmt: skip


def check_options(parser, args):
    """After parsing: a capacity factor means nothing to dropless dispatch (it keeps every choice): refused."""
    if args.capacity_factor is not None and args.dispatch == "dropless":
        parser.error(
            "argument --capacity-factor: only with --dispatch padded (dropless keeps every choice, it has no capacity)"
        )
    if args.dispatch == "padded" and args.capacity_factor is None:
        args.capacity_factor = DEFAULT_CAPACITY_FACTOR


def check_experts(args, world_size: int):
    """Refuse what cannot run, with one line, before any collective."""
    if args.experts % world_size:
        divisors = [str(n) for n in range(1, args.experts + 1) if args.experts % n == 0]
        fits = " or ".join([", ".join(divisors[:-1]), divisors[-1]] if len(divisors) > 1 else divisors)
        raise Refusal(
            f"--experts {args.experts} does not split evenly over {world_size} ranks: use a multiple of {world_size} "
            f"experts, or launch {fits} processes"
        )
    if args.top_k > args.experts:
        raise Refusal(f"--top-k {args.top_k} is more than --experts {args.experts}: choose at most {args.experts}")


def script_options(argv: list) -> argparse.Namespace:
    """The options the lesson script runs with, given its command line (values of any type): parsed, completed
    with its defaults and checked as the script does. What the one-process reference needs to train the same model
    on the same batches as a run (utils/lesson_10/reference.py's train_reference)."""
    parser = base_parser("lesson 10: mixture of experts", without=("--autocast",))
    add_expert_options(parser)
    args = parse_args(parser, [str(value) for value in argv])
    check_options(parser, args)
    return args
