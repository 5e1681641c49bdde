"""Lesson 02's mutants: plausible mistakes in each TODO of solutions/02_data_parallel.py, each of which
`make check LESSON=02` must report as a failure of that TODO (run them with `make mutants LESSON=02`)."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: broadcast rank 0's weights
    Mutant(
        todo=1,
        what="broadcasts the parameters but not the buffers",
        find="for tensor in [*module.parameters(), *module.buffers()]:",
        replace="for tensor in [*module.parameters()]:",
    ),
    Mutant(
        todo=1,
        what="broadcasts from the last rank instead of rank 0",
        find="dist.broadcast(tensor, src=0)",
        replace="dist.broadcast(tensor, src=dist.get_world_size() - 1)",
    ),
    # TODO 2: fill buckets, launch the full ones in order
    Mutant(
        todo=2,
        what="launches nothing from the hooks: every bucket waits for the end of backward (no overlap)",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():\n"
        "            self._launch(self.buckets[self._next_to_launch])",
        replace="        pass  # launch everything at the end of backward",
    ),
    Mutant(
        todo=2,
        what="launches at most one bucket per hook (if instead of while)",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():",
        replace="        if self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():",
    ),
    # TODO 3: the asynchronous all-reduce
    Mutant(
        todo=3,
        what="sums instead of averaging",
        find="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)",
        replace="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)",
    ),
    Mutant(
        todo=3,
        what="counts the bytes twice",
        find="        self.allreduce_bytes += bucket.nbytes\n",
        replace="        self.allreduce_bytes += 2 * bucket.nbytes\n",
    ),
    # TODO 4: wait and unpack
    Mutant(
        todo=4,
        what="unpacks without waiting for the all-reduce",
        find="            bucket.work.wait()\n            bucket.unpack()",
        replace="            bucket.unpack()",
    ),
    Mutant(
        todo=4,
        what="never unpacks: .grad keeps the local gradient",
        find="            bucket.work.wait()\n            bucket.unpack()",
        replace="            bucket.work.wait()",
    ),
    # TODO 5: the global batch recipe
    Mutant(
        todo=5,
        what="forgets the ranks in the global batch",
        find="global_batch_size = args.batch_size * args.grad_accum * world_size",
        replace="global_batch_size = args.batch_size * args.grad_accum",
    ),
    Mutant(
        todo=5,
        what="prints the recipe on every rank",
        find='    print0(\n        f"global batch {global_batch_size} sequences',
        replace='    print(\n        f"global batch {global_batch_size} sequences',
    ),
    # TODO 6: DistributedSampler
    Mutant(
        todo=6,
        what="every rank reads the whole data set (no num_replicas/rank)",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True",
    ),
    Mutant(
        todo=6,
        what="each rank shuffles with its own seed: the slices overlap",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed + rank, drop_last=True",
    ),
    # TODO 7: wrap the model
    Mutant(
        todo=7,
        what="--ddp scratch gets the built-in DDP too",
        find="        model = DataParallel(model, bucket_cap_mb=args.bucket_cap_mb)",
        replace="        model = apply_ddp(model, device, bucket_cap_mb=args.bucket_cap_mb)",
    ),
    Mutant(
        todo=7,
        what="the two paths swapped: --ddp builtin gets the hand-written wrapper",
        find='    if args.ddp == "builtin":\n        model = apply_ddp(',
        replace='    if args.ddp == "scratch":\n        model = apply_ddp(',
    ),
    # TODO 8: set_epoch
    Mutant(
        todo=8,
        what="sets sampler.shuffle instead of calling set_epoch: every epoch repeats the first order",
        find="            sampler.set_epoch(epoch)\n            # EXERCISE",
        replace="            sampler.shuffle = True  # reshuffle\n            # EXERCISE",
    ),
    Mutant(
        todo=8,
        what="sets the same epoch every time",
        find="            sampler.set_epoch(epoch)\n            # EXERCISE",
        replace="            sampler.set_epoch(0)\n            # EXERCISE",
    ),
    # TODO 9: no_sync accumulation
    Mutant(
        todo=9,
        what="off by one (micro_step < grad_accum): never inside no_sync, one all-reduce per micro-batch",
        find="sync = nullcontext() if last else model.no_sync()",
        replace="sync = nullcontext() if micro_step < args.grad_accum else model.no_sync()",
    ),
    Mutant(
        todo=9,
        what="no_sync on the last micro-step instead of the others: the gradients are never averaged",
        find="sync = nullcontext() if last else model.no_sync()",
        replace="sync = model.no_sync() if last else nullcontext()",
    ),
    # TODO 10: the logged loss
    Mutant(
        todo=10,
        what="broadcasts rank 0's loss instead of averaging: logs rank 0's slice only",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.broadcast(step_loss, src=0)\n        # EXERCISE",
    ),
    Mutant(
        todo=10,
        what="sums the ranks' losses instead of averaging",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.all_reduce(step_loss)\n        # EXERCISE",
    ),
    # TODO 11: save the unwrapped model
    Mutant(
        todo=11,
        what="unwraps DistributedDataParallel only: --ddp scratch saves names prefixed with module.",
        find='state = {"model": model.module.state_dict(),',
        replace='state = {"model": (model.module if isinstance(model, DistributedDataParallel) else model)'
        ".state_dict(),",
    ),
    Mutant(
        todo=11,
        what="saves the weights without the optimizer",
        find='"optimizer": optimizer.state_dict(), "config": vars(config)}\n        # EXERCISE',
        replace='"config": vars(config)}\n        # EXERCISE',
    ),
    # TODO 12: lab, uneven batches
    Mutant(
        todo=12,
        what="each rank runs all its batches (the lab's bug): one rank waits in DDP's all-reduce",
        find="    batches = batches[: int(fewest)]",
        replace="    batches = batches[:]",
    ),
    Mutant(
        todo=12,
        what="agrees on the most batches instead of the fewest",
        find="dist.all_reduce(fewest, op=dist.ReduceOp.MIN)",
        replace="dist.all_reduce(fewest, op=dist.ReduceOp.MAX)",
    ),
]
