"""Lesson 02: data parallelism. Lesson 00's training script, run by N processes that each train on 1/N of every batch.

Each rank holds a full copy of the model, reads a different slice of each global batch (DistributedSampler),
and averages its gradients with the other ranks during backward (DistributedDataParallel, or the
hand-written utils/ddp_scratch.py with --ddp scratch), so all copies take the same optimizer step.
N ranks with a batch of b per rank train exactly like one process with a batch of N x b.
Compare this file with solutions/00_setup_and_baseline.py: the difference is the lesson.

    torchrun --nproc_per_node=4 solutions/02_data_parallel.py                  # built-in DDP
    torchrun --nproc_per_node=4 solutions/02_data_parallel.py --ddp scratch    # the hand-written one
    torchrun --nproc_per_node=2 solutions/02_data_parallel.py --grad-accum 4   # global batch 8 x 4 x 2
    sbatch slurm/02_data_parallel_2nodes.sbatch solutions                      # 2 nodes x 4 GPUs
"""

import sys
from contextlib import nullcontext
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from utils.data import load_token_dataset
from utils.ddp_scratch import DataParallel, bus_bytes
from utils.distributed_utils import destroy_process_group, print0, run_main, save0, setup
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    Logger,
    Throughput,
    base_parser,
    build_optimizer,
    check_batches,
    model_config,
    parse_args,
    positive_int,
)


