"""Lesson 06's debugging lab (TODO 8): a gradient norm that every rank agrees on, and that is wrong.

Clipping by the global norm needs the norm of the whole model's gradient, and on a grid each rank holds a piece of
it: a stage, a TP shard of it, and copies of whatever is replicated. The lesson's
`global_gradient_norm(stage, place)` computes it on every rank. Here four ranks run one training step of the course
model in four layouts (pp, dp, tp): (2, 1, 2) and (1, 2, 2) from scratch (lesson 04's TP layers, lesson 05's
pipeline, the DP average) and (1, 2, 2) and (2, 2, 1) built in (DTensor TP, FSDP2 over dp, torch's pipeline
schedule), all the solution's code (lesson("06"), not the learner's TODOs), then call the learner's function after
the backward, as the lesson's training does. Every rank also computes one process's `clip_grad_norm_` on the whole
model and the same global batch (cheap at this size): the norm every layout must report. The group has a 5 s
timeout (a collective some rank never joins ends in seconds). Rank 0 writes every rank's outcome; the verdict, on one
process, names the cause from the squares each rank held (which pieces are copies, which shards). The notebook and
`make check` run the same file:

    torchrun --nproc_per_node=4 utils/lesson_06/lab.py exercises/06_3d_parallelism.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each layout's norms, the cause
"""

import itertools
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from utils.course import lab as course_lab  # noqa: E402
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402
from utils.lesson_06.placements import output_not_a_view  # noqa: E402
from utils.model import ModelConfig, build_model, loss_fn  # noqa: E402

RANKS = 4
LAYOUTS = (  # (impl, (pp, dp, tp)): every dimension at 2 in some layout, from scratch and built in
    ("scratch", (2, 1, 2)), ("scratch", (1, 2, 2)), ("built-in", (1, 2, 2)), ("built-in", (2, 2, 1)),
)  # fmt: skip
CONFIG = ModelConfig(seq_len=8, dim=16, n_heads=2, n_layers=2)  # 2 blocks: one per stage at pp 2
GLOBAL_BATCH, MICROBATCHES, SEED = 4, 2, 0
MAX_NORM = 1.0  # the clipping threshold the verdict quotes (a common default)
TIMEOUT_S = 5.0  # how long a rank waits in a collective before gloo gives up
TOLERANCE = 1e-5  # relative, against one process's norm (fp32 gradients added in another order)
DIMS = ("pp", "dp", "tp")
HINT = "take one element of a parameter TP keeps whole, and one of a TP shard: on how many ranks does each sit"


WAITED = f"waited until the {TIMEOUT_S:.0f} s timeout (or until a peer gave up)"


def describe(error: BaseException) -> str:
    return course_lab.describe_lab_error(error, WAITED)


