"""Run by tests/test_failures.py: a job where one rank goes wrong must end, not hang.

failure_check.py crash   rank 1 dies before a collective the others wait in
failure_check.py skip    rank 1 stays alive but never joins the collective
failure_check.py refuse  every rank refuses its options alike, before it joins the group
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from utils.distributed_utils import Refusal, destroy_process_group, run_main, setup


def main(mode: str):
    if mode == "refuse":
        raise Refusal("--experts 4 cannot be shared by 3 ranks: choose a multiple of 3")
    _, rank, _, _ = setup()
    if rank == 1 and mode == "crash":
        os._exit(13)  # as abrupt as a segfault or an out-of-memory kill
    if rank == 1 and mode == "skip":
        time.sleep(120)  # alive, silent: only the collective's timeout can end the others' wait
    dist.all_reduce(torch.ones(4))
    destroy_process_group()


if __name__ == "__main__":
    run_main(main, sys.argv[1])
