"""Lesson 02: N data-parallel ranks train exactly like one process with an N times larger batch.

pytest tests/test_02_data_parallel.py                      # the solution
pytest tests/test_02_data_parallel.py --target exercises   # your exercise (make check LESSON=02)

Each run is launched once, the first time a test needs it, and shared by the tests below. The
reference is the same script on one process with the global batch: 8 sequences per step.
"""

import re

import pytest
import torch

from tests.launch import ROOT, course_env, python, torchrun
from utils.make_exercises import make_exercise
from utils.metrics import param_checksum
from utils.model import ModelConfig, build_model, count_parameters

TOLERANCE = 1e-6  # fp32, SGD: N ranks and one process differ only by the order of additions
SMALL = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--optimizer", "sgd", "--log-every", "1"]
COMMON = [*SMALL, "--seq-len", "32", "--steps", "4"]
RUNS = {  # name: (processes, arguments); every one has a global batch of 8 sequences
    "one": (1, ["--batch-size", "8"]),
    "builtin2": (2, ["--batch-size", "4", "--ddp", "builtin"]),
    "scratch2": (2, ["--batch-size", "4", "--ddp", "scratch"]),
    "builtin4": (4, ["--batch-size", "2", "--ddp", "builtin"]),
    "scratch4": (4, ["--batch-size", "2", "--ddp", "scratch"]),
    "accum2": (2, ["--batch-size", "2", "--grad-accum", "2", "--ddp", "scratch"]),
}
PARALLEL = ["builtin2", "scratch2", "builtin4", "scratch4"]


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson02"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            folder.mkdir()
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            if nproc == 1:
                done[name] = python(lesson("02"), args, tmp_path=folder), folder
            else:
                done[name] = torchrun(lesson("02"), nproc, args, tmp_path=folder), folder
        return done[name]

    return launch


def finished(result, todo: int) -> dict:
    """The run's metrics, or a failure naming the TODO the run stopped at (else `todo`)."""
    stopped = re.search(r"TODO (\d+):", result.output)
    name = f"TODO {stopped.group(1)}" if stopped else f"checking TODO {todo}"
    assert result.returncode == 0, f"{name}: the run failed. Its last lines:\n{result.tail()}"
    return result.metrics


