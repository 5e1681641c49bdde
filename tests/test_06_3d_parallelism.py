"""Lesson 06: a grid of pp x dp x tp ranks trains exactly like one process, from scratch and built in.

pytest tests/test_06_3d_parallelism.py                      # the solution
pytest tests/test_06_3d_parallelism.py --target exercises   # your exercise (make check LESSON=06)

The reference is never the learner's own code: the grid (TODOs 1-5) is checked in pure Python against a tensor
of ranks reshaped to (pp, dp, tp); the DP average (TODO 6) on 4 ranks against the mean computed without
communication; the runs against lesson 00's solution on one process (the same global batches, the same seed);
FSDP2 under the pipeline (TODO 7) by the all-gathers each rank ran in one step (utils/collective_counter.py).
A test that needs earlier TODOs is skipped, naming them, until their own tests pass. The 3D runs are launched
once each and shared; one of them also records its last step's timeline (COURSE_TIMELINE); no test asserts on a
timing, only on the order of what the timeline shows.
"""

import argparse
import json
import re

import pytest
import torch

from tests.harness.launch import ROOT, course_env, finished, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext
from tests.harness.todo_calls import call, prerequisites
from utils import planner
from utils.course.lessons import load_script
from utils.course.make_exercises import handed_out
from utils.distributed_utils import CourseError
from utils.lesson_06 import lab
from utils.lesson_06 import timeline as lesson06_timeline
from utils.lesson_06.reference import reference_gradient_norms
from utils.model import ModelConfig

TOLERANCE = 1e-6  # fp32, SGD: the layouts and one process differ only by the order of additions
COMMON = [
    "--dim", "32", "--n-layers", "4", "--n-heads", "2", "--seq-len", "32", "--steps", "3",
    "--optimizer", "sgd", "--log-every", "1", "--microbatches", "2",
]  # fmt: skip
GLOBAL_BATCH = 8  # every run trains on lesson 00's batches of 8 sequences: dp x --batch-size = 8
RUNS = {  # name: (processes, arguments); (pp, dp, tp) in the name
    "scratch_222_gpipe": (8, ["--tp", "2", "--pp", "2", "--batch-size", "4", "--schedule", "gpipe"]),
    "scratch_222_1f1b": (  # 4 micro-batches of 1 sequence: 1F1B's steady phase, m > p
        8, ["--tp", "2", "--pp", "2", "--batch-size", "4", "--schedule", "1f1b", "--microbatches", "4"]
    ),
    "scratch_212_1f1b": (4, ["--tp", "2", "--pp", "2", "--batch-size", "8", "--schedule", "1f1b"]),
    "scratch_122_1f1b": (4, ["--tp", "2", "--pp", "1", "--batch-size", "4"]),  # one stage: no sends at all
    "scratch_221_gpipe": (4, ["--tp", "1", "--pp", "2", "--batch-size", "4", "--schedule", "gpipe"]),
    "builtin_222_1f1b": (8, ["--tp", "2", "--pp", "2", "--batch-size", "4", "--impl", "builtin"]),
    "builtin_222_gpipe": (
        8, ["--tp", "2", "--pp", "2", "--batch-size", "4", "--impl", "builtin", "--schedule", "gpipe"]
    ),
    "builtin_221_gpipe": (
        4, ["--tp", "1", "--pp", "2", "--batch-size", "4", "--impl", "builtin", "--schedule", "gpipe"]
    ),
    "builtin_122_1f1b": (4, ["--tp", "2", "--pp", "1", "--batch-size", "4", "--impl", "builtin"]),  # one stage
    "builtin_212_1f1b": (4, ["--tp", "2", "--pp", "2", "--batch-size", "8", "--impl", "builtin"]),  # FSDP over 1 rank
}  # fmt: skip
TIMELINE_RUN = "scratch_222_1f1b"  # also writes its last step's timeline (utils/lesson_06/timeline.py)
SCRATCH = [name for name in RUNS if name.startswith("scratch")]
BUILTIN = [name for name in RUNS if name.startswith("builtin")]
ENV = course_env(PYTHONPATH=ROOT)  # `import utils` also for a script in another folder (--target-dir)
# (pp, dp, tp): 8 ranks every way, 2 nodes x 4 GPUs, and dimensions of size 1
SHAPES = [(1, 1, 1), (2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 4), (1, 8, 1), (8, 1, 1), (1, 1, 8), (3, 2, 2), (2, 3, 1)]


@pytest.fixture(scope="module")
def script(lesson):
    """The lesson script imported as a module (its functions, without running main)."""
    return load_script(lesson("06"), "lesson06_under_test")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Lesson 00's solution on one process with the global batch: the reference every run is compared with."""
    folder = tmp_path_factory.mktemp("lesson00")
    args = [*COMMON[:-2], "--batch-size", GLOBAL_BATCH, "--log-dir", folder / "runs"]
    args += ["--checkpoint", folder / "model.pt"]
    result = python(ROOT / "solutions" / "00_setup_and_baseline.py", args, tmp_path=folder).check()
    return result.metrics, weights(folder)


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson06"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            fresh_folder(folder)
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            env = {**ENV, lesson06_timeline.ENV: str(folder / "timeline.json")} if name == TIMELINE_RUN else ENV
            done[name] = torchrun(lesson("06"), nproc, args, tmp_path=folder, env=env, timeout=300), folder
        return done[name]

    return launch


def option_of(extra: list[str], option: str) -> str:
    """An option's value in a run: the run's own (the last one on the command line wins), else COMMON's."""
    given = {**dict(zip(COMMON[::2], COMMON[1::2])), **dict(zip(extra[::2], extra[1::2]))}
    return given[option]


