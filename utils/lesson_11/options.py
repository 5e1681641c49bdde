"""Lesson 11's own command line, and the checks that refuse what cannot run, each in one line."""

from pathlib import Path

from utils.training import non_negative_float, positive_int

STRATEGIES = ("ddp", "fsdp", "tp", "pp")
# DDP's bucket size. Passed explicitly, as here, it sizes the first bucket too, which DDP keeps at 1 MiB when
# bucket_cap_mb is not given: the script's default DDP may have one bucket fewer than DDP's own default.
DEFAULT_BUCKET_CAP_MB = 25.0
PROFILED_STEPS = 2  # steps recorded in the trace, after one skipped and one warm-up step
SPEED_UPS = ("--autocast", "--optimizer-impl", "--checkpointing", "--compile")


def add_options(parser):
    """--strategy and its settings, the speed-ups, --profile."""
    add = parser.add_argument
    add("--strategy", choices=STRATEGIES, default="ddp", help="how the model is split over the ranks")
    add(
        "--ddp-overlap",
        choices=("on", "off"),
        default=None,
        help="ddp: on = DDP's buckets all-reduce during backward; off = one all-reduce after backward (default on)",
    )
    add(
        "--bucket-cap-mb",
        type=non_negative_float,
        default=None,
        help=f"ddp with overlap: the size of DDP's gradient buckets (default {DEFAULT_BUCKET_CAP_MB:g})",
    )
    add(
        "--prefetch",
        choices=("default", "explicit"),
        default=None,
        help="fsdp: explicit = each block all-gathers the next one's parameters ahead (default: FSDP2's own)",
    )
    add(
        "--reshard-after-forward",
        choices=("on", "off"),
        default=None,
        help="fsdp: free each block's gathered parameters after forward, gather them again in backward (default on)",
    )
    add("--microbatches", type=positive_int, default=None, help="pp: micro-batches per step, GPipe (default 4)")
    add(
        "--optimizer-impl",
        choices=("for-loop", "foreach", "fused"),
        default="for-loop",
        help="one kernel per parameter (for-loop), per operation over all parameters (foreach), or one (fused)",
    )
    add(
        "--checkpointing",
        choices=("none", "full", "selective"),
        default="none",
        help="activation checkpointing of every block: recompute all of it, or what the policy does not save",
    )
    add("--compile", action="store_true", help="torch.compile every block (inductor)")
    add(
        "--profile",
        type=Path,
        default=None,
        help=f"write one Chrome/Perfetto trace per rank into this folder ({PROFILED_STEPS} steps, after 2 if any)",
    )


APPLIES_TO = {  # option -> the strategies it means something to
    "ddp_overlap": ("ddp",), "bucket_cap_mb": ("ddp",), "prefetch": ("fsdp",), "reshard_after_forward": ("fsdp",),
    "microbatches": ("pp",),
}  # fmt: skip
DEFAULTS = {"ddp_overlap": "on", "bucket_cap_mb": DEFAULT_BUCKET_CAP_MB, "prefetch": "default",
            "reshard_after_forward": "on", "microbatches": 4}  # fmt: skip


def check_options(parser, args):
    """Refuse an option that the strategy would ignore, and what cannot run; then fill in the defaults."""
    given = {name for name in APPLIES_TO if getattr(args, name) is not None}
    for name, strategies in APPLIES_TO.items():
        option = "--" + name.replace("_", "-")
        if getattr(args, name) is not None and args.strategy not in strategies:
            parser.error(f"argument {option}: only with --strategy {' or '.join(strategies)}")
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[name])
    if "bucket_cap_mb" in given and args.ddp_overlap == "off":
        parser.error("argument --bucket-cap-mb: only with --ddp-overlap on (off sends one buffer after backward)")
    speed_ups = {"--autocast": args.autocast != "off", "--checkpointing": args.checkpointing != "none",
                 "--compile": args.compile}  # fmt: skip
    for option, given in speed_ups.items():
        if given and args.strategy in ("tp", "pp"):
            parser.error(f"argument {option}: only with --strategy ddp or fsdp (tp and pp run as lessons 04 and 05)")
    if args.optimizer_impl == "fused" and args.optimizer == "sgd" and args.strategy != "ddp":
        parser.error("argument --optimizer-impl: fused SGD has no DTensor version: use it with --strategy ddp, or "
                     "--optimizer adamw")  # fmt: skip
    if args.strategy == "pp" and args.batch_size % args.microbatches:
        parser.error(
            f"argument --microbatches: --batch-size {args.batch_size} must split into {args.microbatches} equal "
            "micro-batches; choose a divisor of it"
        )
    if args.profile is not None and args.profile.exists() and not args.profile.is_dir():
        parser.error(f"argument --profile: {args.profile} exists and is not a folder; name a folder")
