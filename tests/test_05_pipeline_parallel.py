"""Lesson 05: pipeline stages with micro-batches train exactly like one process, with the bubble the formula says.

pytest tests/test_05_pipeline_parallel.py                      # the solution
pytest tests/test_05_pipeline_parallel.py --target exercises   # your exercise (make check LESSON=05)

The schedules, the bubble formula and the communication plan are checked in pure Python (no processes). The runs
are launched once each, the first time a test needs them, and shared. The reference is the same script on one
process with one micro-batch. Timings are noisy on a shared CPU: no test asserts on one.
"""

import argparse
import importlib.util
import re
from fractions import Fraction

import pytest
import torch

from tests.launch import ROOT, course_env, finished, python, torchrun
from utils.distributed_utils import CourseError
from utils.make_exercises import make_exercise

TOLERANCE = 1e-6  # fp32, SGD: stages and one process differ only by the order of additions
COMMON = [
    "--dim", "32", "--n-layers", "4", "--n-heads", "2", "--seq-len", "32", "--steps", "3",
    "--batch-size", "8", "--optimizer", "sgd", "--log-every", "1",
]  # fmt: skip
RUNS = {  # name: (processes, arguments); every one trains on the same batches of 8 sequences
    "one": (1, ["--microbatches", "1"]),
    "gpipe2": (2, ["--schedule", "gpipe", "--microbatches", "4"]),
    "1f1b2": (2, ["--schedule", "1f1b", "--microbatches", "4"]),
    "1f1b4": (4, ["--schedule", "1f1b", "--microbatches", "2"]),  # fewer micro-batches than stages
    "builtin_gpipe2": (2, ["--pp-impl", "builtin", "--schedule", "gpipe", "--microbatches", "4"]),
    "builtin_interleaved2": (2, ["--pp-impl", "builtin", "--schedule", "interleaved", "--microbatches", "4"]),
    "builtin_1f1b4": (4, ["--pp-impl", "builtin", "--schedule", "1f1b", "--microbatches", "4"]),
}
SCRATCH = ["gpipe2", "1f1b2", "1f1b4"]
BUILTIN = ["builtin_gpipe2", "builtin_interleaved2", "builtin_1f1b4"]


