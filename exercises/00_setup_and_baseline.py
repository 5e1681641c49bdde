# Exercise for lesson 00: complete the numbered TODOs. (This file is generated from
# solutions/00_setup_and_baseline.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 00: the single-device baseline that every later lesson parallelises.

A small Transformer language model learns a byte-level corpus on one device: load the data through
`datasets`, build the model from a seed, run forward / loss / backward / step, and log the loss
(tensorboard, optionally wandb, a progress bar) and the throughput in tokens per second.
Lesson 02 is this script plus data parallelism, so keep the two side by side.

    python exercises/00_setup_and_baseline.py                     # the generated corpus, no download
    python exercises/00_setup_and_baseline.py --dataset wikitext  # after `python -m utils.data prepare`
    torchrun --nproc_per_node=1 exercises/00_setup_and_baseline.py --steps 50 --metrics-out m.json
    tensorboard --logdir runs                                     # the loss curves
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader

from utils.data import load_token_dataset
from utils.distributed_utils import Refusal, destroy_process_group, print0, run_main, save0, setup
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    autocast,
    base_parser,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
)


def batches(loader):
    """Endless batches: start another pass over the data (an epoch) whenever one ends."""
    while True:
        yield from loader


def main():
    args = parse_args(base_parser(__doc__.splitlines()[0]))
    local_rank, rank, device, world_size = setup(args.seed)
    if world_size > 1:
        raise Refusal(
            f"lesson 00 is the single-device baseline: run it with 1 process, not {world_size}; "
            "lesson 02 makes it data parallel."
        )

    # Data: fixed-length blocks of tokens, in an order drawn from a generator seeded by --seed.
    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args)  # at least one full batch per epoch, else the data loop never yields
    generator = torch.Generator().manual_seed(args.seed)
    # On a GPU: page-locked (pinned) batches, copied to the device without blocking the Python thread.
    pinned = device.type == "cuda"
    loader = DataLoader(
        train, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator, pin_memory=pinned
    )

    # The model: the same weights for the same --seed, on whatever device setup() picked.
    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    optimizer = build_optimizer(model.parameters(), args)
    print0(
        f"{args.dataset}: {len(train)} blocks of {args.seq_len + 1} tokens | model: {count_parameters(config):,} "
        f"parameters | {args.optimizer} | batch {args.batch_size} | device {device.type}"
    )

    logger = Logger(args, total_steps=args.steps)
    throughput = Throughput(device)
    losses = []
    for step, (inputs, targets) in zip(range(1, args.steps + 1), batches(loader)):
        inputs, targets = inputs.to(device, non_blocking=pinned), targets.to(device, non_blocking=pinned)

        # TODO 1: the training step. Update the weights once from this batch's loss (loss_fn), computed under
        #   autocast, and record it as a plain number in `losses`. Gradients accumulate: what must they not hold?
        raise NotImplementedError("TODO 1: the training step")

        # TODO 2: count the tokens this batch trained on, for the throughput meter. Every position of every
        #   sequence is one next-token prediction.
        pass  # until TODO 2 feeds the meter, it reports 0 tokens/s (the rest of the script runs: TODO 1 is checkable)

        # TODO 3: log the loss to tensorboard (and wandb). Once per step, at its number, record this step's loss
        #   and the meter's tokens per second as the scalars `loss` and `tokens_per_s`; the Logger writes to both.
        pass  # until TODO 3 logs them, tensorboard receives no scalars
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    tokens_per_s = throughput.tokens_per_s
    print0(f"throughput: {tokens_per_s:,.0f} tokens/s on {device.type}")
    if args.checkpoint:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": vars(config)}
        save0(state, args.checkpoint)
        print0(f"saved the model to {args.checkpoint}")
    write_metrics(
        args.metrics_out,
        final_loss=losses[-1],
        losses=losses,
        steps=len(losses),
        tokens_per_s=tokens_per_s,
        param_checksum=param_checksum(model),
        bytes_per_rank=state_bytes(model, optimizer),
        optimizer=args.optimizer,
        dataset=args.dataset,
        autocast=args.autocast,
        device=device.type,
    )
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
