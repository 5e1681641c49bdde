"""Lesson 05's TODO 7 in one process, without TODO 1: the built-in schedule must give the whole batch's gradients.

    python tests/workers/pipeline_builtin_check.py solutions/05_pipeline_parallel.py

A world of one process (gloo) holds every stage of a model cut by hand; each built-in schedule runs one batch of
4 sequences as 2 micro-batches, and the parameters' gradients must equal those of the whole model on the whole
batch (the reference is the model itself, not the learner's code). Prints one line starting "TODO 7:" on failure.
"""

import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.harness.blame import describe  # noqa: E402
from utils.distributed_utils import wait_for_idle_threads  # noqa: E402
from utils.model import ModelConfig, build_model, loss_fn  # noqa: E402

CONFIG = ModelConfig(seq_len=16, dim=32, n_layers=2, n_heads=2)
M = 2


def check(script, schedule: str) -> str | None:
    """Why the built-in `schedule` is wrong, or None."""
    model, reference = build_model(CONFIG, seed=0), build_model(CONFIG, seed=0)
    generator = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len), generator=generator) for _ in "xy")
    loss_fn(reference(tokens), targets).backward()
    if schedule in script.MULTI_STAGE:  # two stages on this rank, one block each
        stages = [script.Stage(model, range(0, 1), True, False), script.Stage(model, range(1, 2), False, True)]
    else:
        stages = [script.Stage(model, range(0, 2), True, True)]
    indices = list(range(len(stages)))
    # The pipeline's group is a group of its own, not the world: in lesson 06 several pipelines run side by side,
    # each in its own group, and a stage built without it would talk to the world's ranks instead.
    pp_group = dist.new_group([0])
    try:
        pipeline = script.build_builtin_schedule(
            stages, indices, len(stages), pp_group, torch.device("cpu"), schedule, M, loss_fn
        )
        built = getattr(pipeline, "_stages", None) or [pipeline._stage]  # where torch's schedules keep them
        if any(stage.group is not pp_group for stage in built):
            return f"--schedule {schedule}: the stages were built without the pipeline's group (pp_group)"
        losses = []
        pipeline.step(tokens, target=targets, losses=losses)
    except NotImplementedError as error:
        return f"not done yet ({error})"
    except Exception as error:
        return f"--schedule {schedule}: " + describe(error, "build_builtin_schedule or its step")
    grads = [
        (name, p.grad, q.grad) for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())
    ]
    if missing := next((name for name, got, _ in grads if got is None), None):
        return f"--schedule {schedule}: {missing} got no gradient"
    differing = next(((name, got, want) for name, got, want in grads if not close(got, want)), None)
    if differing is None:
        return None
    name, first_got, first_want = differing
    # The known mistakes scale every gradient by the same factor: name one only when all of them are that multiple.
    why = ""
    if all(close(got, M * want) for _, got, want in grads):
        why = f": every gradient is m = {M} times the whole batch's: summed over the micro-batches, not averaged"
    elif all(close(got, want / M) for _, got, want in grads):
        why = f": every gradient is 1/m = 1/{M} of the whole batch's: divided by m twice (the schedule averages too)"
    every_got, every_want = (torch.cat([grad.flatten() for grad in column]) for column in list(zip(*grads))[1:])
    difference, ratio = largest_difference(first_got, first_want), float(every_got.norm() / every_want.norm())
    return (
        f"--schedule {schedule}: {name}.grad differs from the whole batch's by {difference:.1e} (norm ratio "
        f"{ratio:.2f}){why}"
    )


def largest_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max())


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return largest_difference(got, want) <= 1e-6


def main(path: str) -> int:
    spec = importlib.util.spec_from_file_location("lesson05", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            problems = [problem for schedule in script.SCHEDULES if (problem := check(script, schedule))]
        finally:
            dist.destroy_process_group()
            wait_for_idle_threads()  # gloo's threads let go of the last collective before Python exits
    for problem in problems[:1]:
        print(f"TODO 7: {problem}", flush=True)
    if not problems:
        print(f"built-in {', '.join(script.SCHEDULES)} on one process: the whole batch's gradients", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