@pytest.fixture(scope="module")
def script(lesson):
    """The lesson script imported as a module (its functions, without running main)."""
    path = lesson("05")
    spec = importlib.util.spec_from_file_location("lesson05", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson05"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            folder.mkdir()
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            if nproc == 1:
                done[name] = python(lesson("05"), args, tmp_path=folder), folder
            else:
                done[name] = torchrun(lesson("05"), nproc, args, tmp_path=folder), folder
        return done[name]

    return launch


def call(todo: int, function, *args):
    """function(*args), or a failure naming the TODO when the exercise has not done it yet."""
    try:
        return function(*args)
    except NotImplementedError as error:
        pytest.fail(f"TODO {todo}: not done yet ({error})", pytrace=False)


def weights(folder) -> dict:
    return torch.load(folder / "model.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def rendezvous_completes(plans) -> bool:
    """Do the ranks' communication plans finish if an operation completes only once its partner's batch is posted
    (the strictest rule: an NCCL send may wait for its receive)? plans[r] = batches of (op, peer, what, mb)."""
    posted_in = {}  # (src, dst, what, mb, op) -> (rank, batch index)
    for rank, plan in enumerate(plans):
        for index, batch in enumerate(plan):
            for op, peer, what, mb in batch:
                src, dst = (rank, peer) if op == "send" else (peer, rank)
                posted_in[(src, dst, what, mb, op)] = (rank, index)
    for src, dst, what, mb, op in posted_in:
        partner = "recv" if op == "send" else "send"
        assert (src, dst, what, mb, partner) in posted_in, f"TODO 4: rank {src}'s {what} {mb} has no partner {partner}"
    position = [0] * len(plans)
    while any(position[r] < len(plans[r]) for r in range(len(plans))):
        moved = False
        for rank, plan in enumerate(plans):
            if position[rank] == len(plan):
                continue
            ready = True
            for op, peer, what, mb in plan[position[rank]]:
                src, dst = (rank, peer) if op == "send" else (peer, rank)
                peer_rank, peer_batch = posted_in[(src, dst, what, mb, "recv" if op == "send" else "send")]
                ready &= position[peer_rank] >= peer_batch
            if ready:
                position[rank] += 1
                moved = True
        if not moved:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Pure Python: partition, schedules, bubble, communication plan
# ---------------------------------------------------------------------------------------------------------------


def test_todo1_partition_is_balanced_and_refuses_more_stages_than_blocks(script):
    for n_layers in range(1, 13):
        for n_stages in range(1, n_layers + 1):
            ranges = call(1, script.partition, n_layers, n_stages)
            sizes = [end - start for start, end in ranges]
            assert len(ranges) == n_stages and ranges[0][0] == 0 and ranges[-1][1] == n_layers, (
                f"TODO 1: partition({n_layers}, {n_stages}) = {ranges} must cover blocks 0..{n_layers - 1}"
            )
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"TODO 1: {ranges} is not contiguous"
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, f"TODO 1: {ranges} is not balanced"
    with pytest.raises(CourseError, match="--n-layers"):
        script.partition(2, 3)


def test_todo2_gpipe_steps_and_bubble_formula(script):
    assert call(2, script.gpipe_steps, 3, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)], (
        "TODO 2: GPipe is every forward, then every backward, micro-batches in order"
    )
    for p in range(1, 7):
        for m in range(1, 10):
            _, bubble = script.simulate("gpipe", p, m)
            assert bubble == Fraction(p - 1, m + p - 1), f"TODO 2: GPipe p={p} m={m}: idle {bubble} != (p-1)/(m+p-1)"
            assert all(script.in_flight(script.gpipe_steps(p, m, r)) == m for r in range(p))


def test_todo3_1f1b_steps_bounded_memory_and_bubble_formula(script):
    for p in range(1, 7):
        for m in range(1, 10):
            for rank in range(p):
                steps = call(3, script.one_f_one_b_steps, p, m, rank)
                assert sorted(steps) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]), (
                    f"TODO 3: p={p} m={m} rank {rank}: every micro-batch needs one F and one B, got {steps}"
                )
                assert [mb for kind, mb in steps if kind == "F"] == list(range(m)), "TODO 3: forwards in order"
                assert all(steps.index(("F", i)) < steps.index(("B", i)) for i in range(m)), "TODO 3: F before B"
                warmup = next((i for i, (kind, _) in enumerate(steps) if kind == "B"), len(steps))
                assert warmup == min(p - rank, m), (
                    f"TODO 3: p={p} m={m} rank {rank}: {min(p - rank - 1, m)} warm-up forwards, then F B: {steps}"
                )
                assert script.in_flight(steps) == min(p - rank, m), f"TODO 3: rank {rank} holds too many: {steps}"
            _, bubble = script.simulate("1f1b", p, m)
            assert bubble == Fraction(p - 1, m + p - 1), f"TODO 3: 1F1B p={p} m={m}: idle {bubble} != (p-1)/(m+p-1)"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_todo4_point_to_point_plan_pairs_up_and_never_deadlocks(script, schedule):
    steps_of = script.SCRATCH_SCHEDULES[schedule]
    for p in range(1, 7):
        for m in range(1, 10):
            plans = [call(4, script.p2p_plan, steps_of(p, m, r), r, p) for r in range(p)]
            sent = sum(op == "send" for plan in plans for batch in plan for op, *_ in batch)
            assert sent == 2 * m * (p - 1), (
                f"TODO 4: p={p} m={m}: each of {p - 1} links carries m activations forward and m gradients back"
            )
            assert rendezvous_completes(plans), (
                f"TODO 4: {schedule} p={p} m={m}: the ranks wait for each other forever; post each step's sends "
                "in the batch of the next step's receive"
            )


def test_refused_layouts(script):
    def args(**changes):
        values = dict(batch_size=8, microbatches=4, schedule="gpipe", pp_impl="scratch", n_layers=4)
        return argparse.Namespace(**{**values, **changes})

    for changes, world_size, words in [
        (dict(batch_size=6), 2, "multiple of 4"),
        (dict(schedule="interleaved"), 2, "--pp-impl builtin"),
        (dict(schedule="interleaved", pp_impl="builtin", n_layers=3), 2, "--n-layers 4 or more"),
        (dict(n_layers=3), 4, "--n-layers 4 or more"),
        (dict(schedule="1f1b", pp_impl="builtin", microbatches=2), 4, "--microbatches >= 4"),
    ]:
        with pytest.raises(CourseError, match=re.escape(words)):
            script.check_layout(args(**changes), world_size)
    script.check_layout(args(schedule="1f1b", microbatches=1, batch_size=1), 4)  # scratch 1F1B: any m


def test_more_stages_than_blocks_ends_with_one_line(lesson, tmp_path):
    result = torchrun(lesson("05"), 2, [*COMMON, "--n-layers", "1", "--log-dir", tmp_path / "runs"], timeout=90)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode != 0 and errors and "--n-layers 2 or more" in errors[0], result.tail()


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCRATCH)
def test_todo5_scratch_schedules_match_one_process(run, name):
    one = finished(run("one")[0], 5)
    result, folder = run(name)
    metrics = finished(result, 5)
    difference = max_difference(weights(folder), weights(run("one")[1]))
    assert difference <= TOLERANCE, (
        f"TODO 5: after 3 SGD steps, {name} differs from one process by {difference:.1e} on some parameter: divide "
        "each micro-batch's loss by the number of micro-batches, keep each input for its backward"
    )
    assert metrics["losses"] == pytest.approx(one["losses"], rel=1e-5), f"TODO 5: losses {metrics['losses']}"
    assert metrics["param_checksum"] == pytest.approx(one["param_checksum"], rel=1e-9), "TODO 5: checksum"


