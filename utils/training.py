"""The plumbing every training script shares: command line, optimizer, logging, throughput.

The training loop itself stays in each lesson's script, where the lesson changes it; this file holds
what does not change from one lesson to the next.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from utils import monitor
from utils.data import DATASETS
from utils.distributed_utils import Refusal, is_dtensor, is_root_process
from utils.model import TINY, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# The command line: parsed and checked once, before any process group or data exists
# --------------------------------------------------------------------------------------------------


class CourseArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the option, what is wrong, a valid value) and exit code 2.

    No abbreviations: a shared option a script leaves out (e.g. --checkpoint in lesson 08) must be refused, not
    taken as the prefix of another option (--checkpoint-dir).

    Every course script has --watch (see utils/monitor.py), whether or not it builds on base_parser. Not
    "--monitor": torchrun's own parser reads that as an ambiguous prefix of its --monitor-interval and stops.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--watch", type=positive_float, nargs="?", const=1.0, default=None, metavar="SECONDS",
            help="record how busy each device and process is, every SECONDS (default 1); "
            "`python -m utils.monitor report` reads it",
        )  # fmt: skip

    def error(self, message: str):
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a size or a count of steps, ranks, micro-batches)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (an interval in seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0 (a learning rate, a ratio)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def base_parser(description: str, without: tuple[str, ...] = ()) -> CourseArgumentParser:
    """The command line every training script accepts; a lesson adds its own options, then calls parse_args.

    `without` names shared options this script does not honour (e.g. ("--autocast",)): they are left out, so
    passing one is refused with argparse's one line instead of being accepted and ignored.
    """
    script = Path(sys.argv[0]).stem
    parser = CourseArgumentParser(description=description)
    unknown = set(without) - set(SHARED_OPTIONS)
    if unknown:
        raise ValueError(f"base_parser(without=...): no shared option {sorted(unknown)}")
    add = parser.add_argument
    parser.add_argument = lambda name, *a, **k: None if name in without else add(name, *a, **k)
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step on each rank")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw", help="parity checks use sgd")
    parser.add_argument(
        "--lr", type=non_negative_float, default=None, help="learning rate (default: 0.2 for sgd, 3e-3 for adamw)"
    )
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic", help="synthetic needs no download")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="prepared data sets (default: $COURSE_DATA or data/)"
    )
    parser.add_argument("--seq-len", type=positive_int, default=TINY.seq_len, help="tokens per sequence")
    parser.add_argument("--dim", type=positive_int, default=TINY.dim, help="model width")
    parser.add_argument("--n-layers", type=positive_int, default=TINY.n_layers, help="transformer blocks")
    parser.add_argument("--n-heads", type=positive_int, default=TINY.n_heads, help="attention heads")
    parser.add_argument("--metrics-out", type=Path, default=None, help="write the run's metrics here (JSON)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "runs" / script, help="tensorboard event files")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print the loss every N steps")
    parser.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (offline by default)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save the trained model and optimizer here")
    parser.add_argument(
        "--autocast", choices=["off", "bf16"], default="off", help="bf16 mixed precision for forward (GPU runs)"
    )
    parser.add_argument = add
    return parser


# Options every course parser has (CourseArgumentParser adds them), lesson 01's own parser too.
EVERY_SCRIPT_OPTIONS = ("--watch",)

SHARED_OPTIONS = (
    "--steps", "--seed", "--batch-size", "--optimizer", "--lr", "--dataset", "--data-dir", "--seq-len", "--dim",
    "--n-layers", "--n-heads", "--metrics-out", "--log-dir", "--log-every", "--wandb", "--checkpoint", "--autocast",
)  # fmt: skip


def autocast(args, device: torch.device):
    """The forward pass's precision context: bf16 autocast with --autocast bf16 (weights and gradients stay fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=getattr(args, "autocast", "off") == "bf16")


# Options that name a file the script writes, and options that name a folder it writes into.
OUTPUT_FILES = ("metrics_out", "checkpoint")
OUTPUT_FOLDERS = ("log_dir",)


def _unwritable(path: Path, folder: bool) -> str | None:
    """Why the script could not create `path` (a file, or a folder when `folder`), or None if it can."""
    path = path.expanduser().resolve()
    if folder and path.exists() and not path.is_dir():
        return f"{path} exists and is not a folder"
    if not folder and path.is_dir():
        return f"{path} is a folder, not a file"
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():  # the folders that do not exist yet are created by the script
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:  # try it: permissions, read-only and special file systems (/proc) all show up here, even for root
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        return f"{existing} is not writable ({error.strerror})"
    return None


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse and check the command line once, for every lesson: each mistake ends the script at once with
    one line naming the option and a valid value, before any process waits for another."""
    args = parser.parse_args(argv)
    if hasattr(args, "dim") and hasattr(args, "n_heads") and args.dim % args.n_heads:
        divisors = [h for h in range(1, args.dim + 1) if args.dim % h == 0][:8]
        parser.error(
            f"argument --n-heads: --dim {args.dim} must split into --n-heads {args.n_heads} equal heads; "
            f"choose --n-heads from {', '.join(map(str, divisors))}, ... (or another --dim)"
        )
    for name in OUTPUT_FILES + OUTPUT_FOLDERS:
        path = getattr(args, name, None)
        problem = path is not None and _unwritable(Path(path), folder=name in OUTPUT_FOLDERS)
        if problem:
            option = "--" + name.replace("_", "-")
            parser.error(f"argument {option}: cannot write {path}: {problem}; choose a location you can write to")
    if getattr(args, "watch", None):  # setup() starts the sampler once it knows the rank
        monitor.request(args.watch, monitor_folder(args))
    return args


def monitor_folder(args) -> Path:
    """Where --watch writes each rank's samples: <--log-dir>/monitor ($COURSE_MONITOR_DIR wins, as in sbatch)."""
    log_dir = getattr(args, "log_dir", None) or ROOT / "runs" / Path(sys.argv[0]).stem
    return Path(log_dir) / "monitor"


