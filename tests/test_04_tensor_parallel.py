"""Lesson 04: N tensor-parallel ranks train exactly like one process, and communicate what the formula says.

pytest tests/test_04_tensor_parallel.py                      # the solution
pytest tests/test_04_tensor_parallel.py --target exercises   # your exercise (make check LESSON=04)

Each run is launched once, the first time a test needs it, and shared by the tests below. The reference is
lesson 00's single-process script on the same batches (every tensor-parallel rank reads the whole batch).
"""

import importlib.util
import json
import re

import pytest
import torch

from tests.launch import ROOT, course_env, finished, python, torchrun
from utils.distributed_utils import CourseError
from utils.make_exercises import make_exercise
from utils.model import ModelConfig

TOLERANCE = 1e-6  # fp32, SGD: the ranks' partial sums are added in another order than one process's
B, T, D, L, HEADS = 4, 32, 32, 2, 4
CONFIG = ModelConfig(seq_len=T, dim=D, n_layers=L, n_heads=HEADS)
COMMON = [
    *["--dim", D, "--n-layers", L, "--n-heads", HEADS, "--seq-len", T, "--batch-size", B],
    *["--steps", "3", "--optimizer", "sgd", "--log-every", "1"],
]
RUNS = {f"tp{n}-{impl}{'-sp' * sp}": (n, impl, sp) for n in (2, 4) for impl in ("scratch", "dtensor") for sp in (0, 1)}
WORKER = ROOT / "tests" / "workers" / "tp_layers.py"


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): "one" is lesson 00 on one process, else RUNS[name] of this lesson."""
    tmp, done = tmp_path_factory.mktemp("lesson04"), {}

    def launch(name):
        if name not in done:
            folder = tmp / name
            folder.mkdir()
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
    """The layer-level checks of TODOs 1-4 (tests/workers/tp_layers.py), run once on 2 ranks."""
    out = tmp_path_factory.mktemp("units") / "units.json"
    result = torchrun(WORKER, 2, [lesson("04"), out], timeout=120)
    assert result.returncode == 0 and out.exists(), f"the layer checks did not finish:\n{result.tail()}"
    return json.loads(out.read_text())


def max_difference(folder, reference) -> tuple[float, str]:
    mine = torch.load(folder / "model.pt", weights_only=True)["model"]
    theirs = torch.load(reference / "model.pt", weights_only=True)["model"]
    assert mine.keys() == theirs.keys(), f"different parameters: {sorted(mine.keys() ^ theirs.keys())[:4]}"
    return max((float((mine[k] - theirs[k]).abs().max()), k) for k in mine)


def check_parity(run, name: str, todo: int, hint: str):
    one, one_folder = run("one")
    result, folder = run(name)
    metrics = finished(result, todo)
    difference, where = max_difference(folder, one_folder)
    assert difference <= TOLERANCE, (
        f"TODO {todo}: after 3 SGD steps, {name} differs from one process by {difference:.1e} on {where} ({hint})"
    )
    assert metrics["losses"] == pytest.approx(one.metrics["losses"], rel=1e-5), f"TODO {todo}: losses differ"
    assert metrics["param_checksum"] == pytest.approx(one.metrics["param_checksum"], rel=1e-9), (
        f"TODO {todo}: the full-parameter checksum differs from one process's"
    )


def unit(units, todo: int):
    status = units[f"todo{todo}"]
    assert status == "ok", f"TODO {todo}: {status}"


def test_todo1_f_and_g_conjugate_pair(units):
    unit(units, 1)


def test_todo2_column_parallel_linear_matches_nn_linear(units):
    unit(units, 2)


def test_todo3_row_parallel_linear_matches_nn_linear(units):
    unit(units, 3)


def test_todo4_sequence_parallel_gather_and_reduce_scatter(units):
    unit(units, 4)


@pytest.mark.parametrize("name", ["tp2-scratch", "tp4-scratch"])
def test_todo5_tensor_parallel_blocks_match_one_process(run, name):
    check_parity(run, name, 5, "shard q/k/v/up by columns and o/down by rows, and enter each region with f once")


@pytest.mark.parametrize("name", ["tp2-scratch-sp", "tp4-scratch-sp"])
def test_todo6_sequence_parallel_gradients_match_one_process(run, name):
    check_parity(run, name, 6, "all-reduce the norms' and row biases' partial gradients after backward")


@pytest.mark.parametrize("name", ["tp2-dtensor", "tp4-dtensor", "tp2-dtensor-sp", "tp4-dtensor-sp"])
def test_todo7_parallelize_module_matches_one_process(run, name):
    check_parity(run, name, 7, "the plan: Colwise q/k/v/up, Rowwise o/down, SequenceParallel norms with SP")


def test_todo7_dtensor_placements_and_local_shapes(run):
    metrics = finished(run("tp4-dtensor")[0], 7)
    q, down = (
        metrics["examples"]["blocks.0.attention.q_proj.weight"],
        metrics["examples"]["blocks.0.mlp.down_proj.weight"],
    )
    assert q["type"] == "DTensor" and q["placements"] == ["Shard(dim=0)"], f"TODO 7: q_proj.weight is {q}"
    assert q["global_shape"] == [D, D] and q["local_shape"] == [D // 4, D], f"TODO 7: q_proj.weight is {q}"
    assert down["placements"] == ["Shard(dim=1)"] and down["local_shape"] == [D, 4 * D // 4], f"TODO 7: {down}"


def expected_communication(name: str) -> dict:
    """{kind: (collectives, bytes of the full tensors)} per training step, from the formula.

    S = B x T x dim x 4 bytes, one activation of the residual stream. Without SP each block runs g (an all-reduce
    of S) after attention and after the MLP in forward, and f's all-reduce of S for each in backward: 4L of them.
    With SP each all-reduce becomes an all-gather (entering a region) and a reduce-scatter (leaving it), forward
    and backward: 4L of each, plus the two ends of the stack (the head's input gathered in forward, the embeddings'
    gradient gathered in backward), and the all-reduce of the norms' partial gradients.
    """
    _, impl, sp = RUNS[name]
    s = B * T * D * 4
    if not sp:
        return {"all_reduce": (4 * L, 4 * L * s)}
    norms = 2 * (2 * L + 1) * D  # weight + bias of two norms per block and the final norm
    if impl == "scratch":  # one flat all-reduce of the norms' and the row-parallel biases' gradients
        grads = (1, 4 * (norms + 2 * L * D))
    else:  # DTensor reduces each norm parameter's Partial gradient on its own (in the optimizer step); its row
        grads = (2 * (2 * L + 1), 4 * norms)  # biases' gradients come out whole without a collective of their own
    return {"all_gather": (4 * L + 2, (4 * L + 2) * s), "all_reduce": grads, "reduce_scatter": (4 * L, 4 * L * s)}


@pytest.mark.parametrize("name", list(RUNS))
def test_communication_counted_equals_formula(run, name):
    metrics = finished(run(name)[0], 7 if "dtensor" in name else 5)
    counted = {
        k: (metrics["collectives_per_step"][k], metrics["comm_bytes_per_step"][k])
        for k in metrics["collectives_per_step"]
    }
    assert counted == expected_communication(name), f"{name}: counted {counted}, formula {expected_communication(name)}"


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_sends_the_same_bytes_per_block(run, n):
    """On a ring, an all-reduce of S sends 2(n-1)/n S per rank; a reduce-scatter or an all-gather (n-1)/n S."""
    tp, sp = finished(run(f"tp{n}-scratch")[0], 5), finished(run(f"tp{n}-scratch-sp")[0], 6)
    ring = (n - 1) / n
    tp_bytes = 2 * ring * tp["comm_bytes_per_step"]["all_reduce"]
    ends = 2 * B * T * D * 4  # SP's two extra gathers at the ends of the stack
    sp_bytes = ring * (sp["comm_bytes_per_step"]["all_gather"] - ends + sp["comm_bytes_per_step"]["reduce_scatter"])
    assert sp_bytes == pytest.approx(tp_bytes), f"the blocks send {sp_bytes} bytes with SP, {tp_bytes} without"


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
        metrics = finished(run(name)[0], 7 if "dtensor" in name else 5)
        sizes[name] = metrics["activation_bytes"]
        estimate = activation_estimate(n, name.endswith("sp"))
        assert sizes[name] == pytest.approx(estimate, rel=0.05), (
            f"{name}: {sizes[name]} bytes saved, estimate {estimate}"
        )
    assert sizes[f"tp{n}-dtensor-sp"] < sizes[f"tp{n}-dtensor"], f"sequence parallelism should save memory: {sizes}"
    assert sizes[f"tp{n}-scratch"] == sizes[f"tp{n}-dtensor"], f"both implementations keep the same tensors: {sizes}"


def test_parameter_bytes_per_rank_shrink_with_tp(run):
    """Embeddings, norms, the head and the row-parallel biases are whole on every rank; the rest is 1/n."""
    v, hidden = CONFIG.vocab_size, 4 * D
    sharded = L * (4 * D * D + 3 * D + 2 * D * hidden + hidden)  # q/k/v/o weights, q/k/v biases, up/down, up's bias
    replicated = v * D + T * D + L * (4 * D + 2 * D) + 2 * D + D * v + v
    for n in (2, 4):
        for name in (f"tp{n}-scratch", f"tp{n}-dtensor"):
            metrics = finished(run(name)[0], 7 if "dtensor" in name else 5)
            assert metrics["bytes_per_rank"]["params"] == 4 * (replicated + sharded // n), name


def load_lesson(path):
    spec = importlib.util.spec_from_file_location("lesson04", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_rank0_prints_once_and_finishes(run):
    result, _ = run("tp4-dtensor-sp")
    finished(result, 7)
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1, "print with print0: once, from rank 0"


def test_untouched_exercise_stops_at_once_naming_a_todo(tmp_path):
    """The generated exercise (not your edited copy) stops at the first TODO it meets, on every rank at once."""
    solution = ROOT / "solutions" / "04_tensor_parallel.py"
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(make_exercise(solution.read_text(), solution.name)[0])
    env = course_env(PYTHONPATH=ROOT)  # the copy lives outside the course folder
    for impl, todo in (
        ("dtensor", "TODO 7: the same layout with DTensor"),
        ("scratch", "TODO 5: a tensor-parallel block"),
    ):
        result = torchrun(
            exercise, 2, [*COMMON, "--tp-impl", impl, "--log-dir", tmp_path / "runs"], timeout=90, env=env
        )
        assert result.returncode != 0 and f"ERROR: {todo} is not done yet" in result.output, result.tail()