@pytest.mark.parametrize("name", BUILTIN)
def test_todo6_builtin_schedules_match_one_process(run, name):
    one = finished(run("one")[0], 6)
    result, folder = run(name)
    metrics = finished(result, 6)
    difference = max_difference(weights(folder), weights(run("one")[1]))
    assert difference <= TOLERANCE, f"TODO 6: {name} differs from one process by {difference:.1e} on some parameter"
    assert metrics["losses"] == pytest.approx(one["losses"], rel=1e-5), f"TODO 6: losses {metrics['losses']}"
    assert metrics["stages"] == metrics["world_size"] * metrics["stages_per_rank"]
    if metrics["timeline"] is not None:  # recorded through PipelineStage methods that are not public API
        for timeline in metrics["timeline"]:
            assert len(timeline) == 2 * metrics["microbatches"] * metrics["stages_per_rank"], timeline


def test_activation_memory_gpipe_grows_with_m_1f1b_bounded_by_p(run):
    """Bytes saved for backward are deterministic: peak = micro-batches in flight x one micro-batch's bytes."""
    runs = {name: finished(run(name)[0], 5) for name in SCRATCH}
    for name, metrics in runs.items():
        p, m = metrics["world_size"], metrics["microbatches"]
        expected = [m if metrics["schedule"] == "gpipe" else min(p - r, m) for r in range(p)]
        assert metrics["in_flight_per_rank"] == expected, f"{name}: in flight {metrics['in_flight_per_rank']}"
        assert metrics["peak_activation_bytes_per_rank"] == metrics["predicted_activation_bytes_per_rank"], (
            f"TODO 5: {name}: measured peak {metrics['peak_activation_bytes_per_rank']} != in flight x one micro-batch "
            f"{metrics['predicted_activation_bytes_per_rank']} (free each micro-batch's graph after its backward)"
        )
    gpipe, one_f_one_b = runs["gpipe2"], runs["1f1b2"]
    assert gpipe["peak_activation_bytes_per_rank"][0] == 4 * gpipe["microbatch_activation_bytes_per_rank"][0]
    assert (
        one_f_one_b["peak_activation_bytes_per_rank"][0] == 2 * one_f_one_b["microbatch_activation_bytes_per_rank"][0]
    )
    assert gpipe["peak_activation_bytes_per_rank"][0] > one_f_one_b["peak_activation_bytes_per_rank"][0]


@pytest.mark.parametrize("name", ["gpipe2", "1f1b4"])
def test_bubble_and_timeline_in_the_metrics(run, script, name):
    metrics = finished(run(name)[0], 5)
    p, m = metrics["world_size"], metrics["microbatches"]
    assert metrics["bubble_predicted"] == pytest.approx((p - 1) / (m + p - 1))
    assert metrics["bubble_from_steps"] == pytest.approx(metrics["bubble_predicted"])
    assert 0 <= metrics["bubble_measured_min"] <= metrics["bubble_measured"] <= metrics["bubble_measured_max"] < 1
    for rank, timeline in enumerate(metrics["timeline"]):
        steps = script.SCRATCH_SCHEDULES[metrics["schedule"]](p, m, rank)
        assert [[kind, mb] for kind, mb, *_ in timeline] == [list(s) for s in steps], f"rank {rank} ran {timeline}"
        assert all(0 <= start <= end for _, _, start, end, _ in timeline)


def test_checksum_is_equal_across_layouts(run):
    checksums = {name: finished(run(name)[0], 5)["param_checksum"] for name in ["one", *SCRATCH, *BUILTIN]}
    assert max(checksums.values()) == pytest.approx(min(checksums.values()), rel=1e-9), checksums
    metrics = finished(run("1f1b4")[0], 5)
    assert metrics["bytes_per_rank"]["params"] < finished(run("one")[0], 5)["bytes_per_rank"]["params"]


def test_rank0_prints_once_and_finishes(run):
    result, _ = run("1f1b2")
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1


def test_a_rank_dying_mid_schedule_ends_the_job(lesson, tmp_path):
    args = [*COMMON, "--schedule", "1f1b", "--crash-at-step", "2", "--log-dir", tmp_path / "runs"]
    result = torchrun(lesson("05"), 2, args, timeout=120, env=course_env(COURSE_TIMEOUT_S=20))
    assert result.returncode != 0, result.tail()
    assert "crashing on purpose" in result.output, result.tail()
    assert "FINISHED" not in result.output


def test_untouched_exercise_stops_at_todo1(tmp_path):
    solution = ROOT / "solutions" / "05_pipeline_parallel.py"
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(make_exercise(solution.read_text(), solution.name)[0])
    result = python(exercise, [*COMMON, "--log-dir", tmp_path / "runs"], env=course_env(PYTHONPATH=ROOT), timeout=90)
    assert result.returncode != 0 and "ERROR: TODO 1: balanced partition is not done yet" in result.output, (
        result.tail()
    )