def check_batches(n_samples: int, args, world_size: int = 1, per_step: int = 1, what: str = "rank"):
    """Refuse a run in which some rank would get no full batch in an epoch (its data loop would never yield).

    n_samples: blocks in the data set; each of `world_size` ranks gets n_samples // world_size of them
    and needs per_step batches of --batch-size (e.g. --grad-accum micro-batches) for one optimizer step.
    """
    share = n_samples // world_size
    needed = args.batch_size * per_step
    if share < needed:
        largest = max(share // per_step, 0)
        fix = f"use --batch-size {largest} or less" if largest else "use fewer ranks"
        raise Refusal(
            f"--batch-size {args.batch_size} is too large: {args.dataset} has {n_samples} blocks of "
            f"{args.seq_len + 1} tokens, {share} per {what} over {world_size}, and one step needs {needed}; "
            f"{fix}, or a shorter --seq-len"
        )


def batches(loader, sampler=None):
    """Endless batches, as lesson 00 loops and lesson 02 reshuffles: another pass over the data whenever one ends,
    each in a new order when a DistributedSampler is given (set_epoch: it draws its order from seed + epoch)."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def model_config(args) -> ModelConfig:
    return ModelConfig(seq_len=args.seq_len, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)


DEFAULT_LR = {"sgd": 0.2, "adamw": 3e-3}  # tuned on the tiny model and the generated corpus


def build_optimizer(params, args) -> torch.optim.Optimizer:
    """Plain SGD (what parity checks compare: every rank's update is exactly reproducible) or AdamW."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """DTensor parameters and plain ones in separate groups (for build_optimizer): a multi-tensor (foreach)
    optimizer step, the default on GPUs, cannot mix the two kinds in one call."""
    dtensors = [p for p in model.parameters() if is_dtensor(p)]
    plain = [p for p in model.parameters() if not is_dtensor(p)]
    return [{"params": group} for group in (dtensors, plain) if group]


class Logger:
    """Scalars to tensorboard (and wandb with --wandb) plus a progress bar, on rank 0 only.

    Other ranks get a logger that does nothing, so the training loop calls it unconditionally.
    tensorboard writes event files under --log-dir (`tensorboard --logdir runs`); wandb runs offline
    unless WANDB_MODE says otherwise (compute nodes have no internet): `wandb sync` uploads them later.
    The progress bar shows only in a terminal (not in job logs or notebooks) and never with COURSE_NO_PROGRESS=1.
    """

    def __init__(self, args, total_steps: int):
        self.active = is_root_process()
        self.writer = self.wandb_run = self.progress = None
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.writer = SummaryWriter(log_dir=str(args.log_dir))
        if args.wandb:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self.wandb_run = wandb.init(
                project="distributed-training-course",
                name=Path(sys.argv[0]).stem,
                config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                dir=str(args.log_dir),
            )
        no_progress = os.environ.get("COURSE_NO_PROGRESS", "") not in ("", "0")
        self.progress = tqdm(total=total_steps, disable=True if no_progress else None, dynamic_ncols=True)

    def log(self, step: int, **scalars: float):
        if not self.active:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        self.progress.set_postfix({k: f"{v:.4g}" for k, v in scalars.items()}, refresh=False)
        self.progress.update(1)

    def close(self):
        if not self.active:
            return
        self.progress.close()
        self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class Throughput:
    """Tokens per second, timed from the end of step `warmup` (the first steps pay for one-off start-up work).

    Pass the tokens the whole job trained on in a step (all ranks together) for the job's throughput.
    """

    def __init__(self, device: torch.device, warmup: int = 1):
        self.device, self.warmup = device, warmup
        self.steps = self.tokens = 0
        self.start = self.end = self._now() if warmup == 0 else None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: wait for it before reading the clock
        return time.perf_counter()

    def step(self, tokens: int):
        """Call once after each optimizer step with the tokens that step trained on."""
        self.steps += 1
        if self.steps < self.warmup:
            return
        if self.steps == self.warmup:
            self.start = self._now()
            return
        self.tokens += tokens
        self.end = self._now()

    @property
    def tokens_per_s(self) -> float:
        """0.0 until a step after the warm-up has finished."""
        if not self.tokens:
            return 0.0
        return self.tokens / (self.end - self.start)
