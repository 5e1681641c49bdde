"""Lesson 07's debugging lab (TODO 6): a compression that trains without an error while the ranks drift apart.

Random-k sparsification sends k entries of each gradient, chosen at random, and no positions: every rank picks the
same k, so one all-reduce of k values adds up entries that belong together (PowerSGD's random projections rest on
the same agreement: its `random_seed`). The lesson's `random_k_positions(numel, k, seed, step, rank)` picks them.
Here each rank trains the course model on its own batch for a few SGD steps in a gloo group with a 5 s timeout (a
hang ends in seconds): backward, the k values at the learner's positions all-reduced, averaged and written back
there, the step; after each step every rank compares its parameters with rank 0's. Rank 0 writes every rank's
outcome. The notebook and `make check` run the same file:

    torchrun --nproc_per_node=3 utils/lesson_07/lab.py exercises/07_communication_efficient.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause

Why gloo even on a GPU node: a collective that never completes makes gloo raise after the timeout, which the lab
reports; NCCL's watchdog kills the process instead (utils/course/lab.py says more).
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.utils import parameters_to_vector, vector_to_parameters  # noqa: E402

from utils.course.lab import describe_lab_error, failure_message, join_lab_group, start_rank, write_outcomes  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402

RANKS, STEPS, RATIO, LR, SEED = 3, 3, 0.05, 0.5, 7  # the live run: 3 ranks, 3 SGD steps, 5% of the entries sent
TIMEOUT_S = 5.0  # how long a rank waits in a collective before gloo gives up
TOLERANCE = 1e-6  # the ranks' parameters against rank 0's (fp32: identical arithmetic gives identical bits)
HINT = (  # a question that leads to the cause, not the fix: the lab is the finding
    "an all-reduce adds up the i-th value of every rank: find which entry of its gradient each rank put at place i, "
    "and what decided that"
)


def positions_problem(positions, numel: int, k: int) -> str | None:
    """None when `positions` are k distinct entries of 0..numel-1 (a 1-D integer tensor), else what is wrong."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dim() != 1:
        kind = f"a {positions.dim()}-D {positions.dtype} tensor" if isinstance(positions, torch.Tensor) else "that"
        return f"returned {kind}, not a 1-D tensor of integer positions"
    if positions.numel() != k:
        return f"returned {positions.numel()} positions, not k = {k}"
    if int(positions.min()) < 0 or int(positions.max()) >= numel:
        return f"returned positions from {int(positions.min())} to {int(positions.max())}, outside 0..{numel - 1}"
    distinct = int(positions.unique().numel())
    if distinct < k:
        return f"repeats positions: {distinct} distinct of {k} (an entry sent twice is counted twice)"
    return None


def describe(error: BaseException) -> str:
    return describe_lab_error(error, f"waited until the {TIMEOUT_S:.0f} s timeout (or until a peer gave up)")