def raised_first(failures: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(rank, error) pairs with the ranks that raised before those that waited: the others waited for them."""
    return sorted(failures, key=lambda failure: WAITED in failure[1])


def pieces(stage, place: dict[str, int]) -> dict[str, float]:
    """The squares of this rank's gradients, by what each piece is (for the verdict): key "<copies>|<sharded>|<mesh>",
    each a comma-separated list of dimensions: those it is replicated over, those that hold other pieces of it, and
    its DTensor's mesh (empty for a plain tensor)."""
    by_kind: dict[str, float] = {}
    for p in stage.parameters():
        if p.grad is None:
            continue
        copies, sharded = {"dp", "tp"}, set()
        if hasattr(p, "tp_dim"):
            copies, sharded = copies - {"tp"}, {"tp"}
        if isinstance(p.grad, DTensor):
            for dim, placement in zip(p.grad.device_mesh.mesh_dim_names, p.grad.placements):
                if not placement.is_replicate():
                    copies, sharded = copies - {dim}, sharded | {dim}
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        mesh = p.grad.device_mesh.mesh_dim_names if isinstance(p.grad, DTensor) else ()
        key = "|".join(",".join(sorted(dims)) for dims in (copies, sharded, mesh))
        by_kind[key] = by_kind.get(key, 0.0) + float(local.detach().double().pow(2).sum())
    return by_kind


def one_step(three_d, impl: str, shape: tuple[int, int, int], rank: int, inputs, targets):
    """This rank's stage after one training step's backward (and DP average) in layout `shape`, and its place."""
    layout = three_d.Layout(*shape)
    place = three_d.coordinates(rank, layout)
    model = build_model(CONFIG, seed=SEED)
    if impl == "scratch":
        grid = three_d.build_grid(rank, layout)
        three_d.tensor_parallel.parallelize_scratch(model, grid.groups["tp"])
        stage = three_d.pipeline.build_stage(model, place["pp"], layout.pp)
        steps = three_d.pipeline.SCRATCH_SCHEDULES["1f1b"](layout.pp, MICROBATCHES, place["pp"])
        mine, theirs = three_d.replica_batch(inputs, grid), three_d.replica_batch(targets, grid)
        shape_between = (len(mine) // MICROBATCHES, CONFIG.seq_len, CONFIG.dim)
        three_d.pipeline_step(stage, grid, steps, mine, theirs, MICROBATCHES, shape_between, inputs.device)
        three_d.average_gradients(stage.parameters(), grid.groups["dp"])
    else:  # as the lesson's training runs it: DTensor TP, FSDP2, torch's pipeline schedule
        options = dist.ProcessGroupGloo._Options()  # the mesh's groups give up after TIMEOUT_S too, as the lab's
        options._timeout = timedelta(seconds=TIMEOUT_S)
        overrides = {dim: ("gloo", options) for dim in DIMS}
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS, backend_override=overrides)
        stage = three_d.parallelize_builtin(model, mesh, place["pp"])
        if stage.last:
            output_not_a_view(stage)
        schedule = three_d.pipeline.build_builtin_schedule(
            [stage], [place["pp"]], layout.pp, mesh["pp"].get_group(), inputs.device, "gpipe", MICROBATCHES, loss_fn
        )
        grid = three_d.Grid(layout, rank, place, groups={}, members={})
        mine, theirs = three_d.replica_batch(inputs, grid), three_d.replica_batch(targets, grid)
        # FSDP2 averages the gradients over dp in its reduce-scatter, after the last micro-batch's backward.
        schedule.step(*((mine,) if stage.first else ()), **({"target": theirs, "losses": []} if stage.last else {}))
    return stage, place


def one_process_norm(inputs, targets) -> float:
    """clip_grad_norm_'s total norm on one process: the whole model, the whole global batch."""
    model = build_model(CONFIG, seed=SEED)
    loss_fn(model(inputs), targets).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def run_rank(global_gradient_norm, rank: int) -> dict:
    """Every layout's step on this rank, the learner's norm after it, and what the verdict needs to explain it."""
    three_d = lesson("06")
    data = torch.Generator().manual_seed(SEED)
    inputs, targets = (
        torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len), generator=data) for _ in "xy"
    )
    reference = one_process_norm(inputs, targets)
    outcome = {"reference": reference, "layouts": []}
    for impl, shape in LAYOUTS:
        stage, place = one_step(three_d, impl, shape, rank, inputs, targets)
        seen = {"impl": impl, "shape": list(shape), "place": place, "pieces": pieces(stage, place), "norm": None}
        outcome["layouts"].append(seen)
        try:
            norm = global_gradient_norm(stage, place)
            if isinstance(norm, DTensor):  # a norm computed on DTensor gradients: its value on every rank
                norm = norm.full_tensor()
            if not isinstance(norm, (int, float, torch.Tensor)) or isinstance(norm, torch.Tensor) and norm.numel() != 1:
                what = f"a tensor of shape {list(norm.shape)}" if isinstance(norm, torch.Tensor) else repr(norm)
                seen["error"] = f"global_gradient_norm returned {what}, not one number (a tensor or a float)"
            else:
                seen["norm"] = float(norm)
        except NotImplementedError as error:
            seen["error"] = f"not done: {error}"
        except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
            seen["error"] = f"global_gradient_norm {describe(error)}"
        if "error" in seen:
            break  # the group may be broken: the next layout's collectives would only wait
        del stage
    return outcome


