"""Lesson 03's checkpoints: save the full state or a sharded (DCP) one, resume from either, and end every
problem with a checkpoint (missing, damaged, another model, unreadable) in one line naming it and the cause.

Plumbing for solutions/03_zero_fsdp.py. The loading itself is utils/distributed_utils.py's (DCP) or
`set_state_dict` (a full-state file into a sharded model); here is what a real run wraps around it: a
description beside each checkpoint (step, model config, strategy), read first, and readable errors.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from utils.distributed_utils import (
    CourseError,
    is_root_process,
    load_sharded_model,
    print0,
    save0,
    save_full_model,
    save_sharded_model,
)


def checkpoint_meta(path: Path) -> Path:
    return path / "course.json" if path.is_dir() or not path.suffix else path.with_name(path.name + ".json")


def resume(path: Path, model, optimizer, config) -> int:
    """Load a DCP folder (any world size) or a full-state file into model and optimizer; return its step.
    Every problem with the checkpoint ends in one CourseError naming the path and the cause."""
    if not path.exists():
        raise CourseError(f"--resume {path}: no such checkpoint (a --save-dcp folder or a --checkpoint file)")
    if path.is_dir() and not (path / ".metadata").exists():
        raise CourseError(f"--resume {path}: no distributed checkpoint in this folder (its .metadata file is missing)")
    if path.is_dir():  # read the index first: DCP prints tracebacks of its own when it cannot
        try:
            FileSystemReader(path).read_metadata()
        except Exception as error:
            raise CourseError(f"--resume {path}: its .metadata file is damaged ({gist(error)})") from None
    meta_path = checkpoint_meta(path)
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    except (OSError, ValueError) as error:
        raise CourseError(f"--resume {path}: its description {meta_path.name} is damaged ({gist(error)})") from None
    if meta.get("config", vars(config)) != vars(config):
        theirs = {k: v for k, v in meta["config"].items() if vars(config).get(k) != v}
        raise CourseError(
            f"--resume {path}: the checkpoint holds another model ({theirs}, this run builds "
            f"{ {k: vars(config)[k] for k in theirs} }); use the model options it was saved with"
        )
    if path.is_file():
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # not a torch file, or a truncated one
            raise CourseError(f"--resume {path}: not a checkpoint file, or a damaged one ({gist(error)})") from None
    try:
        if path.is_dir():
            load_sharded_model(model, optimizer, path)
        else:
            options = StateDictOptions(full_state_dict=True)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=options)  # fmt: skip
    except CourseError:
        raise
    # damaged shards or metadata, a checkpoint of another model or optimizer. DCP raises CheckpointException, a
    # BaseException (not an Exception), carrying each rank's own error.
    except (Exception, CheckpointException) as error:
        raise CourseError(
            f"--resume {path}: the checkpoint is damaged or does not fit this model and optimizer ({gist(error)}); "
            "resume from another checkpoint, or save this one again"
        ) from None
    return int(meta.get("step", 0))


def gist(error: BaseException) -> str:
    """An exception's first line, short: what a one-line error message quotes (for DCP's, the first rank's)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def save0_json(path: Path, record: dict):
    """What a checkpoint is (step, model config, strategy), written beside it by rank 0."""
    if is_root_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()


def save_checkpoints(args, model, optimizer, strategy: str, step: int, config):
    """--checkpoint: the full state in one file, written by rank 0 (Zero3 and ZeRO-1/2, which `strategy` names:
    the model only); --save-dcp: every rank writes its shards. Each with its description beside it."""
    describe = {"step": step, "config": vars(config), "strategy": strategy}
    if args.checkpoint:
        path = args.checkpoint
        if args.strategy == "all":
            path = path.with_stem(f"{path.stem}-{strategy}")
        if strategy == "zero3":  # the lesson's Zero3 gathers its shards under the original names
            save0({"model": model.full_state_dict()}, path)
        elif strategy in ("zero1", "zero2"):  # the model is whole; ZeroOptimizer's state is flat shards
            save0({"model": model.state_dict()}, path)
        else:
            save_full_model(model, optimizer, path)
        save0_json(checkpoint_meta(path), describe)
        print0(f"saved the full model to {path}")
    if args.save_dcp:
        save_sharded_model(model, optimizer, args.save_dcp)
        save0_json(checkpoint_meta(args.save_dcp), describe)
        print0(f"saved a sharded checkpoint ({dist.get_world_size()} ranks) to {args.save_dcp}")