def main():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ddp", choices=["builtin", "scratch"], default="builtin", help="which data parallelism")
    parser.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size (both --ddp)")
    args = parse_args(parser)
    local_rank, rank, device, world_size = setup(args.seed)

    # TODO 1: the global batch recipe. Lesson 00 refused to run with more than one process; here every
    #   rank trains on its own micro-batches, so one optimizer step sees
    #   global batch = micro-batch per rank (--batch-size) x micro-batches per step (--grad-accum) x ranks.
    #   Compute `global_batch_size` and print it once (print0), as the recipe.
    # BEGIN SOLUTION
    global_batch_size = args.batch_size * args.grad_accum * world_size
    print0(
        f"global batch {global_batch_size} sequences = {args.batch_size} per rank x {args.grad_accum} "
        f"accumulation steps x {world_size} ranks ({global_batch_size * args.seq_len:,} tokens per step)"
    )
    # EXERCISE
    # if world_size > 1:
    #     raise NotImplementedError("TODO 1: the global batch recipe")  # lesson 00 ran one process only
    # global_batch_size = args.batch_size * args.grad_accum
    # END SOLUTION

    # Data: fixed-length blocks of tokens, every rank with the whole data set (utils.sharding shows other ways).
    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args, world_size, per_step=args.grad_accum)  # else some rank waits for data forever
    # TODO 2: shard the data with a DistributedSampler. Every rank draws the same shuffled order (same seed)
    #   and keeps every world_size-th sample, so the ranks' batches are disjoint slices of one global batch.
    #   drop_last=True drops the last few samples instead of padding the epoch by repeating some.
    #   Give the sampler to the DataLoader (a loader takes shuffle= or sampler=, not both).
    # BEGIN SOLUTION
    sampler = DistributedSampler(
        train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    # EXERCISE
    # generator = torch.Generator().manual_seed(args.seed)
    # loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=generator)
    # END SOLUTION

    # The model: the same weights for the same --seed, on whatever device setup() picked.
    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    # TODO 3: wrap the model for data parallelism: DistributedDataParallel (--ddp builtin) or the hand-written
    #   DataParallel (--ddp scratch). Both broadcast rank 0's weights, then average the gradients across
    #   ranks during backward, bucket by bucket (--bucket-cap-mb). On a GPU, DDP wants device_ids=[device].
    # BEGIN SOLUTION
    if args.ddp == "builtin":
        device_ids = [device] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
    else:
        model = DataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    # EXERCISE
    # pass
    # END SOLUTION
    optimizer = build_optimizer(model.parameters(), args)
    print0(
        f"{args.dataset}: {len(train)} blocks of {args.seq_len + 1} tokens, {len(loader)} batches per rank per epoch"
        f" | model: {count_parameters(config):,} parameters | {args.optimizer} | --ddp {args.ddp}"
        f" | device {device.type}"
    )

    def batches():
        """Endless batches: start another pass over the data (an epoch) whenever one ends."""
        for epoch in count():
            if epoch > 0:
                print0(f"epoch {epoch}: another pass over the data")
            # TODO 4: reshuffle every epoch. A DistributedSampler draws its order from seed + epoch, and only
            #   learns the epoch from set_epoch(epoch): without it, every epoch repeats the first one's order.
            # BEGIN SOLUTION
            sampler.set_epoch(epoch)
            # EXERCISE
            # pass
            # END SOLUTION
            yield from loader

    logger = Logger(args, total_steps=args.steps)
    throughput = Throughput(device)
    losses = []
    micro_batches = batches()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for micro_step in range(args.grad_accum):
            inputs, targets = next(micro_batches)
            inputs, targets = inputs.to(device), targets.to(device)
            last = micro_step == args.grad_accum - 1
            # TODO 5: accumulate gradients without communicating. On every micro-step but the last, run
            #   backward inside model.no_sync(): the gradients only add up locally, and the last backward
            #   all-reduces their sum once per optimizer step instead of once per micro-step.
            # BEGIN SOLUTION
            sync = nullcontext() if last else model.no_sync()
            # EXERCISE
            # sync = nullcontext()
            # END SOLUTION
            with sync:
                # Each micro-batch's mean loss / grad_accum: the gradients add up to the global batch's mean.
                loss = loss_fn(model(inputs), targets) / args.grad_accum
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()

        # TODO 6: average the loss across ranks for logging. Each rank knows only its own slice's loss;
        #   all-reduce it with ReduceOp.AVG so rank 0 logs the global batch's loss (equal batch sizes:
        #   the mean of the ranks' means is the global mean). It costs one tiny collective per step.
        # BEGIN SOLUTION
        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        # EXERCISE
        # pass
        # END SOLUTION
        losses.append(step_loss.item())
        throughput.step(inputs.numel() * args.grad_accum * world_size)  # the whole job's tokens
        logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:4d}  loss {losses[-1]:.4f}")
    logger.close()

    tokens_per_s = throughput.tokens_per_s
    print0(f"throughput: {tokens_per_s:,.0f} tokens/s on {world_size} x {device.type}")
    allreduce_bytes = model.allreduce_bytes / args.steps if isinstance(model, DataParallel) else None
    if allreduce_bytes is not None:
        print0(
            f"all-reduced {allreduce_bytes:,.0f} bytes of gradients per step; a ring sends "
            f"{bus_bytes(allreduce_bytes, world_size):,.0f} bytes per rank for them"
        )
    if args.checkpoint:
        # TODO 7: save the model once, unwrapped. Every rank holds the same weights: rank 0 alone writes
        #   (save0). Save the inner module's state dict (model.module): its names have no "module." prefix,
        #   so the file loads into a plain model on one process, like lesson 00's checkpoint.
        # BEGIN SOLUTION
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "config": vars(config)}
        # EXERCISE
        # state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": vars(config)}
        # END SOLUTION
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
        ddp=args.ddp,
        grad_accum=args.grad_accum,
        global_batch_size=global_batch_size,
        batches_per_epoch=len(loader),
        allreduce_bytes_per_step=allreduce_bytes,
        bus_bytes_per_step=None if allreduce_bytes is None else bus_bytes(allreduce_bytes, world_size),
    )
    print0(f"FINISHED {len(losses)} steps, final loss {losses[-1]:.4f}")
    # DDP keeps a reference to the process group: free it while the group still exists. (Freed only after
    # destroy_process_group, the group's last reference goes with it, and gloo's teardown can deadlock.)
    del model, optimizer
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
