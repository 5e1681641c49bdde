"""Differences between the PyTorch releases the course runs on, handled here and nowhere else.

Workshop clusters lag behind the newest PyTorch. The lessons are written against the newest names;
importing this module (utils.distributed_utils does, so every script does) gives an older torch the
same names, so the lesson code reads the same everywhere.

- torch 2.13 renamed the flat-tensor collectives: `all_gather_into_tensor` -> `all_gather_single`,
  `reduce_scatter_tensor` -> `reduce_scatter_single` (the old names still work there, with a FutureWarning).
- `context_parallel`'s options (how keys and values travel, whether the sequence is cut head-tail) have no
  public switch in torch 2.11 to 2.13: `configure_context_parallel` sets them through the private module, in
  this one place (utils/course/internals.py lists the names, and tests/test_internals.py checks they still exist).
"""

import torch.distributed as dist

TORCH_RENAMES = {  # new name (torch >= 2.13): old name (torch < 2.13), same arguments
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}

for _new, _old in TORCH_RENAMES.items():
    if not hasattr(dist, _new):
        setattr(dist, _new, getattr(dist, _old))


def configure_context_parallel(load_balance: bool, rotate_method: str = "alltoall"):
    """Options of torch's `context_parallel` (torch.distributed.tensor.experimental), for every later call in this
    process: `rotate_method` "alltoall" passes the keys and values around the ring block by block (the lesson's
    ring), "allgather" gathers them all at once; `load_balance` cuts each sequence head-tail (the lesson's
    zigzag), else into contiguous chunks. Private names (torch 2.11 to 2.13), imported here and nowhere else."""
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    set_rotate_method(rotate_method)
    _cp_options.enable_load_balance = load_balance