def run_rank(random_k_positions, rank: int, world_size: int) -> dict:
    """This rank's part of the lab: its own batch, the learner's positions, the lab's random-k exchange and SGD."""
    from utils.metrics import param_checksum
    from utils.model import ModelConfig, build_model, loss_fn

    outcome = {"error": None, "steps": []}
    config = ModelConfig(seq_len=8, dim=16, n_heads=2, n_layers=1)
    model = build_model(config, seed=0)  # the same initial model on every rank, as DDP's broadcast gives
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    k = max(1, round(RATIO * numel))
    outcome.update(numel=numel, k=k)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    torch.manual_seed(1000 + rank)  # the global generator per rank, as a script seeds dropout or augmentation
    previous = None
    for step in range(1, STEPS + 1):
        tokens, targets = (torch.randint(0, config.vocab_size, (2, config.seq_len), generator=data) for _ in "xy")
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        try:
            positions = random_k_positions(numel, k, SEED, step, rank)
            problem = positions_problem(positions, numel, k)
        except NotImplementedError as error:
            problem = f"not done: {error}"
        except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
            problem = describe(error) if isinstance(error, dist.DistError) else f"random_k_positions {describe(error)}"
        everyone_ok = torch.tensor([0 if problem else 1])
        dist.all_reduce(everyone_ok, op=dist.ReduceOp.MIN)
        if problem or not everyone_ok.item():
            outcome["error"] = problem or "stopped: another rank's random_k_positions failed"
            break
        positions = positions.long()
        gathered = [torch.empty_like(positions) for _ in range(world_size)]
        dist.all_gather(gathered, positions)  # for the verdict only: random-k itself sends no positions
        with torch.no_grad():
            gradient = parameters_to_vector([p.grad for p in params])
            values = gradient[positions].contiguous()
            dist.all_reduce(values)  # k numbers per rank on the wire
            update = torch.zeros_like(gradient)
            update[positions] = values / world_size
            flat = parameters_to_vector(params) - LR * update
            vector_to_parameters(flat, params)
            reference = flat.clone()
            dist.broadcast(reference, 0)
        outcome["steps"].append({
            "loss": loss.item(),
            "difference": float((flat - reference).abs().max()),
            "same_positions": torch.equal(positions, gathered[0]),  # as rank 0's
            "new_positions": previous is None or not torch.equal(positions.sort().values, previous),
            "checksum": param_checksum(model),
        })  # fmt: skip
        previous = positions.sort().values
    return outcome


def main():
    lab = start_rank("07", "random_k_positions")
    learner, store, rank, world_size = lab.learner, lab.store, lab.rank, lab.world_size
    started = time.perf_counter()
    join_lab_group(store, rank, world_size, TIMEOUT_S)
    try:
        outcome = run_rank(learner.random_k_positions, rank, world_size)
    except Exception as error:  # noqa: BLE001 - a timeout, or a peer that gave up first
        outcome = {"error": describe(error), "steps": []}
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"steps": STEPS, "ratio": RATIO, "tolerance": TOLERANCE}
    write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rank, then the cause): what each rank saw, step by step, and whether it is right."""
    lines, passed, causes, others = [], True, [], []
    for rank, outcome in enumerate(record["ranks"]):
        steps = outcome["steps"]
        losses = " ".join(f"{step['loss']:.3f}" for step in steps)
        head = f"rank {rank}: " + (f"losses {losses}, " if steps else "")  # for the lines that say what went wrong
        if outcome["error"]:
            lines.append(f"{head}{outcome['error']}")
            passed = False
            continue
        drift = next(((i, s) for i, s in enumerate(steps, 1) if s["difference"] > record["tolerance"]), None)
        if drift:
            i, step = drift
            lines.append(f"{head}its parameters differ from rank 0's after step {i} by {step['difference']:.1e} "
                         f"(checksum {step['checksum']:.6f}), without any error")  # fmt: skip
            passed = False
        elif rank:
            lines.append(f"rank {rank}: parameters equal rank 0's after every step (right)")
        else:  # right only if every other rank ends equal to it: known once they are all read (below)
            lines.append(f"rank {rank}: the reference the others are compared with")
        differ = [i for i, step in enumerate(steps, 1) if not step["same_positions"]]
        if differ:
            others.append((rank, differ[0]))
        repeated = [i for i, step in enumerate(steps, 1) if not step["new_positions"]]
        if repeated and rank == 0:
            lines[-1] = f"{head}the reference the others are compared with"
            causes.append(f"rank 0 sent the same k positions at step {repeated[0]} as at the step before: the other "
                          "entries never train")  # fmt: skip
            passed = False
    if passed and lines[0] == "rank 0: the reference the others are compared with":
        lines[0] += " (right)"
    if others:
        ranks, first = ", ".join(str(rank) for rank, _ in others), min(step for _, step in others)
        causes.insert(0, f"rank{'s' * (len(others) > 1)} {ranks} picked other positions than rank 0 (from step "
                      f"{first}), so the all-reduce added up values of different entries")  # fmt: skip
    lines += [f"why: {cause}" for cause in causes]
    return passed, lines


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    return None if passed else failure_message(lines, todo, HINT)


if __name__ == "__main__":
    main()
