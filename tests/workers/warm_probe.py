"""What a rank sees of its start: run by tests/test_warm_ranks.py under torchrun and on warm ranks.

    probe.py OUT_FOLDER [exit CODE | raise | hang | wait]
writes OUT_FOLDER/rank-R.json (environment, argv, sys.path's first entry, working directory, whether
the process group forms) and then exits as told: `exit CODE` every rank, `raise` rank 1 raises, `hang`
rank 1 sleeps, `wait` rank 0 sleeps while rank 1 exits 3.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from utils.distributed_utils import destroy_process_group, setup  # noqa: E402

folder, action = Path(sys.argv[1]), sys.argv[2:] or ["exit", "0"]
rank = int(os.environ.get("RANK", 0))
seen = {
    "environment": {name: os.environ[name] for name in sorted(os.environ) if not name.startswith("COURSE_WARM")},
    "argv": sys.argv,
    "path0": sys.path[1],  # [0] is the course root, inserted above
    "cwd": os.getcwd(),
    "main": __name__,
    "file": __file__,
}
if "WORLD_SIZE" in os.environ:
    setup(seed=0)
    tensor = __import__("torch").tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    seen["all_reduce"] = tensor.item()
(folder / f"rank-{rank}.json").write_text(json.dumps(seen))
print(f"rank {rank} done", flush=True)
if action[0] == "raise" and rank == 1:
    raise ValueError("rank 1 raises on purpose")
if action[0] == "hang" and rank == 1:
    time.sleep(600)
if action[0] == "wait":  # rank 0 waits for ever; rank 1 fails: the launcher must stop rank 0
    time.sleep(600) if rank == 0 else sys.exit(3)
if "WORLD_SIZE" in os.environ and action[0] == "exit":
    destroy_process_group()
sys.exit(int(action[1]) if action[0] == "exit" else 0)
