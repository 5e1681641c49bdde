"""The plumbing every training script shares: command line, optimizer, logging, throughput.

The training loop itself stays in each lesson's script, where the lesson changes it; this file holds
what does not change from one lesson to the next.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from utils.data import DATASETS
from utils.distributed_utils import is_root_process
from utils.model import TINY, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def base_parser(description: str) -> argparse.ArgumentParser:
    """The command line every training script accepts; a lesson adds its own options to it."""
    script = Path(sys.argv[0]).stem
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step on each rank")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw", help="parity checks use sgd")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.2 for sgd, 3e-3 for adamw)")
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic", help="synthetic needs no download")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="prepared data sets (default: $COURSE_DATA or data/)"
    )
    parser.add_argument("--seq-len", type=int, default=TINY.seq_len, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=TINY.dim, help="model width")
    parser.add_argument("--n-layers", type=int, default=TINY.n_layers, help="transformer blocks")
    parser.add_argument("--n-heads", type=int, default=TINY.n_heads, help="attention heads")
    parser.add_argument("--metrics-out", type=Path, default=None, help="write the run's metrics here (JSON)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "runs" / script, help="tensorboard event files")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (offline by default)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save the trained model and optimizer here")
    return parser


def model_config(args) -> ModelConfig:
    return ModelConfig(seq_len=args.seq_len, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)


DEFAULT_LR = {"sgd": 0.2, "adamw": 3e-3}  # tuned on the tiny model and the generated corpus


def build_optimizer(params, args) -> torch.optim.Optimizer:
    """Plain SGD (what parity checks compare: every rank's update is exactly reproducible) or AdamW."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


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
