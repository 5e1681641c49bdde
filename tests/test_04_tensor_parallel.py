"""Lesson 04: N tensor-parallel ranks train like one process, and communicate what the formula says.

pytest tests/test_04_tensor_parallel.py                      # the solution
pytest tests/test_04_tensor_parallel.py --target exercises   # your exercise (make check LESSON=04)

TODOs 1-6 are checked one at a time on 2 ranks (tests/workers/tp_units.py): the hand-written pieces against
nn.Linear, and the block and the SP gradients, each with the reference's other pieces, against the course model on
one process. Whole runs are launched once, the first time a test needs them, and shared by the tests below; their
reference is lesson 00's single-process script on the same batches (every tensor-parallel rank reads the whole
batch). The DTensor runs depend on TODO 7 only; the hand-written runs on TODOs 1-6 together ("other checks").
TODO 8 (the debugging lab) runs on 2 ranks in tests/workers/tp_lab.py, against one process (utils/lesson_04/lab.py).
"""

import json
import re
from pathlib import Path

import pytest
import torch

from tests.harness.blame import SECONDARY, tracebacks
from tests.harness.launch import ROOT, course_env, finished, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext, passed
from utils.course.lessons import load_script
from utils.course.make_exercises import handed_out, make_exercise
from utils.distributed_utils import CourseError
from utils.lesson_04.lab import failure
from utils.model import ModelConfig

TOLERANCE = 1e-6  # fp32, SGD: the ranks' partial sums are added in another order than one process's
B, T, D, L, HEADS = 4, 32, 32, 2, 4
CONFIG = ModelConfig(seq_len=T, dim=D, n_layers=L, n_heads=HEADS)
COMMON = [
    *["--dim", D, "--n-layers", L, "--n-heads", HEADS, "--seq-len", T, "--batch-size", B],
    *["--steps", "3", "--optimizer", "sgd", "--log-every", "1"],
]
RUNS = {f"tp{n}-{impl}{'-sp' * sp}": (n, impl, sp) for n in (2, 4) for impl in ("scratch", "dtensor") for sp in (0, 1)}
WORKER = ROOT / "tests" / "workers" / "tp_units.py"
LAB_WORKER = ROOT / "tests" / "workers" / "tp_lab.py"


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): "one" is lesson 00 on one process, else RUNS[name] of this lesson."""
    tmp, done = tmp_path_factory.mktemp("lesson04"), {}

    def launch(name):
        if name not in done:
            folder = tmp / name
            fresh_folder(folder)
            args = [*COMMON, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            if name == "one":
                script = ROOT / "solutions" / "00_setup_and_baseline.py"
                done[name] = python(script, args, tmp_path=folder).check(), folder
            else:
                nproc, impl, sp = RUNS[name]
                extra = ["--tp-impl", impl] + (["--sequence-parallel"] if sp else [])
                done[name] = torchrun(lesson("04"), nproc, [*args, *extra], tmp_path=folder), folder
        return done[name]

    return launch


@pytest.fixture(scope="module")
def units(lesson, tmp_path_factory):
    """The checks of TODOs 1-6 one at a time (tests/workers/tp_units.py), run once on 2 ranks."""
    out = tmp_path_factory.mktemp("units") / "units.json"
    result = torchrun(WORKER, 2, [lesson("04"), out], timeout=150)
    assert result.returncode == 0 and out.exists(), f"the TODO checks did not finish:\n{result.tail()}"
    return json.loads(out.read_text())


def max_difference(folder, reference) -> tuple[float, str]:
    mine = torch.load(folder / "model.pt", weights_only=True)["model"]
    theirs = torch.load(reference / "model.pt", weights_only=True)["model"]
    assert mine.keys() == theirs.keys(), f"different parameters: {sorted(mine.keys() ^ theirs.keys())[:4]}"
    return max((float((mine[k] - theirs[k]).abs().max()), k) for k in mine)


def todo_of(name: str) -> int | None:
    """The TODO a whole run depends on alone: 7 for DTensor; None for the hand-written ones (TODOs 1-6 together)."""
    return 7 if "dtensor" in name else None


def first_error(result) -> str:
    """A failed run's first error (not a rank that lost its peers) on one line, with the file and line it was raised
    at."""
    found = [(frames, error) for frames, error in tracebacks(result.output) if not any(s in error for s in SECONDARY)]
    if not found:
        return f"exit code {result.returncode}, no traceback"
    frames, error = found[0]
    return f"{error[:200]} ({Path(frames[-1][0]).name}:{frames[-1][1]})" if frames else error[:200]


def metrics_of(run, name: str) -> dict:
    """A finished run's metrics; else a failure naming the TODO it depends on (or the one it stopped at)."""
    result = run(name)[0]
    if todo_of(name):
        if result.returncode != 0 and not result.blame() and not re.search(r"TODO \d+:", result.output):
            error = first_error(result)
            if RUNS[name][2] and "must match the size" in error:  # the stream's sequence split, a region's output not
                error += (": likely a region's output is not split back along the sequence (o_proj or down_proj "
                          "leaving Replicate(), not Shard(1), with SP)")  # fmt: skip
            raise AssertionError(f"TODO {todo_of(name)}: the {name} run failed: {error}. Its last "
                                 f"lines:\n{result.tail()}")  # fmt: skip
        return finished(result, todo_of(name))
    assert result.returncode == 0, f"{name} failed (it needs TODOs 1-6). Its last lines:\n{result.tail()}"
    return result.metrics