def weights(folder) -> dict:
    """The checkpoint's parameters, with any "module." prefix of a wrapper removed."""
    state = torch.load(folder / "model.pt", weights_only=True)["model"]
    return {name.removeprefix("module."): tensor for name, tensor in state.items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def check_recipe(result, metrics, expected: str):
    assert metrics["world_size"] == 2, f"TODO 1: the run had world size {metrics['world_size']}, not 2"
    assert metrics["global_batch_size"] == 8, (
        f"TODO 1: global batch = batch per rank x accumulation x ranks = 8, not {metrics['global_batch_size']}"
    )
    assert result.output.count("global batch 8") == 1, "TODO 1: print the recipe once, from rank 0 (print0)"
    assert expected in result.output, f"TODO 1: the recipe should read '{expected} ...'"


def test_todo1_global_batch_recipe(run):
    result, _ = run("builtin2")
    check_recipe(result, finished(result, 1), "8 sequences = 4 per rank x 1")


def test_todo2_distributed_sampler_gives_each_rank_its_share(run):
    one, ranks = finished(run("one")[0], 2), finished(run("builtin2")[0], 2)
    assert ranks["batches_per_epoch"] == one["batches_per_epoch"], (
        f"TODO 2: each of 2 ranks should get half the data per epoch ({one['batches_per_epoch']} batches of 4), "
        f"not {ranks['batches_per_epoch']}: give the DataLoader a DistributedSampler"
    )


@pytest.mark.parametrize("name", PARALLEL)
def test_todo3_ddp_wrap_matches_single_process(run, name):
    one_metrics, one_folder = finished(run("one")[0], 3), run("one")[1]
    result, folder = run(name)
    metrics = finished(result, 3)
    difference = max_difference(weights(folder), weights(one_folder))
    assert difference <= TOLERANCE, (
        f"TODO 3: after 4 SGD steps, {name} differs from one process by {difference:.1e} on some parameter "
        "(wrap the model so gradients are averaged across ranks; TODO 2 gives each rank different data)"
    )
    assert metrics["param_checksum"] == pytest.approx(one_metrics["param_checksum"], rel=1e-6), "TODO 3"


def test_todo4_set_epoch_reshuffles_every_epoch(lesson, tmp_path):
    """With --lr 0 the model never changes, so each step's loss depends only on the batch it saw:
    equal losses in epoch 1 and epoch 2 mean the same batches in the same order."""
    args = [*SMALL, "--seq-len", "256", "--batch-size", "128", "--steps", "12", "--lr", "0"]
    result = torchrun(lesson("02"), 2, [*args, "--log-dir", tmp_path / "runs"], tmp_path=tmp_path)
    metrics = finished(result, 4)
    per_epoch = metrics["batches_per_epoch"]
    assert per_epoch == 6, f"TODO 2: 1562 blocks over 2 ranks in batches of 128 make 6 batches, not {per_epoch}"
    first, second = metrics["losses"][:6], metrics["losses"][6:]
    assert first != second, "TODO 4: epoch 2 repeated epoch 1's batches: call sampler.set_epoch(epoch)"


def test_todo5_no_sync_accumulation_matches_one_large_batch(run):
    result, folder = run("accum2")
    metrics = finished(result, 5)
    check_recipe(result, metrics, "8 sequences = 2 per rank x 2")
    difference = max_difference(weights(folder), weights(run("one")[1]))
    assert difference <= TOLERANCE, f"TODO 5: 2 ranks x 2 micro-batches differ from one process by {difference:.1e}"
    params = metrics["bytes_per_rank"]["params"]
    assert metrics["allreduce_bytes_per_step"] == params, (
        f"TODO 5: {metrics['allreduce_bytes_per_step']:,.0f} bytes all-reduced per step for {params:,} bytes of "
        "gradients: the inner micro-steps must not communicate (model.no_sync())"
    )


@pytest.mark.parametrize("name", ["builtin2", "scratch4"])
def test_todo6_loss_is_averaged_across_ranks(run, name):
    """The first step's loss comes before any update: it depends only on the data and on the averaging."""
    one, ranks = finished(run("one")[0], 6), finished(run(name)[0], 6)
    assert ranks["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6), (
        f"TODO 6: the first logged loss {ranks['losses'][0]:.6f} should be the global batch's "
        f"{one['losses'][0]:.6f}: all-reduce the loss with ReduceOp.AVG before logging it"
    )
    # Later steps match too once the ranks' updates are averaged (TODO 3).
    assert ranks["losses"] == pytest.approx(one["losses"], rel=1e-5), f"TODO 3: {ranks['losses']} != {one['losses']}"


def test_todo7_checkpoint_saved_once_and_loads_into_a_plain_model(run):
    result, folder = run("builtin4")
    metrics = finished(result, 7)
    assert result.output.count("saved the model") == 1, "TODO 7: save (and say so) from rank 0 only"
    state = torch.load(folder / "model.pt", weights_only=True)
    model = build_model(ModelConfig(**state["config"]), seed=123)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise AssertionError(f"TODO 7: save model.module's state dict, without the wrapper's prefix: {error}") from None
    assert param_checksum(model) == pytest.approx(metrics["param_checksum"], rel=1e-12), "TODO 7"


@pytest.mark.parametrize("name", ["scratch2", "scratch4"])
def test_bytes_on_the_wire_per_step(run, name):
    """The hand-written DDP all-reduces each gradient once per step: parameters x 4 bytes (fp32)."""
    metrics = finished(run(name)[0], 3)
    n = metrics["world_size"]
    params = count_parameters(ModelConfig(seq_len=32, dim=32, n_layers=1, n_heads=2))
    assert metrics["bytes_per_rank"]["params"] == 4 * params
    assert metrics["allreduce_bytes_per_step"] == 4 * params, (
        f"TODO 3: --ddp scratch should all-reduce {4 * params:,} bytes per step (wrap the model in DataParallel), "
        f"not {metrics['allreduce_bytes_per_step']}"
    )
    assert metrics["bus_bytes_per_step"] == pytest.approx(2 * (n - 1) / n * 4 * params)


def test_rank0_prints_once_and_finishes(run):
    result, _ = run("scratch4")
    finished(result, 1)
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1, "print with print0: once, from rank 0"
    assert sum(line.startswith("step    4") for line in lines) == 1


def test_untouched_exercise_is_lesson_00_on_one_process_and_names_todo1_on_two(tmp_path):
    """The generated exercise (not your edited copy) runs as the single-device baseline, else stops at TODO 1."""
    solution = ROOT / "solutions" / "02_data_parallel.py"
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(make_exercise(solution.read_text(), solution.name)[0])
    env = course_env(PYTHONPATH=ROOT)  # the copy lives outside the course folder
    args = [*COMMON, "--batch-size", "8", "--log-dir", tmp_path / "runs"]
    untouched = python(exercise, args, tmp_path=tmp_path, env=env).check()
    baseline = python(ROOT / "solutions" / "00_setup_and_baseline.py", args, tmp_path=tmp_path).check()
    assert untouched.metrics["losses"] == baseline.metrics["losses"], "the untouched exercise should be lesson 00"
    two = torchrun(exercise, 2, args, timeout=90, env=env)
    assert two.returncode != 0 and "ERROR: TODO 1: the global batch recipe is not done yet" in two.output, two.tail()
