"""What a checkpoint folder holds, read back from its files and printed for the notebook."""

import math
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader


def show_dcp_metadata(folder: Path) -> tuple[int, int, int]:
    """Print what DCP's .metadata says the .distcp files hold: tensors, shapes, and which piece of each every rank
    wrote. Returns (numbers stored in all files, model parameters, model tensors). (The files' sizes in bytes are
    left out on purpose: they depend on the torch release's file format.)"""
    stored = FileSystemReader(str(folder)).read_metadata()
    tensors = stored.state_dict_metadata
    weights = [k for k in tensors if k.startswith("model.")]
    moments = [k for k in tensors if k.startswith("optimizer.state.")]
    kinds = "(AdamW: step, exp_avg, exp_avg_sq)"
    print(f".metadata: {len(weights)} model tensors, {len(moments)} optimizer state entries {kinds}")
    for name in (weights[0], f"optimizer.state.{weights[0].removeprefix('model.')}.exp_avg"):
        pieces = ", ".join(f"rows {c.offsets[0]}-{c.offsets[0] + c.sizes[0] - 1}" for c in tensors[name].chunks)
        print(f"  {name}: {tuple(tensors[name].size)}, in {len(tensors[name].chunks)} shards ({pieces})")
    values = Counter()  # numbers stored in each .distcp file, counted from the pieces .metadata says it holds
    for index, where in stored.storage_data.items():
        chunks = getattr(tensors[index.fqn], "chunks", [])
        values[where.relative_path] += sum(math.prod(c.sizes) for c in chunks if list(c.offsets) == list(index.offset))
    for file, count in sorted(values.items()):
        print(
            f"  {file}: {count:,} numbers (this rank's shards of the weights and of both AdamW moments, step counters)"
        )
    parameters = sum(math.prod(tensors[k].size) for k in weights)
    print(f"  together: {sum(values.values()):,} = 3 x the {parameters:,} parameters + {len(weights)} step counters")
    return sum(values.values()), parameters, len(weights)


def show_meta(meta: dict):
    """Print meta.json's contents in a few lines."""
    print("\nmeta.json:")
    position = f"step {meta['step']}, epoch {meta['epoch']}, offset {meta['offset']} samples"
    print(f"  {position}, saved by {meta['world_size']} ranks")
    print(f"  losses: {len(meta['losses'])} of them, {meta['losses'][0]:.4f} ... {meta['losses'][-1]:.4f}")
    print(f"  scheduler: its state_dict(), at step {meta['scheduler']['last_epoch']}")
    print(f"  files: the size of each of the {len(meta['files'])} files written before it: {sorted(meta['files'])}")


def show_rank_file(path: Path):
    """Print what a rank-R.pt holds: the kind and size of each random generator state."""
    saved = torch.load(path, weights_only=True)
    states = ", ".join(f"{k!r}: a {v.dtype} tensor of {v.numel()}" for k, v in saved["rng"].items())
    print(f"\n{path.name}: {{'rng': {{{states}}}}}")
