"""Lesson 08's mutants: plausible mistakes in each TODO of solutions/08_fault_tolerance.py, each of which the
lesson's tests must catch, naming the TODO (python -m tests.mutants, make mutants LESSON=08)."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: what a checkpoint holds
    Mutant(todo=1, what="saves the model but not the optimizer (AdamW's moments restart at zero)",
           find='    sharded = {"model": model_state, "optimizer": optimizer_state}\n    rng = {',
           replace='    sharded = {"model": model_state}\n    rng = {'),
    Mutant(todo=1, what="leaves out the rank's RNG state",
           find='    rng = {"torch": torch.get_rng_state()}', replace="    rng = {}"),
    Mutant(todo=1, what="leaves out the LR schedule",
           find='    shared = {**asdict(progress), "scheduler": scheduler.state_dict()}',
           replace="    shared = asdict(progress)"),
    Mutant(todo=1, what="stores the live list of losses, which the run keeps appending to",
           find="    shared[\"losses\"] = list(progress.losses)  # a copy: the run goes on appending to its own list",
           replace='    shared["losses"] = progress.losses'),
    # TODO 2: the atomic publish
    Mutant(todo=2, what="renames the staging folder before writing META into it",
           find="    write_durably(staging / META, json.dumps({**shared, \"files\": files}, indent=1).encode())\n"
                "    fsync_dir(staging)\n    os.rename(staging, final)\n",
           replace="    os.rename(staging, final)\n"
                   "    write_durably(final / META, json.dumps({**shared, \"files\": files}, indent=1).encode())\n"
                   "    fsync_dir(final)\n"),
    Mutant(todo=2, what="writes META without fsync",
           find="    write_durably(staging / META, json.dumps({**shared, \"files\": files}, indent=1).encode())",
           replace="    (staging / META).write_text(json.dumps({**shared, \"files\": files}, indent=1))"),
    Mutant(todo=2, what="no fsync of the folder after the rename",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           replace="    os.rename(staging, final)\n"),
    Mutant(todo=2, what="writes the pointer in place instead of replacing it",
           find="    pointer_tmp = checkpoint_dir / f\"{POINTER}.tmp\"\n"
                "    write_durably(pointer_tmp, (final.name + \"\\n\").encode())\n"
                "    os.replace(pointer_tmp, checkpoint_dir / POINTER)\n",
           replace="    write_durably(checkpoint_dir / POINTER, (final.name + \"\\n\").encode())\n"),
    Mutant(todo=2, what="copies the staging folder instead of renaming it (not atomic)",
           find="    os.rename(staging, final)\n    fsync_dir(checkpoint_dir)\n",
           replace="    shutil.copytree(staging, final)\n    fsync_dir(checkpoint_dir)\n"),
    # TODO 3: the newest complete checkpoint
    Mutant(todo=3, what="takes the oldest checkpoint first",
           find='sorted(checkpoint_dir.glob("step-*"), reverse=True)', replace='sorted(checkpoint_dir.glob("step-*"))'),
    Mutant(todo=3, what="trusts the newest folder without checking it is complete",
           find="        problem = problem_with(folder)", replace="        problem = None"),
    Mutant(todo=3, what="skips damaged folders silently",
           find='        print(f"skipping {folder.name}: {problem}", flush=True)', replace="        pass"),
    # TODO 4: putting the run back
    Mutant(todo=4, what="does not restore the rank's RNG",
           find='        torch.set_rng_state(per_rank["rng"]["torch"])', replace="        pass"),
    Mutant(todo=4, what="does not restore the LR schedule",
           find='    scheduler.load_state_dict(meta["scheduler"])', replace="    pass"),
    Mutant(todo=4, what="restarts the list of losses",
           find='    progress.losses = list(meta["losses"])', replace="    progress.losses = []"),
]  # fmt: skip
