"""Run under torchrun by tests/test_01_collectives.py: every debugging-lab case of a lesson's script.

Each case runs in a fresh process group (gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL, a 5 s timeout, see
utils/course/lab.py for why), so a case that hangs or breaks the group leaves the next case a working one.
Rank 0 writes {case: [each rank's outcome]}.

    torchrun --nproc_per_node=3 tests/workers/lab_check.py LESSON.py OUT.json skip raise shapes swap branch
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the labs run on gloo, even on a GPU node (utils/course/lab.py says why)

import torch.distributed as dist  # noqa: E402

from utils.course.lab import LAB_TIMEOUT_S, WITHOUT_DETAIL, run_case, wait_for_everyone  # noqa: E402
from utils.course.lessons import load_script  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402


def join(store, prefix: str, rank: int, world_size: int, timeout_s: float):
    """A new gloo group under its own key prefix (a reused prefix would hand out the last group's addresses)."""
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def main():
    lesson_path, out_path, *cases = sys.argv[1:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    lesson = load_script(lesson_path, "lesson_lab")
    outcomes = {}
    for name in cases:
        wait_for_everyone(store, f"lab/{name}/start", world_size)
        dist.set_debug_level(dist.DebugLevel.OFF if name in WITHOUT_DETAIL else dist.DebugLevel.DETAIL)
        join(store, f"lab/{name}/", rank, world_size, LAB_TIMEOUT_S)
        outcomes[name] = run_case(lesson, name)
        dist.destroy_process_group()  # no barrier: the group may be broken
        wait_for_everyone(store, f"lab/{name}/end", world_size)
    dist.set_debug_level(dist.DebugLevel.OFF)
    join(store, "lab/results/", rank, world_size, 60)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, outcomes)
    if rank == 0:
        Path(out_path).write_text(json.dumps({name: [mine[name] for mine in everyone] for name in cases}))
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


if __name__ == "__main__":
    main()
