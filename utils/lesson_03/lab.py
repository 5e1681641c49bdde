"""Lesson 03's debugging lab (TODO 8): a ZeRO-3 unit that backward finds freed, because no hook gathered it again.

The lab's model is small and its blocks return a dict, {"hidden": ..., "aux_loss": ...}, as library models often
do (a mixture-of-experts block adds its router's balance loss). It is wrapped in the course's `Zero3`
(solutions/03_zero_fsdp.py), given the learner's `output_tensors` to find the tensors to hook: so the lab checks
TODO 8 alone, whatever the state of TODOs 4-6. Each rank trains one step on its slice of a batch, and
returns the squared norm of the averaged gradient, which must equal one process's on the whole batch.

    torchrun --nproc_per_node=3 utils/lesson_03/lab.py exercises/03_zero_fsdp.py --metrics-out lab.json

Like the other labs (utils/course/lab.py says why): gloo even on a GPU node, a 5 s timeout on the collectives, so a
wrong fix that leaves a rank waiting ends within seconds. Rank 0 writes every rank's outcome to --metrics-out.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torchrun: `import utils` from the course folder
    sys.path.insert(0, str(ROOT))

from utils.course.lab import LAB_TIMEOUT_S, describe_error, first_cause  # noqa: E402
from utils.course.lessons import lesson, load_script  # noqa: E402
from utils.distributed_utils import wait_for_idle_threads  # noqa: E402

HINT = (  # a question that leads to the cause, not the fix: the lab is the finding
    "print what the lab's block returns and what output_tensors gives back for it: which of its tensors got the "
    "hook that gathers the unit again before backward?"
)
TOLERANCE = 1e-5  # relative: 3 ranks and one process differ only by the order of additions (fp32)
DIM, BLOCKS, BATCH = 8, 2, 6  # the batch divides by 1, 2 and 3 ranks: every rank's slice has the same size


class LabBlock(nn.Module):
    """A residual MLP block that also returns an auxiliary loss from its own router layer, in a dict."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, 4)  # used only by the auxiliary loss

    def forward(self, x):
        hidden = x + torch.tanh(self.mlp(x))
        balance = self.router(x).softmax(-1).pow(2).sum(-1).mean()  # 1/4 when the 4 routes are used evenly
        return {"hidden": hidden, "aux_loss": balance}


class LabModel(nn.Module):
    def __init__(self, dim: int = DIM, n_blocks: int = BLOCKS):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(LabBlock(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        hidden, aux = self.embed(x), 0.0
        for block in self.blocks:
            out = block(hidden)
            hidden, aux = out["hidden"], aux + out["aux_loss"]
        return self.head(hidden), aux


def lab_batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 1, generator=generator)


def lab_loss(model, inputs, targets):
    prediction, aux = model(inputs)
    return nn.functional.mse_loss(prediction, targets) + 0.1 * aux


def expected_squared_norm() -> float:
    """One process, the whole batch, no sharding: the squared norm of the gradient (float64 sum)."""
    torch.manual_seed(0)
    model = LabModel()
    lab_loss(model, *lab_batch()).backward()
    return sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())


def run_lab(zero3_class, output_tensors) -> dict:
    """On every rank: one ZeRO-3 step of the lab's model in `zero3_class` (the course's Zero3), which finds the
    tensors to hook with `output_tensors` (the learner's). {"value", "error", "seconds", "events"}: events are
    the unit gathers and frees, in order."""
    import torch.distributed as dist

    if output_tensors is None:
        return {"value": None, "error": "not done: the script has no output_tensors", "seconds": 0, "events": []}
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the same model (the one expected_squared_norm trains)
    model = zero3_class(LabModel(), output_tensors=output_tensors)
    model.timeline = []
    inputs, targets = (t.chunk(world_size)[rank] for t in lab_batch())
    start = time.perf_counter()
    try:
        lab_loss(model, inputs, targets).backward()
        model.finish_gradient_synchronization()  # idempotent: every unit reduced and freed
        squared = torch.tensor(sum(float(s.grad.double().pow(2).sum()) for s in model.shards if s.grad is not None))
        dist.all_reduce(squared)  # the shards tile the gradient (padding is 0): their sum is the full norm
        value, error = float(squared), None
    except NotImplementedError as failure:
        value, error = None, f"not done: {failure}"
    except Exception as failure:  # noqa: BLE001 - the lab reports whatever the learner's code raised
        value, error = None, describe(failure)
    events = [f"{name} {event}" for name, event, _ in model.timeline]
    return {"value": value, "error": error, "seconds": time.perf_counter() - start, "events": events}


