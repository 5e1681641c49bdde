"""Lesson 04's checks one TODO at a time, under torchrun (2 ranks); rank 0 writes {check: "ok" or what is wrong}.

    torchrun --nproc_per_node=2 tests/workers/tp_units.py exercises/04_tensor_parallel.py results.json

TODOs 1, 2, 3 and 5: the learner's pieces against nn.Linear, a sum, a concatenation (utils/lesson_04/checks.py).
Each check depends on its own TODO only: the layers of TODOs 2 and 3 run with the reference solution's f and g,
the block (TODO 4) and the SP gradients (TODO 6) with the reference's layers, and are compared with the course
model on one process (utils/model.py): its loss and every gradient.
"""

import json
import sys
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


def one_process_gradients(tokens, targets):
    model = build_model(CONFIG, seed=0)
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
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    sync(model, group)
    mode = "with" if sequence_parallel else "without"
    if abs(float(loss) - loss_ref) > TOLERANCE:
        raise CourseError(f"TODO {todo}: the loss {mode} SP is {float(loss):.6f}, one process's {loss_ref:.6f}")
    grads = full_gradients(model, group)
    for name, want in grads_ref.items():
        got = grads.get(name)
        if got is None or got.shape != want.shape:
            raise CourseError(
                f"TODO {todo}: {mode} SP, {name}'s gradient is {None if got is None else list(got.shape)}"
            )
        difference = float((got - want).abs().max())
        if difference > TOLERANCE:
            raise CourseError(
                f"TODO {todo}: {mode} SP, {name}'s gradient differs from one process's by {difference:.1e}"
            )


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
