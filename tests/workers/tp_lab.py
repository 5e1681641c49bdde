"""Run under torchrun by tests/test_04_tensor_parallel.py: lesson 04's debugging lab (TODO 8, utils/lesson_04/lab.py).

Every rank runs the lesson's train_parallel_mlp in a gloo group with a 5 s timeout (a learner's collective that some
ranks skip ends in an error, not a hang) and puts its outcome in torchrun's store; rank 0 writes [each rank's outcome].

    torchrun --nproc_per_node=2 tests/workers/tp_lab.py exercises/04_tensor_parallel.py OUT.json
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the labs run on gloo, even on a GPU node (utils/course/lab.py says why)

import torch.distributed as dist  # noqa: E402

from utils.course.lab import LAB_TIMEOUT_S, wait_for_everyone  # noqa: E402
from utils.course.lessons import load_script  # noqa: E402
from utils.distributed_utils import wait_for_idle_threads  # noqa: E402
from utils.lesson_04.lab import run_case  # noqa: E402


def main():
    lesson_path, out_path = sys.argv[1:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    lesson = load_script(lesson_path, "lesson04_lab")
    reference = load_script(ROOT / "solutions" / "04_tensor_parallel.py", "lesson04_reference")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("tp_lab/", store), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=LAB_TIMEOUT_S),
    )  # fmt: skip
    store.set(f"tp_lab/outcome/{rank}", json.dumps(run_case(lesson, reference)))
    wait_for_everyone(store, "tp_lab/done", world_size)  # every rank here before any tears its group down
    dist.destroy_process_group()
    wait_for_idle_threads()  # gloo's threads let go of the last collective before Python exits
    if rank == 0:
        outcomes = [json.loads(store.get(f"tp_lab/outcome/{r}")) for r in range(world_size)]
        Path(out_path).write_text(json.dumps(outcomes))


if __name__ == "__main__":
    main()
