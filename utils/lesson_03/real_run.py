"""What a real FSDP2 run adds to lesson 03's script, each shown on live ranks (the notebook's section 11):

- meta-device initialisation: build on `meta` (no memory), shard, `to_empty`, then fill the shards from rank 0's
  full weights (`broadcast_from_rank0`): equal to a normal init, and no rank ever held the full model;
- gradient clipping on sharded gradients: `clip_grad_norm_` over DTensor gradients equals one process's norm;
- gradient accumulation with `set_requires_gradient_sync(False)`: one reduce-scatter per step, not per micro-batch;
- what a parameter is after `fully_shard`: a DTensor (placements, local shard, full tensor);
- `CPUOffloadPolicy`, tried: what it does on this machine.

    torchrun --nproc_per_node=2 utils/lesson_03/real_run.py --metrics-out out.json

Rank 0 writes every rank's findings to --metrics-out. It runs on the CPU with gloo, even on a GPU node (the
notebook's outputs are CPU runs), which is also why CPUOffloadPolicy is only tried here.
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: setup() then picks gloo and the CPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torchrun: `import utils` from the course folder
    sys.path.insert(0, str(ROOT))

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from utils.collective_counter import CountCollectives  # noqa: E402
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group, setup  # noqa: E402
from utils.model import ModelConfig, TransformerLM, build_model, loss_fn  # noqa: E402

CONFIG = ModelConfig(seq_len=32, dim=27, n_heads=3, n_layers=3)  # the notebook's model: no size divides by 2
SEED, GLOBAL_BATCH, MAX_NORM = 1, 4, 0.05


def shard(model, mesh):
    """The lesson's own apply_fsdp (solutions/03_zero_fsdp.py): each block a unit, then the root."""
    return lesson("03").apply_fsdp(model, mesh)


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def batch(micro: int = 0):
    """(inputs, targets) of the global batch `micro`; rank r then takes its slice."""
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(100 + micro))  # fmt: skip
    return tokens[:, :-1], tokens[:, 1:]


def mine(tensors, rank, world_size):
    return [t.chunk(world_size)[rank] for t in tensors]


def largest_difference(model, reference) -> float:
    named = dict(reference.named_parameters())
    return max(float((full(p.detach()) - named[name].detach()).abs().max()) for name, p in model.named_parameters())


def meta_init(mesh, rank: int) -> dict:
    with torch.device("meta"):  # parameters with shapes and no memory: nothing is initialised yet
        model = TransformerLM(CONFIG)
    shard(model, mesh)
    device_after_shard = next(model.parameters()).device.type
    model.to_empty(device="cpu")  # memory for this rank's shards only, uninitialised
    weights = build_model(CONFIG, seed=SEED).state_dict() if rank == 0 else {}  # only rank 0 holds a full model
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    local = sum(p.to_local().numel() for p in model.parameters())
    return {
        "device_after_shard": device_after_shard,
        "max_difference": largest_difference(model, build_model(CONFIG, seed=SEED)),
        "local_params": local,
        "full_params": sum(p.numel() for p in model.parameters()),
    }


def clipping(mesh, rank: int, world_size: int) -> dict:
    model = shard(build_model(CONFIG, seed=SEED), mesh)
    inputs, targets = mine(batch(), rank, world_size)
    loss_fn(model(inputs), targets).backward()
    norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))  # a DTensor: every shard's part
    one = build_model(CONFIG, seed=SEED)  # one process, the whole batch
    loss_fn(one(batch()[0]), batch()[1]).backward()
    one_norm = torch.nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM)
    grads = {n: p.grad for n, p in one.named_parameters()}
    clipped = max(float((full(p.grad) - grads[n]).abs().max()) for n, p in model.named_parameters())
    return {
        "norm": float(norm),
        "one_process_norm": float(one_norm),
        "grad_type": type(next(model.parameters()).grad).__name__,
        "max_clipped_grad_difference": clipped,
    }


def accumulation(mesh, rank: int, world_size: int, micro_batches: int = 2) -> dict:
    """Reduce-scatter bytes of one step of `micro_batches` micro-batches, syncing every one or only the last."""
    result = {}
    for mode in ("every micro-batch", "last only"):
        model = shard(build_model(CONFIG, seed=SEED), mesh)
        with CountCollectives({"shard": mesh.get_group()}) as wire:
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                model.set_requires_gradient_sync(last or mode == "every micro-batch")
                inputs, targets = mine(batch(micro), rank, world_size)
                (loss_fn(model(inputs), targets) / micro_batches).backward()
        result[mode] = {
            "reduce_scatter_bytes": wire.bytes["shard"].get("reduce_scatter", 0),
            "grads": {n: full(p.grad) for n, p in model.named_parameters()},
        }
    one = build_model(CONFIG, seed=SEED)
    for micro in range(micro_batches):
        (loss_fn(one(batch(micro)[0]), batch(micro)[1]) / micro_batches).backward()
    for mode in result:
        grads = result[mode].pop("grads")
        result[mode]["max_difference"] = max(float((grads[n] - p.grad).abs().max()) for n, p in one.named_parameters())
    return result


def dtensor_look(mesh) -> dict:
    model = shard(build_model(CONFIG, seed=SEED), mesh)
    weight = model.blocks[0].attention.q_proj.weight  # 27 rows: the ranks' shards cannot be equal
    reference = build_model(CONFIG, seed=SEED).blocks[0].attention.q_proj.weight
    return {
        "type": type(weight).__name__,
        "placements": str(weight.placements),
        "mesh": str(weight.device_mesh),
        "shape": list(weight.shape),
        "local_shape": list(weight.to_local().shape),
        "full_equals_unsharded": bool(torch.equal(weight.full_tensor(), reference)),
    }


def cpu_offload(mesh, rank: int, world_size: int) -> dict:
    """fully_shard with CPUOffloadPolicy (shards, gradients and optimizer step on the host, copied to the
    accelerator for each unit's compute), one training step; what it raised, if it raised."""
    stage = "fully_shard"
    try:
        model = build_model(CONFIG, seed=SEED)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        stage = "forward and backward"
        inputs, targets = mine(batch(), rank, world_size)
        loss_fn(model(inputs), targets).backward()
        return {"error": None, "stage": None}
    except Exception as error:  # noqa: BLE001 - the notebook shows what happened
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"error": f"{type(error).__name__}: {text[:200]}", "stage": stage}


def main():
    # FSDP2 warns that the root returns a view (the head's output): the loss only reads it, never changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-out", type=Path, required=True)
    args = parser.parse_args()
    _, rank, device, world_size = setup(seed=0)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    findings = {
        "meta_init": meta_init(mesh, rank),
        "clipping": clipping(mesh, rank, world_size),
        "accumulation": accumulation(mesh, rank, world_size),
        "dtensor": dtensor_look(mesh),
    }
    findings["cpu_offload"] = cpu_offload(mesh, rank, world_size)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, findings)
    if rank == 0:
        args.metrics_out.write_text(json.dumps({"world_size": world_size, "ranks": everyone}, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    main()
