"""Lesson 08's mutants: plausible mistakes in each TODO of solutions/08_fault_tolerance.py, each of which the
lesson's tests must catch, naming the TODO (python -m tests.mutants, make mutants LESSON=08)."""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {}  # the comments name no code of their own: the function docstrings give the contracts
SAVE = (  # TODO 5's answer, the line the lab's mistakes replace
    "    dcp.save(state, checkpoint_id=str(folder))  # every rank its shards; "
    "DCP's coordinator (rank 0) the .metadata\n"
)

MUTANTS = [
    # TODO 1: what a checkpoint holds
    Mutant(todo=1, what="saves the model but not the optimizer (AdamW's moments restart at zero)",
           find='    sharded = {"model": model_state, "optimizer": optimizer_state}\n    rng = {',
           replace='    sharded = {"model": model_state}\n    rng = {',
           shows=("moments would restart",)),
    Mutant(todo=1, what="leaves out the rank's RNG state",
           find='    rng = {"torch": torch.get_rng_state()}', replace="    rng = {}",
           shows=("random generator state is missing",)),
    Mutant(todo=1, what="leaves out the LR schedule",
           find='    shared = {**asdict(progress), "scheduler": scheduler.state_dict()}',
           replace="    shared = asdict(progress)",
           shows=("LR schedule is missing",)),
    Mutant(todo=1, what="stores the live list of losses, which the run keeps appending to",
           find="    shared[\"losses\"] = list(progress.losses)  # a copy: the run goes on appending to its own list",
           replace='    shared["losses"] = progress.losses',
           shows=("not a copy",)),
    # TODO 2: the atomic publish
    Mutant(todo=2, what="renames the staging folder before writing META into it",
           find="    write_durably(staging / META, json.dumps({**shared, \"files\": files}, indent=1).encode())\n"
                "    fsync_dir(staging)\n    os.rename(staging, final)\n",
           replace="    os.rename(staging, final)\n"
                   "    write_durably(final / META, json.dumps({**shared, \"files\": files}, indent=1).encode())\n"
                   "    fsync_dir(final)\n",
           shows=("no meta.json", "after the publish")),
    Mutant(todo=2, what="writes META without fsync",
           find="    write_durably(staging / META, json.dumps({**shared, \"files\": files}, indent=1).encode())",
           replace="    (staging / META).write_text(json.dumps({**shared, \"files\": files}, indent=1))",
           shows=("META was not fsync'ed",)),
    Mutant(todo=2, what="no fsync of the folder after the rename",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           replace="    os.rename(staging, final)\n",
           shows=("not fsync'ed between the rename",)),
    Mutant(todo=2, what="writes the pointer in place instead of replacing it",
           find="    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n",
           replace="    write_durably(checkpoint_dir / POINTER, (final.name + \"\\n\").encode())\n",
           shows=("written in place",)),
    Mutant(todo=2, what="copies the staging folder instead of renaming it (not atomic)",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           replace="    shutil.copytree(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           shows=("copied, not renamed",)),
    Mutant(todo=2, what="points 'latest' at the new folder before renaming it into place",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n"
                "    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n",
           replace="    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                   "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                   "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n"
                   "    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           shows=("before the staging folder was renamed",)),
    Mutant(todo=2, what="the pointer's temporary file written without fsync before it replaces 'latest'",
           find="    write_durably(pointer_tmp, (final.name + \"\\n\").encode())",
           replace="    pointer_tmp.write_text(final.name + \"\\n\")",
           shows=("temporary file was not fsync'ed",)),
    # TODO 3: the newest complete checkpoint
    Mutant(todo=3, what="takes the oldest checkpoint first",
           find='sorted(checkpoint_dir.glob("step-*"), reverse=True)', replace='sorted(checkpoint_dir.glob("step-*"))',
           shows=("oldest checkpoint came first",)),
    Mutant(todo=3, what="trusts the newest folder without checking it is complete",
           find="        problem = problem_with(folder)", replace="        problem = None",
           shows=("without checking it is complete",)),
    Mutant(todo=3, what="skips damaged folders silently",
           find='        print(f"skipping {folder.name}: {problem}", flush=True)', replace="        pass",
           shows=("no line printed names",)),
    Mutant(todo=3, what="looks at every folder, the unpublished tmp-step-* ones too (a complete one is taken)",
           find='sorted(checkpoint_dir.glob("step-*"), reverse=True)',
           replace="sorted((p for p in checkpoint_dir.iterdir() if p.is_dir()), reverse=True)",
           shows=("unpublished tmp-step-*",)),
    # TODO 4: putting the run back
    Mutant(todo=4, what="does not restore the rank's RNG",
           find='        torch.set_rng_state(per_rank["rng"]["torch"])', replace="        pass",
           shows=("RNG state was not put back",)),
    Mutant(todo=4, what="does not restore the LR schedule",
           find='    scheduler.load_state_dict(meta["scheduler"])', replace="    pass",
           shows=("LR schedule is at step 0",)),
    Mutant(todo=4, what="restarts the list of losses",
           find='    progress.losses = list(meta["losses"])', replace="    progress.losses = []",
           shows=("list of losses restarted",)),
    Mutant(todo=4, what="leaves out the data position: the resumed run reads its epoch from the start",
           find='    progress.step, progress.epoch, progress.offset = meta["step"], meta["epoch"], meta["offset"]',
           replace='    progress.step, progress.epoch = meta["step"], meta["epoch"]',
           shows=("progress.offset", "data position")),
    # TODO 5: the lab (a save that never ends)
    Mutant(todo=5, what="rank 0 alone calls dcp.save, as torch.save under DDP (the exercise as given)",
           find=SAVE, replace="    if rank == 0:\n        dcp.save(state, checkpoint_id=str(folder))\n",
           shows=("rank 0 waited in dcp.save for rank 1, which returned without calling it",)),
    Mutant(todo=5, what="every rank saves into a folder of its own",
           find=SAVE, replace='    dcp.save(state, checkpoint_id=str(folder / f"rank{rank}"))\n',
           shows=("each rank saved into a place of its own", "only rank 0's gets the .metadata")),
    Mutant(todo=5, what="rank 0 writes the state with torch.save",
           find=SAVE, replace='    if rank == 0:\n        torch.save(state, folder / "checkpoint.pt")\n',
           shows=("rank 0 called torch.save", "rank 0's shards only")),
    Mutant(todo=5, what="rank 0 alone calls dcp.save with no_dist=True (no collective, so no hang)",
           find=SAVE, replace="    if rank == 0:\n        dcp.save(state, checkpoint_id=str(folder), no_dist=True)\n",
           shows=("no_dist=True", "rank 1's shards are missing")),
    Mutant(todo=5, what="every rank calls dcp.save with no_dist=True into the same folder",
           find=SAVE, replace="    dcp.save(state, checkpoint_id=str(folder), no_dist=True)\n",
           shows=("every rank called dcp.save with no_dist=True",)),
]  # fmt: skip

VARIANTS = [  # correct answers written another way: each TODO's tests must accept them
    # TODO 1: what a checkpoint holds
    Mutant(todo=1, what="the model's and the optimizer's state dicts by their own functions",
           find='    model_state, optimizer_state = get_state_dict(model, optimizer)\n'
                '    sharded = {"model": model_state, "optimizer": optimizer_state}\n',
           replace="    from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
                   "    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\n\n"
                   '    sharded = {"model": get_model_state_dict(model), '
                   '"optimizer": get_optimizer_state_dict(model, optimizer)}\n'),
    Mutant(todo=1, what="the shared part written out key by key, the losses copied with .copy()",
           find='    shared = {**asdict(progress), "scheduler": scheduler.state_dict()}\n'
                '    shared["losses"] = list(progress.losses)  # a copy: the run goes on appending to its own list\n',
           replace='    shared = {"step": progress.step, "epoch": progress.epoch, "offset": progress.offset,\n'
                   '              "losses": progress.losses.copy(), "scheduler": scheduler.state_dict()}\n'),
    Mutant(todo=1, what="the generator's state through torch.random, the dict built in one expression",
           find='    rng = {"torch": torch.get_rng_state()}\n'
                '    if torch.cuda.is_available():\n'
                '        rng["cuda"] = torch.cuda.get_rng_state()\n'
                '    per_rank = {"rng": rng}\n',
           replace='    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}\n'
                   '    per_rank = {"rng": {"torch": torch.random.get_rng_state(), **cuda}}\n'),
    # TODO 2: the atomic publish
    Mutant(todo=2, what="os.replace publishes the folder, os.rename replaces the pointer (both atomic on POSIX)",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n"
                "    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n",
           replace="    os.replace(staging, final)\n    fsync_dir(checkpoint_dir)\n"
                   "    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                   "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                   "    os.rename(pointer_tmp, checkpoint_dir / POINTER)\n"),
    Mutant(todo=2, what="the pointer written to a uniquely named temporary file (tempfile.mkstemp) with its own fsync",
           find="    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n",
           replace="    descriptor, pointer_tmp = tempfile.mkstemp(dir=checkpoint_dir, prefix=POINTER)\n"
                   "    with os.fdopen(descriptor, \"w\") as file:\n"
                   "        file.write(final.name + \"\\n\")\n"
                   "        file.flush()\n"
                   "        os.fsync(file.fileno())\n"
                   "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n"),
    Mutant(todo=2, what="the sizes read with os.scandir, META written and fsync'ed by hand",
           find="    files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}\n"
                "    write_durably(staging / META, json.dumps({**shared, \"files\": files}, indent=1).encode())\n",
           replace="    files = {e.name: e.stat().st_size for e in os.scandir(staging) if e.is_file()}\n"
                   "    with open(staging / META, \"w\") as file:\n"
                   "        json.dump({**shared, \"files\": files}, file)\n"
                   "        file.flush()\n"
                   "        os.fsync(file.fileno())\n"),
    Mutant(todo=2, what="pathlib's Path.rename and Path.replace (they call os.rename and os.replace)",
           find="    os.rename(staging, final)\n", replace="    staging.rename(final)\n"),
    # TODO 3: the newest complete checkpoint
    Mutant(todo=3, what="sorted by the step number, not the name",
           find='sorted(checkpoint_dir.glob("step-*"), reverse=True)',
           replace='sorted(checkpoint_dir.glob("step-*"), key=lambda f: int(f.name.split("-")[-1]), reverse=True)'),
    Mutant(todo=3, what="one pass over the folder: the published ones newest first, the partial ones named first",
           find="    for partial in sorted(checkpoint_dir.glob(STAGING + \"*\")):\n"
                "        print(f\"ignoring {partial.name}: a save that never finished (partial checkpoint)\", "
                "flush=True)\n"
                "    for folder in sorted(checkpoint_dir.glob(\"step-*\"), reverse=True):\n",
           replace="    names = sorted((p for p in checkpoint_dir.iterdir() if p.is_dir()), key=lambda p: p.name)\n"
                   "    for partial in (p for p in names if p.name.startswith(STAGING)):\n"
                   "        print(f\"ignoring {partial.name}: a save that never finished\", flush=True)\n"
                   "    for folder in reversed([p for p in names if p.name.startswith(\"step-\")]):\n"),
    # TODO 4: putting the run back
    Mutant(todo=4, what="the progress set field by field with setattr, the losses list taken as loaded",
           find='    progress.step, progress.epoch, progress.offset = meta["step"], meta["epoch"], meta["offset"]\n'
                '    progress.losses = list(meta["losses"])\n',
           replace='    for key in ("step", "epoch", "offset", "losses"):\n'
                   '        setattr(progress, key, meta[key])\n'),
    Mutant(todo=4, what="the RNG first, through torch.random, then the schedule",
           find='    scheduler.load_state_dict(meta["scheduler"])\n',
           replace='    if per_rank is not None:\n'
                   '        torch.random.set_rng_state(per_rank["rng"]["torch"])\n'
                   '    scheduler.load_state_dict(meta["scheduler"])\n'),
    # TODO 5: the lab
    Mutant(todo=5, what="every rank calls dcp.save, then a barrier",
           find=SAVE, replace="    dcp.save(state, checkpoint_id=str(folder))\n    dist.barrier()\n"),
    Mutant(todo=5, what="dcp.async_save on every rank, waited for with .result()",
           find=SAVE, replace="    dcp.async_save(state, checkpoint_id=str(folder)).result()\n"),
    Mutant(todo=5, what="the folder given as a FileSystemWriter",
           find=SAVE,
           replace="    from torch.distributed.checkpoint import FileSystemWriter\n\n"
                   "    dcp.save(state, storage_writer=FileSystemWriter(folder))\n"),
]  # fmt: skip