def check_parity(run, name: str, hint: str):
    todo = todo_of(name)
    prefix = f"TODO {todo}: " if todo else ""
    one, one_folder = run("one")
    metrics, folder = metrics_of(run, name), run(name)[1]
    difference, where = max_difference(folder, one_folder)
    wrong = difference > TOLERANCE
    if wrong and RUNS.get(name, (0, "", False))[2] and "norm." in where:  # SP: the norms differ the most
        hint = (
            "the largest difference is on a norm: likely the norms are not in the SP plan (SequenceParallel), so each "
            "rank's norms learn from its own tokens only"
        )
    assert difference <= TOLERANCE, (
        f"{prefix}after 3 SGD steps, {name} differs from one process by {difference:.1e} on {where} ({hint})"
    )
    assert metrics["losses"] == pytest.approx(one.metrics["losses"], rel=1e-5), (
        f"{prefix}{name}: losses {metrics['losses']}, one process's {one.metrics['losses']}"
    )
    assert metrics["param_checksum"] == pytest.approx(one.metrics["param_checksum"], rel=1e-9), (
        f"{prefix}{name}: the full-parameter checksum is {metrics['param_checksum']}, one process's "
        f"{one.metrics['param_checksum']}"
    )


def unit(units, name: str, todo: int | None = None):
    """A check of tests/workers/tp_units.py: its message as the learner's line, "TODO n: ..." first."""
    status = units[name].removeprefix("not done: ")  # NotImplementedError("TODO n: ... is not done yet")
    prefix = f"TODO {todo}: " if todo and not status.startswith("TODO") else ""
    assert status == "ok", f"{prefix}{status}" if todo else f"{name}: {status}"


def test_todo1_f_and_g_conjugate_pair(units):
    unit(units, "todo1", 1)


def test_todo2_column_parallel_linear_matches_nn_linear(units):
    unit(units, "todo2", 2)


def test_todo3_row_parallel_linear_matches_nn_linear(units):
    unit(units, "todo3", 3)


def test_todo4_tensor_parallel_block_matches_one_process(units):
    unit(units, "todo4", 4)


def test_todo5_sequence_parallel_gather_and_reduce_scatter(units):
    unit(units, "todo5", 5)


def test_todo6_sequence_parallel_gradients_match_one_process(units):
    unit(units, "todo6", 6)


def test_dtensor_path_refuses_a_sequence_the_tp_size_does_not_divide(units):
    unit(units, "dtensor_refuses_sequence")


@pytest.mark.parametrize("name", ["tp2-scratch", "tp4-scratch", "tp2-scratch-sp", "tp4-scratch-sp"])
def test_hand_written_runs_match_one_process(run, name):
    check_parity(run, name, "TODOs 1-6 together: see which of their own checks fails")


@pytest.mark.parametrize("name", ["tp2-dtensor", "tp4-dtensor", "tp2-dtensor-sp", "tp4-dtensor-sp"])
def test_todo7_parallelize_module_matches_one_process(run, name):
    check_parity(run, name, "the plan: Colwise q/k/v/up, Rowwise o/down, SequenceParallel norms with SP")


def test_todo7_dtensor_placements_and_local_shapes(run):
    metrics = finished(run("tp4-dtensor")[0], 7)
    q, down = (
        metrics["examples"]["blocks.0.attention.q_proj.weight"],
        metrics["examples"]["blocks.0.mlp.down_proj.weight"],
    )
    assert q["type"] == "DTensor" and q["placements"] == ["Shard(dim=0)"], (
        f"TODO 7: q_proj.weight should be a DTensor placed Shard(dim=0) (its output features split), "
        f"got a {q['type']} placed {q['placements']}"
    )
    assert q["global_shape"] == [D, D] and q["local_shape"] == [D // 4, D], (
        f"TODO 7: q_proj.weight should be {[D, D]} whole and {[D // 4, D]} on each of 4 ranks, got "
        f"{q['global_shape']} and {q['local_shape']}"
    )
    assert down["placements"] == ["Shard(dim=1)"] and down["local_shape"] == [D, 4 * D // 4], (
        f"TODO 7: mlp.down_proj.weight should be placed Shard(dim=1) (its input features split), {[D, D]} on each "
        f"rank, got {down['placements']} and {down['local_shape']}"
    )


