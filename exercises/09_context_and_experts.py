# Exercise for lesson 09: complete the numbered TODOs. (This file is generated from
# solutions/09_context_and_experts.py by `python -m utils.make_exercises`; course maintainers edit the solution.)
"""Lesson 09: long sequences and mixture of experts. Context parallelism (ring attention) and expert parallelism.

Two more ways to split a Transformer's work across ranks, for what lessons 02-06 cannot split:

- Context parallelism (--parallel cp): one sequence too long for one rank's activations. Each rank holds a chunk
  of every sequence (its queries, keys and values); attention needs every key and value, so they travel around a
  ring of ranks while each rank accumulates its queries' attention block by block (the online softmax).
- Expert parallelism (--parallel ep): a mixture-of-experts MLP whose experts are split across ranks. A router
  picks each token's experts; an all-to-all sends the tokens to the ranks holding them and a second one brings
  the results back in order.

Every rank keeps a full copy of the parameters it does not split, so their gradients are averaged as in lesson 02.

    torchrun --nproc_per_node=2 solutions/09_context_and_experts.py --parallel cp --seq-len 64
    torchrun --nproc_per_node=4 solutions/09_context_and_experts.py --parallel ep --experts 4 --top-k 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from utils.distributed_utils import CourseError, destroy_process_group, print0, run_main, setup
from utils.training import base_parser, parse_args

# --------------------------------------------------------------------------------------------------
# Part 1: context parallelism. TODOs 1-5.
# --------------------------------------------------------------------------------------------------


def split_sequence(x: torch.Tensor, rank: int, world_size: int, split: str) -> torch.Tensor:
    # TODO 1: placeholder (context parallelism).
    raise NotImplementedError("TODO 1: placeholder (context parallelism)")


def todo_2():
    # TODO 2: placeholder (context parallelism).
    raise NotImplementedError("TODO 2: placeholder (context parallelism)")


def todo_3():
    # TODO 3: placeholder (context parallelism).
    raise NotImplementedError("TODO 3: placeholder (context parallelism)")


def todo_4():
    # TODO 4: placeholder (context parallelism).
    raise NotImplementedError("TODO 4: placeholder (context parallelism)")


def todo_5():
    # TODO 5: placeholder (context parallelism).
    raise NotImplementedError("TODO 5: placeholder (context parallelism)")


def add_context_options(parser):
    """--cp-split and any other option of context parallelism only."""


def train_context_parallel(args, rank: int, world_size: int, device: torch.device):
    raise CourseError("--parallel cp is not written yet")


# --------------------------------------------------------------------------------------------------
# Part 2: expert parallelism. TODOs 6-10.
# --------------------------------------------------------------------------------------------------


def todo_6():
    # TODO 6: placeholder (expert parallelism).
    raise NotImplementedError("TODO 6: placeholder (expert parallelism)")


def todo_7():
    # TODO 7: placeholder (expert parallelism).
    raise NotImplementedError("TODO 7: placeholder (expert parallelism)")


def todo_8():
    # TODO 8: placeholder (expert parallelism).
    raise NotImplementedError("TODO 8: placeholder (expert parallelism)")


def todo_9():
    # TODO 9: placeholder (expert parallelism).
    raise NotImplementedError("TODO 9: placeholder (expert parallelism)")


def todo_10():
    # TODO 10: placeholder (expert parallelism).
    raise NotImplementedError("TODO 10: placeholder (expert parallelism)")


def add_expert_options(parser):
    """--experts, --top-k, --capacity-factor, --aux-loss-weight and any other option of expert parallelism only."""


def train_expert_parallel(args, rank: int, world_size: int, device: torch.device):
    raise CourseError("--parallel ep is not written yet")


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast",))  # fp32 only: parity is exact
    parser.add_argument("--parallel", choices=("cp", "ep"), required=True, help="context or expert parallelism")
    parser.add_argument("--impl", choices=("scratch", "builtin"), default="scratch", help="from scratch or built in")
    add_context_options(parser)
    add_expert_options(parser)
    args = parse_args(parser)
    _, rank, device, world_size = setup(args.seed)
    if args.parallel == "cp":
        train_context_parallel(args, rank, world_size, device)
    else:
        train_expert_parallel(args, rank, world_size, device)
    print0("done")
    dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    run_main(main)
