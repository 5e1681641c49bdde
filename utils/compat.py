"""Differences between the PyTorch releases the course runs on, handled here and nowhere else.

Workshop clusters lag behind the newest PyTorch. The lessons are written against the newest names;
importing this module (utils.distributed_utils does, so every script does) gives an older torch the
same names, so the lesson code reads the same everywhere.

- torch 2.13 renamed the flat-tensor collectives: `all_gather_into_tensor` -> `all_gather_single`,
  `reduce_scatter_tensor` -> `reduce_scatter_single` (the old names still work there, with a FutureWarning).
"""

import torch.distributed as dist

TORCH_RENAMES = {  # new name (torch >= 2.13): old name (torch < 2.13), same arguments
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}

for _new, _old in TORCH_RENAMES.items():
    if not hasattr(dist, _new):
        setattr(dist, _new, getattr(dist, _old))