def expected_activation_collectives(sp: bool) -> dict:
    """{phase: {kind: [collectives, bytes of the whole tensors]}} of the activations in the first step, by formula.

    S = B x T x dim x 4 bytes, one activation of the residual stream. Without SP each block runs g (an all-reduce
    of S) after attention and after the MLP in forward, and f's all-reduce of S for each in backward. With SP each
    all-reduce becomes an all-gather (entering a region) and a reduce-scatter (leaving it), in forward and in
    backward, plus one all-gather at an end of the stack each way (the head's input in forward, the embeddings'
    gradient in backward). With SP the norms' partial gradients are all-reduced too, by each implementation its own
    way and at its own time: they are left out here, and parity checks them.
    """
    s = B * T * D * 4
    if not sp:
        return {phase: {"all_reduce": [2 * L, 2 * L * s]} for phase in ("forward", "backward")}
    each_way = {"all_gather": [2 * L + 1, (2 * L + 1) * s], "reduce_scatter": [2 * L, 2 * L * s]}
    return {"forward": each_way, "backward": each_way}


def check_activation_collectives(run, name: str):
    todo = todo_of(name)
    metrics = metrics_of(run, name)
    table, sp = metrics["collectives_step1"], RUNS[name][2]
    counted = {
        phase: {kind: value for kind, value in table.get(phase, {}).items() if not (sp and kind == "all_reduce")}
        for phase in ("forward", "backward")
    }
    expected = expected_activation_collectives(sp)
    phase, kind = next(((p, k) for p in expected for k in {**expected[p], **counted[p]}
                        if counted[p].get(k) != expected[p].get(k)), ("forward", "all_reduce"))  # fmt: skip
    got, want = counted[phase].get(kind, [0, 0]), expected[phase].get(kind, [0, 0])
    cause = ""
    if (phase, kind, sp) == ("backward", "all_reduce", False) and got[0] == 4 * L:  # 3 of q/k/v's + the MLP's f
        cause = (
            ": likely q, k and v each all-reduce their input's gradient (the attention's input reaches them as a "
            "local tensor, not one DTensor that is all-reduced once)"
        )
    assert counted == expected, (
        f"{f'TODO {todo}: ' if todo else ''}{name}: the first step's {phase} ran {got[0]} {kind}s of {got[1]:,} bytes "
        f"in all, the formula {want[0]} of {want[1]:,}{cause}"
    )


@pytest.mark.parametrize("name", [name for name in RUNS if "scratch" in name])
def test_hand_written_activation_collectives_equal_the_formula(run, name):
    check_activation_collectives(run, name)


@pytest.mark.parametrize("name", [name for name in RUNS if "dtensor" in name])
def test_todo7_activation_collectives_equal_the_formula(run, name):
    check_activation_collectives(run, name)


def activation_estimate(n: int, sp: bool) -> int:
    """Bytes autograd saves for backward on one rank: what each operation of the model keeps, sizes below in floats.

    Per block: each norm keeps its input and two statistics per token, and its output (kept by the next linear);
    with SP the input and statistics are 1/n of the sequence but the linears keep the gathered, whole input.
    Split by TP: q, k, v and attention's output (BTD/n each), the attention's log-sum-exp (B x heads/n x T), the MLP's
    hidden activation before and after GELU (B x T x 4D/n each). The end: final norm, head input, log-softmax
    output (B x T x vocab), and the int64 token ids, targets and positions.
    """
    btd, bt, hidden = B * T * D, B * T, B * T * 4 * D
    norm = (btd / n + 2 * bt / n + btd) if sp else (2 * btd + 2 * bt)
    block = 2 * norm + (4 * btd + 2 * hidden + B * HEADS * T) / n
    end = norm + B * T * CONFIG.vocab_size
    return int(4 * (L * block + end) + 8 * (2 * bt + T) + 4)  # + the loss's scalar weight


