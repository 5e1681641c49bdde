"""Checks of utils/collective_counter.py under torchrun (2 ranks): each collective of torch.distributed, its
coalesced form, all-to-all, the functional collectives DTensor uses, and a DTensor redistribute, one phase each.
Rank 0 writes the counter's table, and what self_check said with and without the c10d all-reduce's name, as JSON.

    torchrun --nproc_per_node=2 tests/workers/collective_counter_check.py out.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

from utils import collective_counter  # noqa: E402
from utils.collective_counter import CollectiveCounter  # noqa: E402
from utils.distributed_utils import CourseError, destroy_process_group, setup  # noqa: E402


def ones(n: int) -> torch.Tensor:
    return torch.ones(n)  # n float32 values: 4 n bytes


def main():
    out = Path(sys.argv[1])
    _, rank, device, world_size = setup(0)
    assert world_size == 2, "run on 2 ranks"
    group = dist.group.WORLD
    mesh = init_device_mesh(device.type, (world_size,))
    sharded = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    operations = {  # each returns nothing; functional results are used (+ 0) so that they are waited for
        "all_reduce": lambda: dist.all_reduce(ones(4)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([ones(4), ones(4)]),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(ones(8), ones(4)),
        "all_gather": lambda: dist.all_gather([ones(4), ones(4)], ones(4)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(ones(4), ones(8)),
        "all_to_all_single": lambda: dist.all_to_all_single(ones(8), ones(8)),
        "all_to_all": lambda: dist.all_to_all([ones(4), ones(4)], [ones(4), ones(4)]),
        "broadcast": lambda: dist.broadcast(ones(4), 0),
        "functional all_reduce": lambda: funcol.all_reduce(ones(4), "sum", group) + 0,
        "functional all_gather": lambda: funcol.all_gather_tensor(ones(4), 0, group) + 0,
        "functional all_gather (autograd)": lambda: funcol.all_gather_tensor_autograd(ones(4), 0, group) + 0,
        "functional reduce_scatter": lambda: funcol.reduce_scatter_tensor(ones(8), "sum", 0, group) + 0,
        "functional all_to_all": lambda: funcol.all_to_all_single(ones(8), None, None, group) + 0,
        "functional all_reduce_coalesced": lambda: [
            t + 0 for t in funcol.all_reduce_coalesced([ones(4)] * 2, "sum", group)
        ],
        "functional all_gather_coalesced": lambda: [
            t + 0 for t in funcol.all_gather_into_tensor_coalesced([ones(4)] * 2, group)
        ],
        "functional reduce_scatter_coalesced": lambda: [
            t + 0 for t in funcol.reduce_scatter_tensor_coalesced([ones(8)] * 2, "sum", [0, 0], group)
        ],
        "DTensor Shard(0) -> Replicate()": lambda: sharded.redistribute(mesh, [Replicate()]).to_local() + 0,
        "no collective": lambda: ones(4) * 2,
    }
    counter = CollectiveCounter()
    for name, operation in operations.items():
        with counter.phase(name):
            operation()
    result = {"table": counter.table(), "phases": list(operations)}
    counter.self_check(device)
    result["self_check"] = "passed"
    removed = collective_counter.KINDS["c10d"].pop("allreduce_")  # as if a release renamed the op
    try:
        counter.self_check(device)
        result["self_check_without_name"] = "passed"
    except CourseError as error:
        result["self_check_without_name"] = str(error)
    collective_counter.KINDS["c10d"]["allreduce_"] = removed
    try:  # a collective on a tensor that is not on the expected device: refused by name
        with CollectiveCounter(device=torch.device("meta")):
            dist.all_reduce(ones(4))
        result["wrong_device"] = "accepted"
    except CourseError as error:
        result["wrong_device"] = str(error)
    with CollectiveCounter(device=device):
        sharded.redistribute(mesh, [Replicate()]).to_local() + 0  # DTensor's functional collective, on `device`
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    main()