def main():
    lab = course_lab.start_rank("06", "global_gradient_norm", ranks=RANKS)
    store, rank, world_size = lab.store, lab.rank, lab.world_size
    started = time.perf_counter()
    course_lab.join_lab_group(store, rank, world_size, TIMEOUT_S)
    try:
        outcome = run_rank(lab.learner.global_gradient_norm, rank)
    except Exception as error:  # noqa: BLE001 - a timeout, or a peer that gave up first
        outcome = {"reference": None, "layouts": [], "error": describe(error)}
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"tolerance": TOLERANCE, "max_norm": MAX_NORM}
    course_lab.write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------

# The ways a norm goes wrong on a grid, each as (which pieces a rank adds, what the words say). A rule maps a piece's
# (copies, sharded) dimensions to the dimensions on which only coordinate 0 adds it.
RULES = {
    "right": (lambda copies, sharded, mesh: copies, None),
    "everything": (
        lambda copies, sharded, mesh: set(),
        "every rank adds the squares of everything it holds, so a piece held by several ranks (a parameter TP keeps "
        "whole, a DP replica's copy) is counted once per copy",
    ),
    "tp copies": (
        lambda copies, sharded, mesh: copies - {"tp"},
        "a parameter TP keeps whole (norms, embeddings, head, row-parallel biases) is counted on every TP rank",
    ),
    "dp copies": (
        lambda copies, sharded, mesh: copies - {"dp"},
        "every DP replica adds its copy of the averaged gradients, so they count dp times",
    ),
    "tp shards": (
        lambda copies, sharded, mesh: copies | {"tp"},
        "only TP rank 0 adds its squares, but each TP rank holds a different shard: the others are missing",
    ),
    "dp shards": (
        lambda copies, sharded, mesh: copies | ({"dp"} & sharded),
        "only DP rank 0 adds FSDP2's shards, but each DP rank holds a different piece (a DTensor gradient whose "
        "placement on dp is Shard)",
    ),
    "shards": (
        lambda copies, sharded, mesh: copies | sharded,
        "only rank 0 of each dimension adds its squares, but a sharded piece (a TP shard; built in, a DTensor gradient "
        "whose placement is Shard) differs from rank to rank: the other ranks' pieces are missing",
    ),
    "mesh copies": (
        lambda copies, sharded, mesh: copies & mesh if mesh else copies,
        "built in, only the dimensions of a gradient's own mesh are checked for copies, but FSDP2 puts the parameters "
        "TP keeps whole on the dp mesh alone: their tp copies are in no placement, and each is counted",
    ),
    "stages": (
        lambda copies, sharded, mesh: copies | {"pp"},
        "only the first stage adds its squares, but each stage holds other parameters: the later stages' are missing",
    ),
}


def _kind(key: str) -> tuple[set, set, set]:
    """A piece's key back to its dimensions: (copies, sharded, its DTensor mesh's; empty for a plain tensor)."""
    return tuple(set(filter(None, dims.split(","))) for dims in key.split("|"))


def _added(layouts: list[dict], rule) -> list[float]:
    """Each rank's squares if it added its pieces by `rule`."""
    added = []
    for seen in layouts:
        total = 0.0
        for key, squares in seen["pieces"].items():
            if all(seen["place"][dim] == 0 for dim in rule(*_kind(key))):
                total += squares
        added.append(total)
    return added


def _candidate(layouts: list[dict], rule, summed: set) -> list[float]:
    """Each rank's norm if it added its pieces by `rule` and summed them over the ranks that differ from it only in
    the dimensions `summed` (all three: an all-reduce over the world)."""
    added, norms = _added(layouts, rule), []
    for seen in layouts:
        peers = [i for i, other in enumerate(layouts)
                 if all(other["place"][dim] == seen["place"][dim] for dim in DIMS if dim not in summed)]  # fmt: skip
        norms.append(math.sqrt(sum(added[i] for i in peers)))
    return norms


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(b), 1e-12)


