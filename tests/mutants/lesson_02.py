"""Lesson 02's mutants: plausible mistakes in each TODO of solutions/02_data_parallel.py, each of which
`make check LESSON=02` must report as a failure of that TODO (run them with `make mutants LESSON=02`)."""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {  # names a TODO comment may use: the learner must call them, the notebook introduces them
    "put": "Bucket.put, given in the script with its docstring: TODO 2 is about when to call it, not what it does",
    "full": "Bucket.full, given in the script (and in TODO 2's title): the exercise is the launching order",
    "unpack": "Bucket.unpack, given in the script (and in TODO 4's title): the exercise is waiting before it",
    "global_batch_size": "the name the exercise's own placeholder defines and the rest of main() reads (TODO 5)",
    "DistributedSampler": "the built-in sampler notebook 02 introduces (sections 2 and 6) and TODO 6's title names",
    "apply_ddp": "the built-in path, a function of the script (notebook section 2): TODO 7 picks a wrapper",
    "DataParallel": "the hand-written wrapper of TODOs 1-4, which TODO 7 must offer under --ddp scratch",
    "no_sync": "the wrappers' accumulation context, introduced in sections 1 and 2 of the notebook (TODO 9)",
}

MUTANTS = [
    # TODO 1: broadcast rank 0's weights
    Mutant(
        todo=1,
        what="broadcasts the parameters but not the buffers",
        find="for tensor in [*module.parameters(), *module.buffers()]:",
        replace="for tensor in [*module.parameters()]:",
        shows=("buffers differ",),
    ),
    Mutant(
        todo=1,
        what="broadcasts from the last rank instead of rank 0",
        find="dist.broadcast(tensor, src=0)",
        replace="dist.broadcast(tensor, src=dist.get_world_size() - 1)",
        shows=("holds rank 1's weights",),
    ),
    # TODO 2: fill buckets, launch the full ones in order
    Mutant(
        todo=2,
        what="launches nothing from the hooks: every bucket waits for the end of backward (no overlap)",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():\n"
        "            self._launch(self.buckets[self._next_to_launch])",
        replace="        pass  # launch everything at the end of backward",
        shows=("no hook launched",),
    ),
    Mutant(
        todo=2,
        what="launches at most one bucket per hook (if instead of while)",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():",
        replace="        if self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():",
        shows=("launched only",),
    ),
    Mutant(
        todo=2,
        what="launches its own bucket as soon as that one is full, whatever the buckets before it",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():\n"
        "            self._launch(self.buckets[self._next_to_launch])\n",
        replace="        if self._bucket_of[id(p)].full():\n            self._launch(self._bucket_of[id(p)])\n",
        shows=("before bucket 0",),
    ),
    # TODO 3: the asynchronous all-reduce
    Mutant(
        todo=3,
        what="sums instead of averaging",
        find="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)",
        replace="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)",
        shows=("the sum over the 2 ranks",),
    ),
    Mutant(
        todo=3,
        what="counts the bytes twice",
        find="        self.allreduce_bytes += bucket.nbytes\n",
        replace="        self.allreduce_bytes += 2 * bucket.nbytes\n",
        shows=("counted 2 times",),
    ),
    Mutant(
        todo=3,
        what="forgets async_op=True: the all-reduce blocks (no overlap) and bucket.work holds None",
        find="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)",
        replace="bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG)",
        shows=("NoneType",),
    ),
    # TODO 4: wait and unpack
    Mutant(
        todo=4,
        what="unpacks without waiting for the all-reduce",
        find="            bucket.work.wait()\n            bucket.unpack()",
        replace="            bucket.unpack()",
        shows=("no handle was waited for",),
    ),
    Mutant(
        todo=4,
        what="never unpacks: .grad keeps the local gradient",
        find="            bucket.work.wait()\n            bucket.unpack()",
        replace="            bucket.work.wait()",
        shows=("own gradient",),
    ),
    Mutant(
        todo=4,
        what="never forgets which parameters were put: the next backward finds every bucket full at once",
        find="            bucket.ready.clear()\n            bucket.work = None\n",
        replace="            bucket.work = None\n",
        shows=("ready params",),
    ),
    # TODO 5: the global batch recipe
    Mutant(
        todo=5,
        what="forgets the ranks in the global batch",
        find="global_batch_size = args.batch_size * args.grad_accum * world_size",
        replace="global_batch_size = args.batch_size * args.grad_accum",
        shows=("ranks are missing",),
    ),
    Mutant(
        todo=5,
        what="prints the recipe on every rank",
        find='    print0(\n        f"global batch {global_batch_size} sequences',
        replace='    print(\n        f"global batch {global_batch_size} sequences',
        shows=("every rank printed it",),
    ),
    # TODO 6: DistributedSampler
    Mutant(
        todo=6,
        what="every rank reads the whole data set (no num_replicas/rank)",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True",
        shows=("every rank reads all",),
    ),
    Mutant(
        todo=6,
        what="each rank shuffles with its own seed: the slices overlap",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed + rank, drop_last=True",
        shows=("overlap",),
    ),
    # TODO 7: wrap the model
    Mutant(
        todo=7,
        what="--ddp scratch gets the built-in DDP too",
        find="        model = DataParallel(model, bucket_cap_mb=args.bucket_cap_mb)",
        replace="        model = apply_ddp(model, device, bucket_cap_mb=args.bucket_cap_mb)",
        shows=("--ddp scratch wrapped the model in DistributedDataParallel",),
    ),
    Mutant(
        todo=7,
        what="the two paths swapped: --ddp builtin gets the hand-written wrapper",
        find='    if args.ddp == "builtin":\n        model = apply_ddp(',
        replace='    if args.ddp == "scratch":\n        model = apply_ddp(',
        shows=("--ddp builtin wrapped the model in DataParallel",),
    ),
    Mutant(
        todo=7,
        what="--ddp scratch ignores --bucket-cap-mb: DataParallel gets its default 25 MB, one bucket",
        find="        model = DataParallel(model, bucket_cap_mb=args.bucket_cap_mb)\n    # EXERCISE",
        replace="        model = DataParallel(model)\n    # EXERCISE",
        shows=("never reached the wrapper",),
    ),
    # TODO 8: set_epoch
    Mutant(
        todo=8,
        what="sets sampler.shuffle instead of calling set_epoch: every epoch repeats the first order",
        find="            sampler.set_epoch(epoch)\n            # EXERCISE",
        replace="            sampler.shuffle = True  # reshuffle\n            # EXERCISE",
        shows=("are epoch 1's",),
    ),
    Mutant(
        todo=8,
        what="sets the same epoch every time",
        find="            sampler.set_epoch(epoch)\n            # EXERCISE",
        replace="            sampler.set_epoch(0)\n            # EXERCISE",
        shows=("are epoch 1's",),
    ),
    # TODO 9: no_sync accumulation
    Mutant(
        todo=9,
        what="off by one (micro_step < grad_accum): never inside no_sync, one all-reduce per micro-batch",
        find="sync = nullcontext() if last else model.no_sync()",
        replace="sync = nullcontext() if micro_step < args.grad_accum else model.no_sync()",
        shows=("every one of the 2 micro-steps",),
    ),
    Mutant(
        todo=9,
        what="no_sync on the last micro-step instead of the others: the gradients are never averaged",
        find="sync = nullcontext() if last else model.no_sync()",
        replace="sync = model.no_sync() if last else nullcontext()",
        shows=("differ from one process",),
    ),
    # TODO 10: the logged loss
    Mutant(
        todo=10,
        what="broadcasts rank 0's loss instead of averaging: logs rank 0's slice only",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.broadcast(step_loss, src=0)\n        # EXERCISE",
        shows=("first logged loss",),
    ),
    Mutant(
        todo=10,
        what="sums the ranks' losses instead of averaging",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.all_reduce(step_loss)\n        # EXERCISE",
        shows=("summed, not averaged",),
    ),
    # TODO 11: save the unwrapped model
    Mutant(
        todo=11,
        what="unwraps DistributedDataParallel only: --ddp scratch saves names prefixed with module.",
        find='state = {"model": model.module.state_dict(),',
        replace='state = {"model": (model.module if isinstance(model, DistributedDataParallel) else model)'
        ".state_dict(),",
        shows=("start with `module.`",),
    ),
    Mutant(
        todo=11,
        what="saves the weights without the optimizer",
        find='"optimizer": optimizer.state_dict(), "config": vars(config)}\n        # EXERCISE',
        replace='"config": vars(config)}\n        # EXERCISE',
        shows=("optimizer state is None",),
    ),
    # TODO 12: lab, uneven batches
    Mutant(
        todo=12,
        what="each rank runs all its batches (the lab's bug): one rank waits in DDP's all-reduce",
        find="    batches = batches[: int(fewest)]",
        replace="    batches = batches[:]",
        shows=("ran a batch more",),
    ),
    Mutant(
        todo=12,
        what="agrees on the most batches instead of the fewest",
        find="dist.all_reduce(fewest, op=dist.ReduceOp.MIN)",
        replace="dist.all_reduce(fewest, op=dist.ReduceOp.MAX)",
        shows=("ran a batch more",),
    ),
]