@pytest.mark.parametrize("n", [2, 4])
def test_activation_memory_matches_estimate_and_sequence_parallel_saves(run, n):
    sizes = {}
    for name in (f"tp{n}-dtensor", f"tp{n}-dtensor-sp", f"tp{n}-scratch", f"tp{n}-scratch-sp"):
        metrics = metrics_of(run, name)
        sizes[name] = metrics["activation_bytes"]
        estimate = activation_estimate(n, name.endswith("sp"))
        assert sizes[name] == pytest.approx(estimate, rel=0.05), (
            f"{name}: {sizes[name]} bytes saved, estimate {estimate}"
        )
    assert sizes[f"tp{n}-dtensor-sp"] < sizes[f"tp{n}-dtensor"], f"sequence parallelism should save memory: {sizes}"
    assert sizes[f"tp{n}-scratch"] == sizes[f"tp{n}-dtensor"], f"both implementations keep the same tensors: {sizes}"


def test_tp_impl_and_sequence_parallel_change_the_layers_and_the_collectives(run):
    """What --tp-impl and --sequence-parallel change in the 2-rank runs: the kind of the sharded weights (DTensor
    from parallelize_module, a plain Parameter slice by hand), and the activations' collectives (an all-reduce of the
    whole activation without SP; an all-gather entering and a reduce-scatter leaving each region with SP, which
    keeps fewer bytes for backward)."""
    saved = {}
    for name in [name for name in RUNS if name.startswith("tp2-")]:
        result = run(name)[0]
        metrics = metrics_of(run, name)
        impl, sp = passed(result, "--tp-impl"), passed(result, "--sequence-parallel", False)
        q = metrics["examples"]["blocks.0.attention.q_proj.weight"]
        assert (metrics["tp_impl"], metrics["sequence_parallel"]) == (impl, sp), f"{name}: {metrics['tp_impl']}"
        assert q["type"] == ("DTensor" if impl == "dtensor" else "Parameter"), f"--tp-impl {impl}: q_proj is {q}"
        assert q["local_shape"] == [D // 2, D], f"--tp-impl {impl}: q_proj is {q}"
        kinds = set(metrics["collectives_step1"]["forward"])
        expected = {"all_gather", "reduce_scatter"} if sp else {"all_reduce"}
        assert kinds == expected, f"{name}: forward collectives {kinds}, with --sequence-parallel {sp}: {expected}"
        saved[impl, sp] = metrics["activation_bytes"]
    for impl in ("scratch", "dtensor"):
        assert saved[impl, True] < saved[impl, False], f"--sequence-parallel should keep fewer bytes: {saved}"


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line but --autocast (refused), at a value other than its default, on one
    process (a tensor-parallel group of one, the default --tp-impl dtensor): the run trains like the same steps
    written out with PyTorch alone on lesson 00's batches (tests/harness/option_effects.py), logged where it says."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json",
    ]  # fmt: skip
    result = python(lesson("04"), args, timeout=180)
    finished(result, 7)
    metrics = check_shared_options(result, order="generator")
    assert metrics["tp_size"] == 1 and metrics["tp_impl"] == "dtensor", metrics["tp_size"]


