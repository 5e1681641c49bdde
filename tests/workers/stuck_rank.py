"""A job that hangs, for tests/test_stacks.py; run it under TORCH_DISTRIBUTED_DEBUG=DETAIL.

First an all-reduce whose shape differs on rank 1: DETAIL turns it into an error on every rank, which each prints.
Then the hang: rank 1 waits for a message nobody sends, the others in an all-reduce that rank 1 never joins. Every
rank prints "waiting" first, so the test knows when to take the stacks. The hang ends with the course's collective
timeout (COURSE_TIMEOUT_S); the test kills the job sooner.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from utils.distributed_utils import setup


def say(line: str):
    sys.stdout.write(line + "\n")  # one write: print() writes the newline apart, and the ranks share one file
    sys.stdout.flush()


def average_gradients(grad):
    dist.all_reduce(grad)  # ranks 0, 2, ... wait here


def wait_for_token():
    token = torch.zeros(1)
    dist.recv(token, src=0)  # rank 1 waits here: rank 0 never sends
    return token


def main():
    _, rank, _, _ = setup()
    try:
        dist.all_reduce(torch.ones(4 + (rank == 1)))  # rank 1 has one element more
    except RuntimeError as error:  # without DETAIL, gloo aborts rank 0's process ("Received data size doesn't match")
        say(f"rank {rank} mismatch: {error}")
    say(f"rank {rank} waiting")
    if rank == 1:
        wait_for_token()
    else:
        average_gradients(torch.ones(4))


if __name__ == "__main__":
    main()