def describe(error: BaseException) -> str:
    text = str(error)
    if "out of bounds for storage of size 0" in text:
        shape = text.split("sizes ", 1)[1].split("]", 1)[0] + "]" if "sizes " in text else "?"
        return (
            f"raised RuntimeError in backward: a parameter of shape {shape} was read from a freed buffer "
            "(storage of size 0)"
        )
    return describe_error(error)


def verdict(outcomes: list[dict]) -> tuple[bool, list[str]]:
    """(passed, one line per rank): each rank's gradient norm or error, and what backward gathered again."""
    expected, lines, passed = expected_squared_norm(), [], True
    for rank, outcome in enumerate(outcomes):
        if outcome["error"]:
            passed = False
            lines.append(f"rank {rank}: {outcome['error']}")
        elif abs(outcome["value"] - expected) > TOLERANCE * expected:
            passed = False
            lines.append(f"rank {rank}: squared gradient norm {outcome['value']:.6f}, one process's {expected:.6f}")
        else:
            lines.append(f"rank {rank}: squared gradient norm {outcome['value']:.6f}, as one process's (right)")
    return passed, lines


def gathered_again(outcome: dict) -> str:
    """The units that were gathered again after being freed (in backward), from the rank's events."""
    freed, again = set(), []
    for event in outcome["events"]:
        unit, _, what = event.rpartition(" ")
        if what == "free":
            freed.add(unit)
        elif unit in freed and unit not in again:
            again.append(unit)
    return ", ".join(again) if again else "none"


def failure(outcomes: list[dict], todo: int = 8) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the first rank's problem, a hint, then
    what every rank did."""
    passed, lines = verdict(outcomes)
    if passed:
        return None
    if any(o["error"] and o["error"].startswith("not done") for o in outcomes):
        return f"ERROR: TODO {todo}: lab, a unit never gathered again is not done yet"
    return (
        f"TODO {todo}: {first_cause(lines)}. Hint: {HINT}.\nUnits gathered again after being freed, on rank 0: "
        f"{gathered_again(outcomes[0])}\nEvery rank:\n" + "\n".join(lines)
    )


def main():
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path, help="the lesson's script whose output_tensors to use")
    parser.add_argument("--metrics-out", type=Path, required=True)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(  # torchrun's own store: it outlives a process group that a failed step broke
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore("zero_lab/group/", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=LAB_TIMEOUT_S))  # fmt: skip
    learner = load_script(args.script, "zero_lab_learner")
    # the solution's Zero3 (TODOs 4-6 right whatever the exercise's state), the learner's output_tensors (TODO 8)
    outcome = run_lab(lesson("03").Zero3, getattr(learner, "output_tensors", None))
    store.set(f"zero_lab/{rank}", json.dumps(outcome))  # through the store: a failed step may break the group
    if rank == 0:
        store.wait([f"zero_lab/{r}" for r in range(world_size)], timedelta(seconds=60))
        outcomes = [json.loads(store.get(f"zero_lab/{r}")) for r in range(world_size)]
        args.metrics_out.write_text(json.dumps({"outcomes": outcomes, "world_size": world_size}))
    store.add("zero_lab/done", 1)  # every rank here before any leaves the group (gloo's teardown needs it)
    deadline = time.monotonic() + 60
    while store.add("zero_lab/done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()
    wait_for_idle_threads()  # gloo's threads let go of the last collective before Python exits


if __name__ == "__main__":
    main()