def test_parameter_bytes_per_rank_shrink_with_tp(run):
    """Embeddings, norms, the head and the row-parallel biases are whole on every rank; the rest is 1/n."""
    v, hidden = CONFIG.vocab_size, 4 * D
    sharded = L * (4 * D * D + 3 * D + 2 * D * hidden + hidden)  # q/k/v/o weights, q/k/v biases, up/down, up's bias
    replicated = v * D + T * D + L * (4 * D + 2 * D) + 2 * D + D * v + v
    for n in (2, 4):
        for name in (f"tp{n}-scratch", f"tp{n}-dtensor"):
            metrics = metrics_of(run, name)
            assert metrics["bytes_per_rank"]["params"] == 4 * (replicated + sharded // n), name


def load_lesson(path):
    return load_script(path, "lesson04")


def test_refuses_a_tp_size_that_does_not_divide_heads_or_sequence(lesson, tmp_path):
    module = load_lesson(lesson("04"))
    for tp, seq, expected in ((3, 32, "--n-heads 4"), (4, 30, "--seq-len 30")):
        with pytest.raises(CourseError, match=re.escape(expected)):
            module.check_tensor_parallel_size(CONFIG, tp, seq, sequence_parallel=True)
    args = [*COMMON, "--n-heads", "1", "--log-dir", tmp_path / "runs"]
    refused = torchrun(lesson("04"), 2, args, timeout=90)
    assert refused.returncode != 0
    errors = [line for line in refused.output.splitlines() if "ERROR:" in line]
    assert errors and "does not divide --n-heads 1" in errors[0], refused.tail()
    assert "Traceback" not in refused.output.split("ERROR:")[0], "a one-line message, not a traceback"


def test_refuses_autocast_instead_of_ignoring_it(lesson, monkeypatch, capsys):
    """The script trains in fp32 only (parity needs it): --autocast is refused before any process group starts."""
    module = load_lesson(lesson("04"))
    monkeypatch.setattr("sys.argv", ["04_tensor_parallel.py", *map(str, COMMON), "--autocast", "bf16"])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2 and "unrecognized arguments: --autocast bf16" in capsys.readouterr().err


def test_rank0_prints_once_and_finishes(run):
    result, _ = run("tp4-dtensor-sp")
    finished(result, 7)
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1, "print with print0: once, from rank 0"


def test_untouched_exercise_stops_at_once_at_the_first_todo(tmp_path):
    """The generated exercise (not your edited copy) stops at the first TODO it meets, on every rank at once:
    the hand-written path at TODO 1 (the script checks its pieces in TODO order before training)."""
    exercise = handed_out("04_tensor_parallel.py", tmp_path / "exercises")
    env = course_env(PYTHONPATH=ROOT)  # the copy lives outside the course folder
    for extra, todo in (
        (["--tp-impl", "dtensor"], "TODO 7: the same layout with DTensor"),
        (["--tp-impl", "scratch", "--sequence-parallel"], "TODO 1: the conjugate pair f and g"),
    ):
        result = torchrun(exercise, 2, [*COMMON, *extra, "--log-dir", tmp_path / "runs"], timeout=90, env=env)
        assert result.returncode != 0 and f"ERROR: {todo} is not done yet" in result.output, result.tail()


def test_an_exercise_with_todos_4_and_5_undone_names_todo_4_first_on_a_sequence_parallel_run(tmp_path):
    """The script checks its hand-written pieces in TODO order, the block (TODO 4) before the SP pair (TODO 5)."""
    solution = ROOT / "solutions" / "04_tensor_parallel.py"
    script = tmp_path / solution.name
    script.write_text(make_exercise(solution.read_text(), solution.name, done={1, 2, 3, 6, 7, 8})[0])
    args = [*COMMON, "--tp-impl", "scratch", "--sequence-parallel", "--log-dir", tmp_path / "runs"]
    result = torchrun(script, 2, args, timeout=90, env=course_env(PYTHONPATH=ROOT))
    assert result.returncode != 0, result.tail()
    assert "ERROR: TODO 4: a tensor-parallel block is not done yet" in result.output, result.tail()


def only_todo_undone(solution_text: str, number: int) -> str:
    """The solution with only TODO `number`'s region replaced by what the exercise has there."""
    exercise = make_exercise(solution_text, "04_tensor_parallel.py")[0]
    header = re.compile(rf"^\s*# TODO {number}: ")
    start = next(i for i, line in enumerate(solution_text.splitlines()) if header.match(line))
    lines = solution_text.splitlines()
    begin = lines.index(next(line for line in lines[start:] if line.strip() == "# BEGIN SOLUTION"), start)
    end = lines.index(next(line for line in lines[begin:] if line.strip() == "# END SOLUTION"), begin)
    stub = next(line for line in exercise.splitlines() if f'NotImplementedError("TODO {number}:' in line)
    return "\n".join(lines[:begin] + [stub] + lines[end + 1 :]) + "\n"


def test_an_exercise_without_todo6_stops_there_on_a_sequence_parallel_run(tmp_path):
    """Without TODO 6 the norms' gradients would stay partial and an SP run would train wrong, silently: it stops."""
    solution = ROOT / "solutions" / "04_tensor_parallel.py"
    script = tmp_path / solution.name
    script.write_text(only_todo_undone(solution.read_text(), 6))
    args = [*COMMON, "--tp-impl", "scratch", "--sequence-parallel", "--log-dir", tmp_path / "runs"]
    result = torchrun(script, 2, args, timeout=90, env=course_env(PYTHONPATH=ROOT))
    assert result.returncode != 0, result.tail()
    assert "ERROR: TODO 6: sequence-parallel gradients is not done yet" in result.output, result.tail()


# --------------------------------------------------------------------------------------------------
# TODO 8: the debugging lab (ranks that train without an error and disagree), graded like lessons 01 and 02's
# --------------------------------------------------------------------------------------------------


def test_todo8_lab_a_tensor_parallel_layer_without_its_g(lesson, tmp_path):
    """2 ranks train the lab's MLP 3 SGD steps; every rank's losses must be one process's (gloo, 5 s timeout)."""
    out = tmp_path / "lab.json"
    torchrun(LAB_WORKER, 2, [lesson("04"), out], timeout=120).check()
    message = failure(json.loads(out.read_text()), 8)
    assert message is None, message
