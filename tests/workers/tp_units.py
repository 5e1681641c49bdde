"""Lesson 04's checks one TODO at a time, under torchrun (2 ranks); rank 0 writes {check: "ok" or what is wrong}.

    torchrun --nproc_per_node=2 tests/workers/tp_units.py exercises/04_tensor_parallel.py results.json

TODOs 1, 2, 3 and 5: the learner's pieces against nn.Linear, a sum, a concatenation (utils/lesson_04/checks.py).
Each check depends on its own TODO only: the layers of TODOs 2 and 3 run with the reference solution's f and g,
the block (TODO 4) and the SP gradients (TODO 6) with the reference's layers, and are compared with the course
model on one process (utils/model.py): its loss and every gradient.
"""

import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.harness.blame import describe  # noqa: E402
from utils.course.lessons import lesson as course_lesson  # noqa: E402
from utils.course.lessons import load_script  # noqa: E402
from utils.distributed_utils import CourseError, destroy_process_group, setup  # noqa: E402
from utils.gather import full_gradients  # noqa: E402
from utils.lesson_04 import checks  # noqa: E402
from utils.model import ModelConfig, build_model, loss_fn  # noqa: E402

CONFIG = ModelConfig(seq_len=8, dim=16, n_heads=4, n_layers=2)
TOLERANCE = 1e-5  # a whole model's gradients in float32


def one_process_gradients(tokens, targets, tokens_kept=None):
    """Loss and gradients on one process; tokens_kept (a slice of the sequence): the final norm's gradients from
    those tokens only, as one rank of a sequence-parallel run holds them before the ranks' parts are summed."""
    model = build_model(CONFIG, seed=0)
    if tokens_kept is not None:
        mask = torch.zeros(1, CONFIG.seq_len, 1)
        mask[:, tokens_kept] = 1

        def masked(module, args, output):
            output.register_hook(lambda grad: grad * mask)

        model.norm.register_forward_hook(masked)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return float(loss), {name: p.grad for name, p in model.named_parameters()}