def likely_causes(layouts: list[dict]) -> list[str]:
    """Every known mistake whose norms, rank by rank, are the learner's, in words, the likeliest first: an all-reduce
    over the world before one over a subgroup. A dimension of size 1 sums nothing: a group over it is left out, so
    that a missing all-reduce is not named as one over that dimension."""
    norms = [seen["norm"] for seen in layouts]
    real = {dim for dim in DIMS if any(seen["place"][dim] for seen in layouts)}  # the dimensions of size > 1
    found, tried = [], set()

    def matches(predicted, power=1):
        return all(_close(n, p**power, 1e-4) for n, p in zip(norms, predicted))

    for size, (name, (rule, words)) in itertools.product((3, 2, 1, 0), RULES.items()):
        for summed in map(set, itertools.combinations(DIMS, size)):
            effective = frozenset(summed & real)
            if (name, effective) in tried:
                continue
            tried.add((name, effective))
            predicted = _candidate(layouts, rule, summed)
            if effective == real:  # an all-reduce over the world
                if name == "right" and matches(predicted, 2):
                    found.append("the value returned is the sum of the squares, not its square root")
                elif name == "right" and matches([sum(map(math.sqrt, _added(layouts, rule)))] * len(layouts)):
                    found.append("each rank takes the square root before the all-reduce, which then adds the ranks' "
                                 "norms, not their squares")  # fmt: skip
                elif matches(predicted) and words:
                    found.append(words)
                continue
            if not matches(predicted):
                continue
            over = " and ".join(sorted(effective, key=DIMS.index))
            where = (f"the squares are summed over the {over} group only, so ranks that differ in another coordinate "
                     "(another stage, shard or replica) never add each other's pieces") if effective else (
                     "each rank's norm is its own pieces' alone: no collective adds the other ranks'")  # fmt: skip
            found.append(where if name == "right" else f"{words}; and {where}")
    return found


def named_causes(failing: list[list[dict]]) -> list[str]:
    """What to name for the failing layouts: the first cause that explains every one of them, else each one's first
    (a rule may fit one layout by chance: with dp 1, adding every copy looks like adding the TP copies)."""
    found = [likely_causes(layouts) for layouts in failing]
    common = [words for words in found[0] if all(words in other for other in found[1:])]
    return common[:1] or list(dict.fromkeys(causes[0] for causes in found if causes))


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per layout, then the cause): each layout's norms on every rank against one process's."""
    ranks, tolerance = record["ranks"], record["tolerance"]
    errors = raised_first([(rank, outcome["error"]) for rank, outcome in enumerate(ranks) if outcome.get("error")])
    if errors:
        return False, [f"rank {rank}: {error}" for rank, error in errors]
    reference = ranks[0]["reference"]
    lines, passed, failing = [], True, []
    for index, (impl, shape) in enumerate(LAYOUTS):
        name = f"{impl} {tuple(shape)}"
        layouts = [outcome["layouts"][index] for outcome in ranks if index < len(outcome["layouts"])]
        failed = raised_first([(rank, seen["error"]) for rank, seen in enumerate(layouts) if "error" in seen])
        if len(layouts) < len(ranks) or failed:
            lines += [f"{name}: rank {rank}: {error}" for rank, error in failed] or [f"{name}: not run"]
            passed = False
            break
        norms = [seen["norm"] for seen in layouts]
        if all(_close(norm, reference, tolerance) for norm in norms):
            lines.append(f"{name}: every rank's norm {norms[0]:.6f} = one process's {reference:.6f} (right)")
            continue
        passed = False
        if all(_close(norm, norms[0], 1e-9) for norm in norms):
            scale, right = (min(1.0, record["max_norm"] / norm) for norm in (norms[0], reference))
            ratio = norms[0] / reference
            lines.append(
                f"{name}: every rank's norm {norms[0]:.6f}, one process's {reference:.6f} (x{ratio:.3f}; "
                f"clipping at {record['max_norm']:g} would scale the gradients by {scale:.3f}, not {right:.3f})"
            )
        else:
            said = ", ".join(f"rank {rank} {tuple(seen['place'].values())} {seen['norm']:.6f}"
                             for rank, seen in enumerate(layouts))  # fmt: skip
            lines.append(f"{name}: the ranks disagree ({said}); one process's {reference:.6f}")
        failing.append(layouts)
    lines += [f"why: {cause}" for cause in named_causes(failing)] if failing else []
    return passed, lines


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every layout."""
    passed, lines = verdict(record)
    return None if passed else course_lab.failure_message(lines, todo, HINT)


if __name__ == "__main__":
    main()
