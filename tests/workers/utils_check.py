"""Run by tests/test_distributed_utils.py under torchrun (or srun-like variables): exercise utils/.

utils_check.py basics OUT_DIR   setup(), seeds, is_root_process, print0, save0
utils_check.py save OUT_DIR     FSDP2 model + AdamW, one step; sharded and full checkpoints
utils_check.py load OUT_DIR     a fresh model at another world size loads the sharded checkpoint
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from utils.distributed_utils import (
    destroy_process_group,
    is_root_process,
    load_sharded_model,
    print0,
    run_main,
    save0,
    save_full_model,
    save_sharded_model,
    setup,
)

SEED = 3


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def batch():
    """The same batch on every rank, so the sharded step equals one process's step."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)


def sharded(model, device, world_size):
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def basics(out_dir: Path):
    root_before_setup = is_root_process()
    local_rank, rank, device, world_size = setup(seed=SEED)
    draw = torch.rand(3).tolist()
    print0(f"print0 says hello from rank {rank}")
    save0({"written_by": rank}, out_dir / "save0.pt")
    facts = {
        "local_rank": local_rank,
        "rank": rank,
        "world_size": world_size,
        "device": device.type,
        "backend": dist.get_backend(),
        "draw": draw,
        "is_root": is_root_process(),
        "is_root_again": is_root_process(),  # the cached answer
        "root_before_setup": root_before_setup,
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, facts)
    destroy_process_group()
    if rank == 0:
        (out_dir / "basics.json").write_text(json.dumps(everyone))


def save(out_dir: Path):
    _, rank, device, world_size = setup(seed=SEED)
    model = sharded(small_model(seed=1), device, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    inputs, targets = batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    save_sharded_model(model, optimizer, out_dir / "sharded")
    save_full_model(model, optimizer, out_dir / "full.pt")
    destroy_process_group()


def load(out_dir: Path):
    _, rank, device, world_size = setup(seed=SEED)
    model = sharded(small_model(seed=2), device, world_size)  # other weights: the load must replace them
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    load_sharded_model(model, optimizer, out_dir / "sharded")
    save_full_model(model, optimizer, out_dir / f"reloaded-{world_size}.pt")
    destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    run_main({"basics": basics, "save": save, "load": load}[mode], out)