WRAP = (  # TODO 7's solution
    '    if args.ddp == "builtin":\n'
    "        model = apply_ddp(model, device, bucket_cap_mb=args.bucket_cap_mb)\n"
    "    else:\n"
    "        model = DataParallel(model, bucket_cap_mb=args.bucket_cap_mb)\n"
)

VARIANTS = [  # correct answers written another way: each TODO's check must accept them
    # TODO 1
    Mutant(
        todo=1,
        what="broadcasts the state dict's tensors (detached views of the same storage)",
        find="        with torch.no_grad():\n            for tensor in [*module.parameters(), *module.buffers()]:\n"
        "                dist.broadcast(tensor, src=0)\n",
        replace="        for tensor in module.state_dict().values():\n            dist.broadcast(tensor, src=0)\n",
    ),
    Mutant(
        todo=1,
        what="launches every broadcast asynchronously, then waits for all",
        find="            for tensor in [*module.parameters(), *module.buffers()]:\n"
        "                dist.broadcast(tensor, src=0)\n",
        replace="            tensors = list(module.parameters()) + list(module.buffers())\n"
        "            for work in [dist.broadcast(t, 0, async_op=True) for t in tensors]:\n"
        "                work.wait()\n",
    ),
    # TODO 2
    Mutant(
        todo=2,
        what="a for loop over the buckets not yet launched, stopping at the first that is not full",
        find="        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():\n"
        "            self._launch(self.buckets[self._next_to_launch])\n",
        replace="        for bucket in self.buckets[self._next_to_launch :]:\n"
        "            if not bucket.full():\n"
        "                break\n"
        "            self._launch(bucket)\n",
    ),
    Mutant(
        todo=2,
        what="the bucket looked up by walking the buckets, the launches counted by a local index",
        find="        self._bucket_of[id(p)].put(p)\n"
        "        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].full():\n"
        "            self._launch(self.buckets[self._next_to_launch])\n",
        replace="        next(b for b in self.buckets if any(q is p for q in b.params)).put(p)\n"
        "        index = self._next_to_launch\n"
        "        while index < len(self.buckets) and self.buckets[index].full():\n"
        "            self._launch(self.buckets[index])\n"
        "            index += 1\n",
    ),
    # TODO 3
    Mutant(
        todo=3,
        what="divides by the world size first, then sums (what DDP's gradient pre-division does)",
        find="        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)\n",
        replace="        bucket.flat.div_(self.world_size)\n"
        "        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)\n",
    ),
    Mutant(
        todo=3,
        what="counts first, launches last, the order kept with +=",
        find="        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.AVG, async_op=True)\n"
        "        self.allreduce_bytes += bucket.nbytes\n"
        "        self.launch_order.append(bucket.index)\n"
        "        self._next_to_launch += 1\n",
        replace="        self._next_to_launch += 1\n"
        "        self.launch_order += [bucket.index]\n"
        "        self.allreduce_bytes += bucket.flat.numel() * bucket.flat.element_size()\n"
        "        bucket.work = dist.all_reduce(bucket.flat, dist.ReduceOp.AVG, async_op=True)\n",
    ),
    # TODO 4
    Mutant(
        todo=4,
        what="waits for every bucket first, then unpacks and resets them all",
        find="        for bucket in self.buckets:\n            bucket.work.wait()\n            bucket.unpack()\n"
        "            bucket.ready.clear()\n            bucket.work = None\n",
        replace="        for bucket in self.buckets:\n            bucket.work.wait()\n"
        "        for bucket in self.buckets:\n            bucket.unpack()\n"
        "            bucket.ready, bucket.work = set(), None\n",
    ),
    # TODO 5
    Mutant(
        todo=5,
        what="the product in another order, printed by rank 0 with print",
        find="    global_batch_size = args.batch_size * args.grad_accum * world_size\n    print0(\n",
        replace="    global_batch_size = world_size * args.grad_accum * args.batch_size\n"
        "    if rank == 0:\n      print(\n",
    ),
    # TODO 6
    Mutant(
        todo=6,
        what="the sampler's arguments by position",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, world_size, rank, True, args.seed, True",
    ),
    Mutant(
        todo=6,
        what="the world size and rank left to the sampler (it reads the process group), keywords in another order",
        find="train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True",
        replace="train, drop_last=True, seed=args.seed",
    ),
    # TODO 7
    Mutant(
        todo=7,
        what="DistributedDataParallel called directly, the branches swapped, the options by keyword in another order",
        find=WRAP,
        replace='    if args.ddp == "scratch":\n'
        "        model = DataParallel(bucket_cap_mb=args.bucket_cap_mb, module=model)\n"
        "    else:\n        model = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)\n",
    ),
    Mutant(
        todo=7,
        what="a dict of the two wrappers, the bucket size by position",
        find=WRAP,
        replace='    wrap = {"builtin": lambda m: apply_ddp(m, device, args.bucket_cap_mb),\n'
        '            "scratch": lambda m: DataParallel(m, args.bucket_cap_mb)}[args.ddp]\n'
        "    model = wrap(model)\n",
    ),
    # TODO 8
    Mutant(
        todo=8,
        what="the loader's own sampler told the epoch",
        find="            sampler.set_epoch(epoch)\n            # EXERCISE",
        replace="            loader.sampler.set_epoch(epoch=epoch)\n            # EXERCISE",
    ),
    # TODO 9
    Mutant(
        todo=9,
        what="no_sync chosen by the micro-step's index",
        find="sync = nullcontext() if last else model.no_sync()",
        replace="sync = model.no_sync() if micro_step < args.grad_accum - 1 else nullcontext()",
    ),
    # TODO 10
    Mutant(
        todo=10,
        what="sums across ranks, then divides by the world size",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.all_reduce(step_loss)\n        step_loss /= world_size\n        # EXERCISE",
    ),
    Mutant(
        todo=10,
        what="gathers every rank's loss and takes their mean",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        every = [torch.zeros_like(step_loss) for _ in range(world_size)]\n"
        "        dist.all_gather(every, step_loss)\n"
        "        step_loss = torch.stack(every).mean()\n        # EXERCISE",
    ),
    Mutant(
        todo=10,
        what="the averaging all-reduce launched asynchronously, then waited for",
        find="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)\n        # EXERCISE",
        replace="        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG, async_op=True).wait()\n        # EXERCISE",
    ),
    # TODO 11
    Mutant(
        todo=11,
        what="the wrapper's state dict with its module. prefix removed",
        find='state = {"model": model.module.state_dict(),',
        replace='state = {"model": {k.removeprefix("module."): v for k, v in model.state_dict().items()},',
    ),
    # TODO 12
    Mutant(
        todo=12,
        what="every rank's count gathered as objects, the minimum taken locally",
        find="    fewest = torch.tensor(len(batches))\n"
        "    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # drop the extra batch, as "
        "DistributedSampler(drop_last=True)\n",
        replace="    counts = [None] * world_size\n"
        "    dist.all_gather_object(counts, len(batches))\n"
        "    fewest = min(counts)\n",
    ),
    Mutant(
        todo=12,
        what="the fewest batches computed from the sample count alone: the smallest share is len // n samples",
        find="    fewest = torch.tensor(len(batches))\n"
        "    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # drop the extra batch, as "
        "DistributedSampler(drop_last=True)\n    batches = batches[: int(fewest)]\n",
        replace="    batches = batches[: math.ceil(len(samples) // world_size / batch_size)]\n",
    ),
    Mutant(
        todo=12,
        what="the fewest found as the largest negated count",
        find="    fewest = torch.tensor(len(batches))\n"
        "    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # drop the extra batch, as "
        "DistributedSampler(drop_last=True)\n    batches = batches[: int(fewest)]\n",
        replace="    negated = torch.tensor(-len(batches))\n"
        "    dist.all_reduce(negated, op=dist.ReduceOp.MAX)\n    batches = batches[: -int(negated)]\n",
    ),
]