def weights(folder) -> dict:
    return torch.load(folder / "model.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


# ---------------------------------------------------------------------------------------------------------------
# The reference grid: the world's ranks as a tensor of shape (pp, dp, tp), TP innermost
# ---------------------------------------------------------------------------------------------------------------


def ranks_tensor(pp, dp, tp) -> torch.Tensor:
    return torch.arange(pp * dp * tp).reshape(pp, dp, tp)


def reference_coordinates(rank, pp, dp, tp) -> dict:
    where = (ranks_tensor(pp, dp, tp) == rank).nonzero()[0].tolist()
    return dict(zip(("pp", "dp", "tp"), where))


def reference_groups(pp, dp, tp, dim) -> list[list[int]]:
    """The groups of `dim`: move that axis last and read the rows, ordered by their smallest rank."""
    axis = ("pp", "dp", "tp").index(dim)
    rows = ranks_tensor(pp, dp, tp).movedim(axis, -1).reshape(-1, (pp, dp, tp)[axis]).tolist()
    return sorted(rows, key=lambda row: row[0])


def reference_grid(script, rank, pp, dp, tp):
    """A Grid built here from the reference (not with the learner's TODOs 1-3), with placeholder groups."""
    members = {dim: next(g for g in reference_groups(pp, dp, tp, dim) if rank in g) for dim in ("pp", "dp", "tp")}
    layout = script.Layout(pp=pp, dp=dp, tp=tp)
    return script.Grid(layout, rank, reference_coordinates(rank, pp, dp, tp), {d: None for d in members}, members)


# ---------------------------------------------------------------------------------------------------------------
# The checks of each TODO on its own, as functions: the tests call them, and later TODOs' tests call them first
# ---------------------------------------------------------------------------------------------------------------


# The known mistakes of TODOs 1, 2 and 5, each as the answer it gives for a whole grid (pp, dp, tp), with its cause in
# the learner's terms: a failure whose answers are all one mistake's names that cause ("as if ..."), never a guess.
def every_rank(wrong):
    """A mistake in one coordinate, wrong(rank, pp, dp, tp) -> {dim: value}, as its answer for a whole grid."""
    return lambda pp, dp, tp: [
        {**reference_coordinates(r, pp, dp, tp), **wrong(r, pp, dp, tp)} for r in range(pp * dp * tp)
    ]


COORDINATE_MISTAKES = {  # cause: the coordinates it gives every rank of a grid (pp, dp, tp)
    "as if pp were the innermost digit (rank % pp), not tp": every_rank(lambda r, pp, dp, tp: {"pp": r % pp}),
    "as if dp were not wrapped at its size (rank // tp counts the replicas of every stage)": every_rank(
        lambda r, pp, dp, tp: {"dp": r // tp}
    ),
    "as if pp divided by dp only, forgetting the tp ranks of each replica": every_rank(
        lambda r, pp, dp, tp: {"pp": r // dp}
    ),
    "as if dp were the lowest digit (rank % dp), without dividing by tp first": every_rank(
        lambda r, pp, dp, tp: {"dp": r % dp}
    ),
}


def as_if(got, mistakes: dict, *case) -> str:
    """The causes (": as if ...") of the known mistakes whose answer for this case, mistake(*case), is `got`."""
    causes = []
    for cause, mistake in mistakes.items():
        try:
            if mistake(*case) == got:
                causes.append(cause)
        except (IndexError, ZeroDivisionError, AttributeError):  # that mistake would have raised here: not this one
            pass
    return ": " + " or ".join(causes) if causes else ""


def check_todo1(script):
    for pp, dp, tp in SHAPES:
        layout, ranks = script.Layout(pp=pp, dp=dp, tp=tp), range(pp * dp * tp)
        got = [call(1, script.coordinates, rank, layout) for rank in ranks]
        for rank in ranks:
            want = reference_coordinates(rank, pp, dp, tp)
            if got[rank] == want:
                continue
            differs = [d for d in want if not isinstance(got[rank], dict) or got[rank].get(d) != want[d]]
            cause = as_if(got, COORDINATE_MISTAKES, pp, dp, tp)
            pytest.fail(
                f"TODO 1: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank} is at {want}, got {got[rank]} (its "
                f"{' and '.join(differs)} {'differs' if len(differs) == 1 else 'differ'}){cause}",
                pytrace=False,
            )


def as_lists(groups) -> list:
    """Groups as lists of ranks, whatever sequences hold them (a tuple of ranks is a group as good as a list)."""
    try:
        return [list(group) for group in groups]
    except TypeError:
        return groups  # not groups at all: shown as it is in the failure


GROUP_MISTAKES = {  # cause: the groups it gives, as a function of (pp, dp, tp, dim)
    "as if the key held every coordinate, the group's own too: every group is one rank": (
        lambda pp, dp, tp, dim: [[rank] for rank in range(pp * dp * tp)]
    ),
    "as if the key were the stage alone: each group holds a whole stage": (
        lambda pp, dp, tp, dim: ranks_tensor(pp, dp, tp).reshape(pp, -1).tolist()
    ),
    "as if each rank's coordinate in the dimension were collected instead of its global rank": (
        lambda pp, dp, tp, dim: [
            [reference_coordinates(r, pp, dp, tp)[dim] for r in group] for group in reference_groups(pp, dp, tp, dim)
        ]
    ),
}


def check_todo2(script):
    for pp, dp, tp in SHAPES:
        layout = script.Layout(pp=pp, dp=dp, tp=tp)
        for dim in ("pp", "dp", "tp"):
            got = as_lists(call(2, script.group_members, layout, dim))
            want = reference_groups(pp, dp, tp, dim)
            if got == want:
                continue
            if isinstance(got, list):  # the first group that differs, or the first one missing or extra
                i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                first = (
                    f"group {i}: got {got[i] if i < len(got) else 'none'}, want {want[i] if i < len(want) else 'none'}"
                )
            else:
                first = f"got {type(got).__name__}, want a list of groups"
            cause = as_if(got, GROUP_MISTAKES, pp, dp, tp, dim)
            pytest.fail(
                f"TODO 2: (pp, dp, tp) = {(pp, dp, tp)}: the {dim} groups first differ at {first}{cause}; "
                f"want {want}, got {got}",
                pytrace=False,
            )


def creation_mistake(calls: dict, pp, dp, tp) -> str:
    """The cause (": as if ...") when every rank created the groups a known mistake creates, in any order."""
    made = {rank: sorted(asked) for rank, asked in calls.items()}
    own, upto = {}, {}  # per rank: the groups it is in; each dimension's groups up to and including its own
    for rank in calls:
        for dim in ("pp", "dp", "tp"):
            groups = reference_groups(pp, dp, tp, dim)
            mine = next(i for i, group in enumerate(groups) if rank in group)
            own.setdefault(rank, []).append(groups[mine])
            upto.setdefault(rank, []).extend(groups[: mine + 1])
    if made == {rank: sorted(groups) for rank, groups in own.items()}:
        return ": as if each rank created only the groups it is in"
    if made == {rank: sorted(groups) for rank, groups in upto.items()}:
        return ": as if each rank stopped creating a dimension's groups once it found its own"
    return ""


def check_todo3(script):
    """Every rank keeps its own group and that group's handle in each dimension, and every rank creates every group
    of every dimension once, all in the same order (any order, and any sequence type for the ranks)."""
    for pp, dp, tp in SHAPES:
        layout = script.Layout(pp=pp, dp=dp, tp=tp)
        calls = {}
        for rank in range(pp * dp * tp):  # every rank of the world, simulated: what it asks torch for, in order
            asked = []

            def new_group(ranks, asked=asked):
                asked.append(list(ranks))
                return ("handle of group", *ranks)

            grid = call(3, script.build_grid, rank, layout, new_group)
            calls[rank] = asked
            for dim in ("pp", "dp", "tp"):
                members = grid.members.get(dim)
                want = next(group for group in reference_groups(pp, dp, tp, dim) if rank in group)
                made = [group for group in asked if group in reference_groups(pp, dp, tp, dim)]  # in its order
                last = made and members is not None and list(members) == made[-1] != want
                assert members is not None and list(members) == want, (
                    f"TODO 3: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank}'s {dim} group is {want}, it keeps {members}"
                    + (f": as if it kept the last {dim} group it created, not the one it is in" if last else "")
                )
                handle = grid.groups.get(dim)
                assert handle == ("handle of group", *want), (
                    f"TODO 3: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank} keeps as its {dim} group the handle "
                    f"new_group returned for {list(handle[1:]) if isinstance(handle, tuple) else handle}, not {want}'s"
                )
        expected = sorted(g for dim in ("pp", "dp", "tp") for g in reference_groups(pp, dp, tp, dim))
        for rank, asked in calls.items():
            assert asked == calls[0], (
                f"TODO 3: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank} creates {asked}, rank 0 {calls[0]}"
                f"{creation_mistake(calls, pp, dp, tp)}; every rank must create the same groups in the same order "
                "(creating a group is a collective of the whole world)"
            )
        assert sorted(calls[0]) == expected, (
            f"TODO 3: (pp, dp, tp) = {(pp, dp, tp)}: the ranks create {calls[0]}, not every group of every dimension "
            f"once ({expected}, in any order)"
        )


SHARE_MISTAKES = {  # cause: what it reads of a batch of 3 x dp sequences, as a function of (batch, dp, replica)
    "as if every replica read the whole global batch": lambda batch, dp, d: batch.tolist(),
    "as if split(dp) were used: it cuts pieces of dp sequences, chunk(dp) cuts dp pieces": (
        lambda batch, dp, d: batch.split(dp)[d].tolist()  # 3 pieces: none for replica d >= 3
    ),
}


def check_todo4(script):
    """Each replica reads its own 3 of the batch's sequences, whole, the same on every rank of the replica, and the
    replicas' shares cover the batch once (a contiguous cut, a strided one: any split trains the same)."""
    for pp, dp, tp in SHAPES:
        batch = torch.arange(dp * 3 * 5).reshape(dp * 3, 5)  # 3 sequences of 5 tokens per replica: row i = 5i...
        shares = {}  # replica -> (the sequences it reads, the rank that read them first)
        for rank in range(pp * dp * tp):
            grid = reference_grid(script, rank, pp, dp, tp)
            got = call(4, script.replica_batch, batch, grid)
            d = grid.coords["dp"]
            where = f"TODO 4: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank} (replica {d})"
            readable = got.tolist() if isinstance(got, torch.Tensor) else got
            assert isinstance(got, torch.Tensor) and got.shape == (3, 5), (
                f"{where} should read 3 of the {dp * 3} sequences (shape [3, 5]), got "
                f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
                + as_if(readable, SHARE_MISTAKES, batch, dp, d)
            )
            rows = got[:, 0].div(5, rounding_mode="floor")
            assert torch.equal(got, batch[rows]), (
                f"{where} should read whole sequences of the batch, got {got.tolist()}"
            )
            assert torch.equal(script.replica_batch(batch, grid), got), (
                f"{where} reads other sequences when asked again"
            )
            first = shares.setdefault(d, (rows.tolist(), rank))
            by = [dim for dim in ("tp", "pp") if torch.equal(got, batch.chunk(dp)[grid.coords[dim] % dp])]
            assert rows.tolist() == first[0], (
                f"{where} reads sequences {rows.tolist()}, but rank {first[1]} of the same replica reads {first[0]}"
                + (
                    f": as if the share were picked by the rank's {' or '.join(by)} coordinate, not its replica (dp)"
                    if by
                    else ""
                )
                + "; every stage and TP shard of a replica must read the same sequences"
            )
        read = sorted(row for rows, _ in shares.values() for row in rows)
        assert read == list(range(dp * 3)), (
            f"TODO 4: (pp, dp, tp) = {(pp, dp, tp)}: the {dp} replicas together read sequences {read}, not each of the "
            f"{dp * 3} once: {dict((d, rows) for d, (rows, _) in sorted(shares.items()))}"
        )


def every_stage(wrong):
    """A mistake, wrong(grid, stage) -> rank, as its answers for every rank's grid and every stage."""
    return lambda grids: [[wrong(grid, stage) for stage in range(grid.layout.pp)] for grid in grids]


NEIGHBOUR_MISTAKES = {  # cause: the ranks it gives
    "as if the stage number were the global rank (lesson 05's one stage per rank)": every_stage(lambda g, s: s),
    "as if every rank were in replica 0 (its dp coordinate left out)": every_stage(
        lambda g, s: s * g.layout.dp * g.layout.tp + g.coords["tp"]
    ),
    "as if two stages were tp ranks apart, forgetting the dp replicas between them": every_stage(
        lambda g, s: s * g.layout.tp + g.coords["tp"]
    ),
    "as if it were looked up in the DP group, not the PP group": every_stage(lambda g, s: g.members["dp"][s]),
}


def check_todo5(script):
    for pp, dp, tp in SHAPES:
        grids = [reference_grid(script, rank, pp, dp, tp) for rank in range(pp * dp * tp)]
        got = [[call(5, script.stage_rank, grid, stage) for stage in range(pp)] for grid in grids]
        for rank, grid in enumerate(grids):
            for stage in range(pp):
                want = int(ranks_tensor(pp, dp, tp)[stage, grid.coords["dp"], grid.coords["tp"]])
                assert got[rank][stage] == want, (
                    f"TODO 5: (pp, dp, tp) = {(pp, dp, tp)}: rank {rank}'s stage {stage} is rank {want} (same replica, "
                    f"same TP shard), got {got[rank][stage]}{as_if(got, NEIGHBOUR_MISTAKES, grids)}"
                )


def check_todo6(script, lesson):
    result = torchrun(ROOT / "tests" / "workers" / "three_d_average.py", 4, [lesson("06")], env=ENV, timeout=180)
    lines = [line for line in result.output.splitlines() if line.startswith("TODO 6:")]
    assert result.returncode == 0, lines[0] if lines else f"TODO 6: the check failed:\n{result.tail()}"


CHECKS = {1: check_todo1, 2: check_todo2, 3: check_todo3, 4: check_todo4, 5: check_todo5}


@pytest.fixture(scope="module")
def needs(script):
    """needs(1, 4, ...): skip this test, naming them, while those TODOs fail their own checks."""
    return prerequisites(lambda todo: CHECKS[todo](script))


# ---------------------------------------------------------------------------------------------------------------
# Pure Python: each TODO of the grid against the reference
# ---------------------------------------------------------------------------------------------------------------


def test_todo1_coordinates_tp_innermost_pp_outermost(script):
    check_todo1(script)


def test_todo2_groups_of_each_dimension(script, needs):
    needs(1)  # the groups are read from TODO 1's coordinates
    check_todo2(script)


def test_todo3_every_rank_creates_every_group_in_the_same_order(script, needs):
    needs(1, 2)
    check_todo3(script)


def test_todo4_each_replica_reads_its_share_of_the_global_batch(script):
    check_todo4(script)


def test_todo5_pipeline_neighbours_are_global_ranks_of_the_same_replica_and_shard(script):
    check_todo5(script)


def test_todo6_gradients_averaged_over_the_dp_group(script, lesson):
    check_todo6(script, lesson)


def test_refused_layouts(script):
    def args(**changes):
        values = dict(tp=2, pp=2, n_heads=2, dim=32, n_layers=4, seq_len=32, batch_size=4, microbatches=2)
        return argparse.Namespace(**{**values, "impl": "scratch", "schedule": "1f1b", **changes})

    for changes, world_size, words in [
        ({}, 6, "does not divide the 6 processes"),
        (dict(tp=4), 8, "does not divide --n-heads 2"),
        (dict(pp=8, tp=1), 8, "--n-layers 8 or more"),
        (dict(batch_size=3), 8, "multiple of 2"),
        (dict(impl="builtin", microbatches=1, batch_size=4), 8, "--microbatches >= --pp 2"),
    ]:
        with pytest.raises(CourseError, match=re.escape(words)) as refused:
            script.check_layout(args(**changes), world_size)
        assert "\n" not in str(refused.value), f"one line: {refused.value}"
    layout = script.check_layout(args(), 8)
    assert (layout.pp, layout.dp, layout.tp) == (2, 2, 2)


def test_a_refused_layout_ends_the_script_with_one_line(lesson, tmp_path):
    result = python(lesson("06"), [*COMMON, "--tp", "2", "--log-dir", tmp_path / "runs"], env=ENV, timeout=90)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.tail()
    assert "--tp 2 x --pp 1 = 2 ranks per replica does not divide the 1 processes" in errors[0], errors[0]
    assert "Traceback" not in result.output, result.tail()


def test_untouched_exercise_stops_at_todo1(tmp_path):
    exercise = handed_out("06_3d_parallelism.py", tmp_path / "exercises")
    result = python(exercise, [*COMMON, "--log-dir", tmp_path / "runs"], env=ENV, timeout=90)
    assert result.returncode == 2 and "ERROR: TODO 1: the coordinates of a rank is not done yet" in result.output, (
        result.tail()
    )


# ---------------------------------------------------------------------------------------------------------------
# Runs, against lesson 00's solution on one process
# ---------------------------------------------------------------------------------------------------------------


def check_parity(todo: int, name: str, run, baseline):
    reference, reference_weights = baseline
    result, folder = run(name)
    metrics = finished(result, todo)
    mine = weights(folder)
    difference = max_difference(mine, reference_weights)
    if difference > TOLERANCE:  # name the parameters that differ, in the model's order, and whether blocks do
        off = [n for n in reference_weights if float((mine[n] - reference_weights[n]).abs().max()) > TOLERANCE]
        where = "only outside the blocks" if not any(n.startswith("blocks.") for n in off) else "blocks included"
        pytest.fail(
            f"TODO {todo}: after 3 SGD steps, {name} differs from lesson 00 on one process first at {off[0]} "
            f"(at most {difference:.1e}; {len(off)} of {len(mine)} parameters differ, {where}: {', '.join(off[:4])}"
            f"{', ...' if len(off) > 4 else ''})",
            pytrace=False,
        )
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5), (
        f"TODO {todo}: {name}'s losses are {metrics['losses']}, lesson 00's on one process {reference['losses']}"
    )
    assert metrics["param_checksum"] == pytest.approx(reference["param_checksum"], rel=1e-9), (
        f"TODO {todo}: {name}'s parameter checksum is {metrics['param_checksum']!r}, lesson 00's "
        f"{reference['param_checksum']!r}"
    )
    return metrics


@pytest.mark.parametrize("name", SCRATCH)
def test_todo6_scratch_3d_matches_lesson_00(run, baseline, needs, script, lesson, name):
    needs(1, 2, 3, 4, 5)
    check_parity(6, name, run, baseline)


def fsdp_units(metrics, stage: int) -> int:
    """The FSDP2 units a stage's ranks have at least: each block of the stage, and the stage itself (the root).
    More are as correct (e.g. the embeddings in a unit of their own)."""
    first, end = metrics["partition"][stage]
    return end - first + 1


@pytest.mark.parametrize("name", BUILTIN)
def test_todo7_builtin_3d_matches_lesson_00(run, baseline, needs, name):
    needs(1, 4)  # the built-in path reads each replica's share with replica_batch (TODO 4) too
    metrics = finished(run(name)[0], 7)
    layout, stages = metrics["layout"], metrics["partition"]
    # What TODO 7 built, checked before the numbers, so that a missing unit or a wrong sub-mesh is named as such.
    # Every rank wraps each block of its stage, then the stage ("" is the stage itself): FSDP's unit is at most a
    # block, as in lesson 03. More units (the embeddings in one of their own) are as correct.
    wanted = {"": "the stage", **{f"blocks.{i}": f"blocks.{i}" for i in range(*stages[0])}}  # module: its words
    missing = [words for module, words in wanted.items() if module not in metrics["fsdp_modules"]]
    if missing == ["the stage"]:
        cause = ": as if only the blocks were wrapped: the embeddings, final norm and head are never averaged over dp"
    elif missing == list(wanted.values())[1:]:
        cause = ": as if only the stage were wrapped, one unit for all its blocks"
    else:
        cause = ""
    assert not missing, (
        f"TODO 7: {name}: rank 0's FSDP2 units are {metrics['fsdp_modules']}, none for {', '.join(missing)}{cause}"
    )
    placements = metrics["placements"][f"blocks.{stages[0][0]}.attention.q_proj.weight"]
    if not any(p.startswith("tp: ") for p in placements):
        cause = ": as if tensor parallelism were never applied (every TP rank holds whole projections)"
    elif placements[0].startswith("tp: "):  # FSDP's dimension comes first: here it is tp
        cause = ': as if the sub-meshes were swapped (TP on mesh["dp"], FSDP on mesh["tp"])'
    else:
        cause = ""
    assert "tp: S(0)" in placements or layout["tp"] == 1, f"TODO 7: q_proj is not sharded over tp: {placements}{cause}"
    assert any(p.startswith("dp: ") and "S(0" in p for p in placements), f"TODO 7: not sharded over dp: {placements}"
    check_parity(7, name, run, baseline)


def reshards(run) -> dict[str, str]:
    """For each built-in run with dp > 1: "resharded" when its blocks were gathered again after forward (more
    all-gathers than reduce-scatters on some rank), else "kept"; the runs that failed are left out."""
    found = {}
    for name in BUILTIN:
        try:
            metrics = finished(run(name)[0], 7)
        except AssertionError:
            continue
        if metrics["layout"]["dp"] > 1:
            counts = [
                [seen.get(k, [0])[0] for k in ("all_gather", "reduce_scatter")]
                for seen in metrics["collectives_last_step"]
            ]
            found[name] = "resharded" if any(g > s for g, s in counts) else "kept"
    return found


def reshard_cause(run) -> str:
    """The known mistake that gives what every built-in run did, in the learner's terms, else ""."""
    found = reshards(run)
    under = {state for name, state in found.items() if option_of(RUNS[name][1], "--pp") != "1"}
    alone = {state for name, state in found.items() if option_of(RUNS[name][1], "--pp") == "1"}
    return {
        ("resharded", "resharded"): ": as if reshard_after_forward were left at FSDP's default (True) in every run",
        ("resharded", "kept"): ": as if the condition were inverted (resharded with stages, kept whole with one)",
        ("kept", "kept"): ": as if reshard_after_forward were False in every run, whatever the stages",
    }.get((" ".join(sorted(under)), " ".join(sorted(alone))), "")


@pytest.mark.parametrize("name", BUILTIN)
def test_todo7_fsdp_under_a_pipeline_gathers_each_block_once_a_step(run, needs, name):
    """torch's pipelining holds the gradients whole until the last micro-batch's backward, then reduce-scatters
    each FSDP unit once. With more than one stage the blocks must keep their parameters from forward to backward
    (reshard_after_forward=False): one all-gather per unit a step, whatever the micro-batches. With one stage they
    reshard after forward (FSDP's default, ZeRO-3's memory) and are gathered again. Counted in the last step."""
    needs(1, 4)
    metrics = finished(run(name)[0], 7)
    pp, dp, microbatches = metrics["layout"]["pp"], metrics["layout"]["dp"], metrics["microbatches"]
    for rank, (place, seen) in enumerate(zip(metrics["coordinates"], metrics["collectives_last_step"])):
        gathers, scatters = (seen.get(kind, [0])[0] for kind in ("all_gather", "reduce_scatter"))
        if dp == 1:  # FSDP2 over one rank communicates nothing
            assert gathers == scatters == 0, f"TODO 7: {name} rank {rank}: {gathers} all-gathers over a DP of 1"
            continue
        units = fsdp_units(metrics, place["pp"])  # each unit reduce-scatters its gradients once a step
        assert scatters >= units, (
            f"TODO 7: {name} rank {rank}: {scatters} reduce-scatters in a step, expected one for each of at least "
            f"{units} FSDP units (each block of its stage, and the stage)"
        )
        if pp > 1:
            assert gathers == scatters, (
                f"TODO 7: {name} rank {rank} ran {gathers} all-gathers in one step of {microbatches} micro-batches "
                f"for its {scatters} FSDP units: under a pipeline (--pp {pp}) its blocks were gathered again after "
                f"forward{reshard_cause(run)}; they must stay gathered from forward to backward, once a step"
            )
        else:
            assert gathers > scatters, (
                f"TODO 7: {name} rank {rank} gathered its {scatters} FSDP units only once in a step with one "
                f"pipeline stage: its blocks stayed gathered from forward to backward{reshard_cause(run)}; with one "
                "stage they reshard after forward, to free memory"
            )


def test_timeline_of_one_step_shows_where_each_dimension_communicates(run, needs, tmp_path):
    """The recorded step of a (2, 2, 2) 1F1B run: TP all-reduces inside compute (4 a layer a micro-batch), the
    pipeline's sends and receives between two computations and with the other stage only, one DP all-reduce after
    the last backward, on every rank; and a figure of it."""
    needs(1, 2, 3, 4, 5)
    result, folder = run(TIMELINE_RUN)
    metrics = finished(result, 6)
    timeline = lesson06_timeline.read(folder / "timeline.json")
    assert [rank["rank"] for rank in timeline["ranks"]] == list(range(metrics["world_size"]))
    for rank in timeline["ranks"]:
        compute, stage = lesson06_timeline.events(rank, "F", "B"), rank["coords"]["pp"]
        tp, pp, dp = (lesson06_timeline.events(rank, kind) for kind in ("tp", "pp", "dp"))
        layers = metrics["partition"][stage][1] - metrics["partition"][stage][0]
        assert len(compute) == 2 * metrics["microbatches"] and not lesson06_timeline.events(rank, "world"), rank
        assert len(tp) == 4 * layers * metrics["microbatches"], f"rank {rank['rank']}: {len(tp)} TP all-reduces"
        assert all(lesson06_timeline.inside(event, compute) for event in tp), f"rank {rank['rank']}: TP outside"
        assert pp and not any(lesson06_timeline.overlaps(event, compute) for event in pp), rank["rank"]
        peers = {peer for event in pp for peer in event["sends"] + event["receives"]}
        assert peers == {rank["rank"] + (4 if stage == 0 else -4)}, f"rank {rank['rank']} exchanged with {peers}"
        last_backward = max(event["end"] for event in compute if event["kind"] == "B")
        # One all-reduce (the solution's flat buffer) or one per gradient: all after the last backward.
        assert dp and all(event["start"] >= last_backward for event in dp), f"rank {rank['rank']}: DP all-reduces {dp}"
    figure = lesson06_timeline.draw(timeline, "a (2, 2, 2) step")
    ax = figure.axes[0]
    texts = [ax.title, ax.xaxis.label, *ax.get_yticklabels(), *ax.get_legend().get_texts()]
    assert "(ms)" in ax.get_xlabel() and min(text.get_fontsize() for text in texts) >= 10
    figure.savefig(tmp_path / "timeline.png")


def test_timeline_is_refused_where_it_cannot_record(monkeypatch, tmp_path, lesson):
    """COURSE_TIMELINE: unset records nothing; set, it must name a file in an existing folder, on a from-scratch
    run; anything else ends the script with one line before any process waits."""
    args = argparse.Namespace(impl="scratch")
    monkeypatch.delenv(lesson06_timeline.ENV, raising=False)
    assert not lesson06_timeline.StepTimeline.requested(args)
    for value, impl, words in [
        ("", "scratch", "set but empty"),
        (str(tmp_path / "step.json"), "builtin", "--impl scratch"),
        (str(tmp_path), "scratch", "name a file in an existing folder"),
        (str(tmp_path / "missing" / "step.json"), "scratch", "name a file in an existing folder"),
    ]:
        monkeypatch.setenv(lesson06_timeline.ENV, value)
        with pytest.raises(CourseError, match=re.escape(words)):
            lesson06_timeline.StepTimeline.requested(argparse.Namespace(impl=impl))
    monkeypatch.setenv(lesson06_timeline.ENV, str(tmp_path / "step.json"))
    assert lesson06_timeline.StepTimeline.requested(args).path == tmp_path / "step.json"
    env = {**ENV, lesson06_timeline.ENV: str(tmp_path / "step.json")}
    result = python(lesson("06"), [*COMMON, "--impl", "builtin", "--log-dir", tmp_path / "runs"], env=env, timeout=90)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode == 2 and len(errors) == 1 and "--impl scratch" in errors[0], result.tail()


def test_options_reach_the_run(run, needs):
    """--tp, --pp, --impl, --schedule and --microbatches as each run's metrics record them."""
    needs(1, 2, 3, 4, 5)
    for name, (nproc, extra) in RUNS.items():
        metrics = finished(run(name)[0], 6 if name in SCRATCH else 7)
        given = dict(zip(extra[::2], extra[1::2]))
        layout = metrics["layout"]
        assert layout["tp"] == int(given["--tp"]) and layout["pp"] == int(given["--pp"]), (name, layout)
        assert layout["dp"] * layout["tp"] * layout["pp"] == nproc == metrics["world_size"], (name, layout)
        assert metrics["impl"] == given.get("--impl", "scratch"), (name, metrics["impl"])
        assert metrics["schedule"] == given.get("--schedule", "1f1b"), (name, metrics["schedule"])
        microbatches = int(option_of(extra, "--microbatches"))
        assert metrics["microbatches"] == microbatches, (name, metrics["microbatches"])
        assert metrics["micro_batch"] == int(given["--batch-size"]) // microbatches, (name, metrics["micro_batch"])
        # gbs = micro-batch x micro-batches x dp: more micro-batches make each smaller, never the global batch larger
        gbs = metrics["micro_batch"] * microbatches * layout["dp"]
        assert metrics["global_batch"] == gbs == layout["dp"] * int(given["--batch-size"]) == GLOBAL_BATCH, name
        want = [reference_coordinates(r, layout["pp"], layout["dp"], layout["tp"]) for r in range(nproc)]
        assert metrics["coordinates"] == want, (name, metrics["coordinates"])
    assert len({option_of(extra, "--microbatches") for _, extra in RUNS.values()}) > 1, "runs split alike"


def test_model_state_is_split_over_the_grid(run, baseline, needs):
    """Each rank holds a share of the parameters; the DP replicas of a (stage, TP shard) hold the same share
    from scratch (replicated), and FSDP splits it further over dp built in."""
    needs(1, 2, 3, 4, 5)
    whole = baseline[0]["bytes_per_rank"]["params"]
    scratch = finished(run("scratch_222_gpipe")[0], 6)
    builtin = finished(run("builtin_222_1f1b")[0], 7)
    for metrics in (scratch, builtin):
        assert all(held["params"] < whole for held in metrics["bytes_per_rank"]), metrics["bytes_per_rank"]
    by_place = {}
    for coords, held in zip(scratch["coordinates"], scratch["bytes_per_rank"]):
        by_place.setdefault((coords["pp"], coords["tp"]), set()).add(held["params"])
    assert all(len(sizes) == 1 for sizes in by_place.values()), f"DP replicas hold different shares: {by_place}"
    assert sum(h["params"] for h in builtin["bytes_per_rank"]) < sum(h["params"] for h in scratch["bytes_per_rank"])


def planner_model() -> planner.Model:
    """The runs' model (COMMON's sizes, the byte-level vocabulary) as the planner describes it; params not needed."""
    values = dict(zip(COMMON[::2], COMMON[1::2]))
    n_layers, dim, heads, seq_len = (int(values[k]) for k in ("--n-layers", "--dim", "--n-heads", "--seq-len"))
    return planner.Model(0, n_layers, dim, heads, ModelConfig().vocab_size, seq_len)


@pytest.mark.parametrize("name", list(RUNS))
def test_model_state_bytes_are_the_planners(run, needs, name):
    """The bytes of parameters, gradients and optimizer state each rank holds equal utils/planner/'s count for that
    rank's own slice of the model, to the byte: planner.rank_model_state (its stage's blocks, the embeddings on the
    first stage, the final norm and the head on the last, q/k/v/up split by rows and o/down by columns over tp), then
    utils/memory.py's rule over dp: ZeRO-0 from scratch (each replica holds its slice whole), ZeRO-3 built in (FSDP2
    shards every tensor over dp). fp32 SGD: 4 + 4 bytes a parameter, no optimizer state."""
    needs(1, 2, 3, 4, 5)
    metrics = finished(run(name)[0], 6 if name in SCRATCH else 7)
    shape, zero = metrics["layout"], 0 if name in SCRATCH else 3
    layout = planner.Layout(
        shape["dp"], shape["tp"], shape["pp"], metrics["micro_batch"], metrics["microbatches"], zero=zero
    )
    for rank, (place, held) in enumerate(zip(metrics["coordinates"], metrics["bytes_per_rank"])):
        predicted = planner.rank_model_state(planner_model(), layout, place["pp"], precision="fp32", optimizer="sgd")
        assert held == predicted, (
            f"TODO {6 if name in SCRATCH else 7}: {name} rank {rank} {place} holds {held}, the planner predicts "
            f"{predicted} for its slice (ZeRO-{zero} over dp {shape['dp']})"
        )


@pytest.mark.parametrize("name", list(RUNS))
def test_activation_bytes_are_the_planners(run, needs, name):
    """What each rank saved for backward in one micro-batch's forward (saved_tensors_hooks, each byte of memory
    once: utils.memory.ActivationFootprint) equals utils/planner/'s prediction for its stage, to the byte.

    The prediction is Korthikanti et al.'s Table 2 per layer and section 4.3 per stage, restated for this model:
    fp32 values (4 bytes), no dropout, the head not split over tp, no recomputation and a fused attention kernel
    (the layout's default: scaled_dot_product_attention's CPU kernel keeps no attention scores); plus what that
    formula leaves out,
    computed term by term (planner.omitted_activation_bytes: the norms' statistics, the log-sum-exp, the token ids,
    positions and targets). Every saved tensor is one of these terms, so the tolerance is zero bytes: a saved
    tensor more or less (a copy, a view saved twice, a stage that keeps another's input) fails the test."""
    needs(1, 2, 3, 4, 5)
    result, _ = run(name)
    metrics = finished(result, 6 if name in SCRATCH else 7)
    model = planner_model()
    shape = metrics["layout"]
    layout = planner.Layout(
        shape["dp"], shape["tp"], shape["pp"], metrics["micro_batch"], metrics["microbatches"], 0, "none", False
    )
    for rank, (place, measured) in enumerate(zip(metrics["coordinates"], metrics["activation_bytes_per_rank"])):
        formula = planner.stage_activation_bytes(model, layout, place["pp"], value_bytes=4, dropout=False,
                                                 vocab_parallel=False)  # fmt: skip
        omitted = planner.omitted_activation_bytes(model, layout, place["pp"])
        assert measured == formula + omitted, (
            f"{name} rank {rank} {place}: saved {measured} bytes for backward, the planner predicts {formula:.0f} "
            f"+ {omitted:.0f} it leaves out = {formula + omitted:.0f}"
        )
    # Parameters per rank: the same count as the fp32 bytes of parameters each rank holds.
    assert [4 * n for n in metrics["params_per_rank"]] == [held["params"] for held in metrics["bytes_per_rank"]]


@pytest.mark.parametrize("name", list(RUNS))
def test_output_is_clean_and_rank0_prints_once(run, needs, name):
    """No warnings (DTensor's redistribution of FSDP x TP shards, FSDP2's view output, unwaited collectives)."""
    needs(1, 2, 3, 4, 5)
    result, _ = run(name)
    finished(result, 6 if name in SCRATCH else 7)
    lines = result.output.rstrip().splitlines()
    noisy = [line for line in lines if re.search(r"warn|\[W\d{4}|unwaited", line, re.IGNORECASE)]
    assert not noisy, f"{name} printed warnings:\n" + "\n".join(noisy[:6])
    assert lines[-1].startswith("FINISHED") and sum(line.startswith("FINISHED") for line in lines) == 1, lines[-3:]


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line but --autocast (refused), at a value other than its default, on one
    process (a grid of 1 x 1 x 1, from scratch, 2 micro-batches): the run trains like the same steps written out
    with PyTorch alone on lesson 00's batches (tests/harness/option_effects.py), logged where it says."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json",
    ]  # fmt: skip
    result = python(lesson("06"), args, timeout=180, env=ENV)
    finished(result, 6)
    check_shared_options(result, order="generator")


# ---------------------------------------------------------------------------------------------------------------
# The scaling report as section 5 uses it: processes on a CPU, one baseline for every layout
# ---------------------------------------------------------------------------------------------------------------


def test_scaling_report_counts_processes_against_one_baseline(run, needs, tmp_path):
    """On a CPU the world size counts processes (every lesson 06 run records its device); with baseline "smallest"
    every layout's speed-up and efficiency are against the 1-process run, and the figure draws one linear line."""
    from utils import report

    needs(1, 2, 3, 4, 5)
    assert report.world_unit([finished(run("scratch_122_1f1b")[0], 6)]) == "processes"
    assert report.world_unit([{"device": "cpu"}, {"device": "cuda"}]) == "GPUs"
    for gpus, speed, tp in ((1, 1000.0, 1), (2, 1600.0, 1), (4, 2000.0, 1), (2, 800.0, 2), (4, 1200.0, 2)):
        record = {"world_size": gpus, "tokens_per_s": speed, "device": "cpu", "layout": {"dp": gpus // tp, "tp": tp}}
        (tmp_path / f"run_{gpus}_{tp}.json").write_text(json.dumps(record))
    runs = report.read_runs(tmp_path)
    common = {(row["layout"], row["gpus"]): row for row in report.scaling_rows(runs, baseline="smallest")}
    own = {(row["layout"], row["gpus"]): row for row in report.scaling_rows(runs)}
    assert {row["base_gpus"] for row in common.values()} == {1}
    assert common["tp=2", 2]["efficiency"] == pytest.approx(800 / 1000 / 2) and own["tp=2", 2]["efficiency"] == 1.0
    figure = report.figure(list(common.values()), "two layouts", unit="processes")
    speed_ax = figure.axes[0]
    assert speed_ax.get_xlabel().startswith("processes") and "processes" in report.table(
        list(common.values()), "processes"
    )
    lines = [text.get_text() for text in speed_ax.get_legend().get_texts() if "linear" in text.get_text()]
    assert lines == ["linear scaling from 1 process"], lines
    (tmp_path / "run_1_2.json").write_text(json.dumps({"world_size": 1, "tokens_per_s": 900.0, "tp": 2}))
    with pytest.raises(ValueError, match="2 layouts ran at the smallest world size 1"):
        report.scaling_rows(report.read_runs(tmp_path), baseline="smallest")


# ---------------------------------------------------------------------------------------------------------------
# TODO 8: the debugging lab (a gradient norm every rank agrees on), on live ranks, then in every run of the lesson
# ---------------------------------------------------------------------------------------------------------------

LAB = ROOT / "utils" / "lesson_06" / "lab.py"


def test_todo8_lab_every_layout_reports_one_process_norm(lesson, script, tmp_path):
    """The lab's 4 ranks, in (2, 1, 2) and (1, 2, 2) from scratch, (1, 2, 2) and (2, 2, 1) built in: after one step
    the learner's global_gradient_norm gives, on every rank, one process's clip_grad_norm_ on the same model and
    batch."""
    if not hasattr(script, "global_gradient_norm"):
        pytest.fail(
            "TODO 8: the script has no global_gradient_norm (the lab at the end of the exercise)", pytrace=False
        )
    result = torchrun(LAB, lab.RANKS, [lesson("06")], tmp_path=tmp_path, timeout=120, env=ENV).check()
    message = lab.failure(result.metrics, 8)
    assert message is None, message


def test_todo8_every_run_reports_one_process_gradient_norm(run, baseline, needs):
    """Every run's gradient norm at every step (global_gradient_norm: each piece of the gradient counted once in
    the grid) equals clip_grad_norm_'s total norm on one process, on lesson 00's batches."""
    needs(1, 2, 3, 4, 5)
    values = dict(zip(COMMON[::2], COMMON[1::2]))
    sizes = {name: int(values[f"--{name.replace('_', '-')}"]) for name in ("dim", "n_layers", "n_heads", "seq_len")}
    config = ModelConfig(**sizes)
    norms, checksum = reference_gradient_norms(config, GLOBAL_BATCH, int(values["--steps"]))
    assert checksum == pytest.approx(baseline[0]["param_checksum"], rel=1e-9), "the reference is not lesson 00's run"
    for name in RUNS:
        metrics = finished(run(name)[0], 6 if name in SCRATCH else 7)
        assert metrics["grad_norms"] == pytest.approx(norms, rel=1e-6), (
            f"TODO 8: {name} (pp, dp, tp) reported gradient norms {metrics['grad_norms']}, where one process's "
            f"clip_grad_norm_ gives {norms}: a piece of the gradient counted more than once, or not at all"
        )