def compare_model(todo: int, lesson, scaffold, group, sequence_parallel: bool, sync):
    """Train one step's forward and backward of the course model parallelised by `lesson`, compare with one process."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len), generator=generator)
    loss_ref, grads_ref = one_process_gradients(tokens, targets)
    model = lesson.parallelize_scratch(build_model(CONFIG, seed=0), group, sequence_parallel)
    mode = "with" if sequence_parallel else "without"
    try:
        loss = loss_fn(model(tokens), targets)
    except RuntimeError as error:
        line = traceback.extract_tb(error.__traceback__)[-1].line or ""
        branch = next((b for b in ("mlp", "attention") if f"self.{b}(" in line), None)
        if not (sequence_parallel and branch and "must match the size" in str(error)):
            raise
        raise CourseError(  # the residual stream holds this rank's tokens; the region returned the whole sequence
            f"TODO {todo}: with SP, adding the {branch}'s output to the residual stream raised RuntimeError: "
            f"{str(error).splitlines()[0]}: likely the {branch}'s row-parallel layer does not reduce-scatter along "
            "the sequence (sequence_parallel not passed on to it)"
        ) from error
    loss.backward()
    sync(model, group)
    if abs(float(loss) - loss_ref) > TOLERANCE:
        raise CourseError(f"TODO {todo}: the loss {mode} SP is {float(loss):.6f}, one process's {loss_ref:.6f}")
    grads = full_gradients(model, group)
    n = dist.get_world_size(group)
    for name, want in reversed(grads_ref.items()):  # in backward's order: the first wrong one is nearest the cause
        got = grads.get(name)
        if got is None or got.shape != want.shape:
            raise CourseError(
                f"TODO {todo}: {mode} SP, {name}'s gradient is {None if got is None else list(got.shape)}"
            )
        wrong = (got - want).abs() > TOLERANCE
        if wrong.any():
            index = [int(i) for i in wrong.nonzero()[0]]
            first = (
                f"TODO {todo}: {mode} SP, backward first goes wrong at {name}: its gradient at {index} is "
                f"{float(got[tuple(index)]):.4f}, one process's {float(want[tuple(index)]):.4f}"
            )
            cause = gradient_cause(name, got, want, n, sequence_parallel)
            if sequence_parallel and name.startswith("norm."):  # SP's final norm: its gradient is summed by TODO 6
                per_rank = CONFIG.seq_len // n
                rank = dist.get_rank(group)
                _, partial = one_process_gradients(tokens, targets, slice(rank * per_rank, (rank + 1) * per_rank))
                if float((got - partial[name]).abs().max()) <= TOLERANCE:
                    cause = (
                        f": it is rank {rank}'s partial gradient (its own tokens only): the ranks' partial gradients "
                        "are not summed into it"
                    )
            raise CourseError(first + cause)


def gradient_cause(name: str, got, want, n: int, sequence_parallel: bool) -> str:
    """The likely cause, from the first parameter (in backward's order) whose gradient is wrong and by how much."""
    region = next((r for r in ("attn", "mlp") if f".{r}_norm." in name), None)
    where = {"attn": "attention", "mlp": "MLP"}.get(region)
    if float((got - n * want).abs().max()) <= TOLERANCE:
        if sequence_parallel and region is None:
            return f": {n} x one process's (a partial gradient summed over the ranks, then summed again)"
        return (
            f": {n} x one process's: the gradient entering the {where or 'region'} is summed over the ranks twice "
            "(is f applied more than once on the way in, e.g. by q, k and v as well as on the region's input?)"
        )
    if float((got - want / n).abs().max()) <= TOLERANCE:
        return f": 1/{n} of one process's: averaged over the ranks where they should be summed"
    if where:
        return (
            f": the gradient entering the {where} is not summed over the ranks: likely the {where}'s input does not "
            "pass through f"
        )
    return ""


def check_block(lesson, scaffold, group, device):
    """TODO 4 with the reference f/g, layers and SP pair (and its gradient all-reduce), with and without SP."""
    for sp in (False, True):
        compare_model(4, lesson, scaffold, group, sp, scaffold.allreduce_sequence_parallel_grads if sp else no_sync)


def check_sequence_parallel_grads(lesson, scaffold, group, device):
    """TODO 6 with the reference block and layers."""
    compare_model(6, lesson, scaffold, group, True, lesson.allreduce_sequence_parallel_grads)


def check_dtensor_refuses_sequence(lesson, scaffold, group, device):
    """apply_tensor_parallel refuses, with SP, a sequence length that the TP size does not divide."""
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size(group)
    config = ModelConfig(seq_len=n * 4 + 1, dim=16, n_heads=4, n_layers=1)
    mesh = init_device_mesh(device.type, (n,))
    try:
        lesson.apply_tensor_parallel(build_model(config), mesh, sequence_parallel=True)
    except CourseError as error:
        if f"--seq-len {config.seq_len}" not in str(error):
            raise
        return
    raise AssertionError(f"apply_tensor_parallel accepted --seq-len {config.seq_len} over {n} ranks with SP")


def no_sync(model, group):
    pass


PAIR = ("CopyToParallelRegion", "ReduceFromParallelRegion")  # the reference's f and g, for TODOs 2 and 3
LAYERS = PAIR + ("GatherSequence", "ReduceScatterSequence", "Split", "Gather", "ColumnParallelLinear")
LAYERS += ("RowParallelLinear",)
CHECKS = {  # name: (check, the learner's names replaced by the reference's first), in TODO order
    "todo1": (
        lambda lesson, scaffold, group, device: checks.check_f_and_g(
            lesson.CopyToParallelRegion, lesson.ReduceFromParallelRegion, group, device
        ),
        (),
    ),
    "todo5": (
        lambda lesson, scaffold, group, device: checks.check_sequence_pair(
            lesson.GatherSequence, lesson.ReduceScatterSequence, group, device
        ),
        (),
    ),
    "todo2": (
        lambda lesson, scaffold, group, device: checks.check_column(lesson.ColumnParallelLinear, group, device),
        PAIR,
    ),
    "todo3": (lambda lesson, scaffold, group, device: checks.check_row(lesson.RowParallelLinear, group, device), PAIR),
    "todo4": (check_block, LAYERS),
    "todo6": (check_sequence_parallel_grads, LAYERS + ("tensor_parallel_block",)),
    "dtensor_refuses_sequence": (check_dtensor_refuses_sequence, ()),
}


def main():
    lesson_path, out = sys.argv[1], sys.argv[2]
    _, rank, device, n = setup(0)
    lesson = load_script(lesson_path, "lesson04_learner")
    scaffold = course_lesson("04")
    group = dist.group.WORLD
    results = {}
    for name, (check, replaced) in CHECKS.items():
        for attribute in replaced:  # so that this check depends on its own TODO only
            setattr(lesson, attribute, getattr(scaffold, attribute))
        try:
            check(lesson, scaffold, group, device)
            results[name] = "ok"
        except NotImplementedError as error:
            results[name] = f"not done: {error}"
        except CourseError as error:
            results[name] = str(error)
        except Exception as error:  # noqa: BLE001 - report any failure under its TODO
            results[name] = describe(error)
    everyone = [None] * n
    dist.all_gather_object(everyone, results)
    if rank == 0:
        merged = {name: next((r[name] for r in everyone if r[name] != "ok"), "ok") for name in CHECKS}
        Path(out).write_text(json.dumps(merged, indent=2))
    destroy_process_group()


if __name__ == "__main__":
    main()
