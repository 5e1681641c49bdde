"""Lesson 07: every method's bytes per step match its formula, and each reduces to plain DDP where it should.

pytest tests/test_07_communication_efficient.py                      # the solution
pytest tests/test_07_communication_efficient.py --target exercises   # your exercise (make check LESSON=07)

Each run is launched once, the first time a test needs it, and shared by the tests below. Bytes are what
the script's WireTap counted: what one rank sends on a ring, 2(n-1)/n x B for an all-reduce of B bytes and
(n-1) x B for an all-gather of B bytes from each rank. P = the model's parameters, 4 bytes each.
"""

import importlib.util
import math
import re

import pytest
import torch
import torch.distributed as dist

from tests.launch import ROOT, course_env, python, torchrun
from utils.make_exercises import make_exercise
from utils.model import ModelConfig, build_model, count_parameters

CONFIG = ModelConfig(seq_len=32, dim=32, n_layers=2, n_heads=2)
P = count_parameters(CONFIG)
STEPS = 6
SMALL = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--optimizer", "sgd"]
COMMON = [*SMALL, "--steps", str(STEPS), "--log-every", "1"]
RUNS = {  # name: (processes, arguments); every run has a global batch of 8 sequences
    "one": (1, ["--method", "none"]),
    "none": (2, ["--method", "none"]),
    "fp16": (2, ["--method", "fp16"]),
    "bf16": (2, ["--method", "bf16"]),
    "topk": (2, ["--method", "topk", "--topk-ratio", "0.05"]),
    "topk_all": (2, ["--method", "topk", "--topk-ratio", "1"]),
    "quantize": (2, ["--method", "quantize", "--bits", "8"]),
    "quantize32": (2, ["--method", "quantize", "--bits", "32"]),
    "powersgd1": (2, ["--method", "powersgd", "--powersgd-rank", "1"]),
    "local1": (2, ["--method", "localsgd", "--local-steps", "1"]),
    "local3": (2, ["--method", "localsgd", "--local-steps", "3"]),
    "postlocal": (2, ["--method", "postlocal", "--local-steps", "2", "--local-group-size", "1"]),
    "topk4": (4, ["--method", "topk", "--topk-ratio", "0.05"]),
    "quantize4": (4, ["--method", "quantize", "--bits", "8"]),
    "powersgd4": (4, ["--method", "powersgd", "--powersgd-rank", "4"]),
}
# fp16 keeps 11 significant bits (unit roundoff u = 2^-11), bf16 8 (u = 2^-8). After a few SGD steps the loss
# moves by a fraction of its value; rounding the gradients changes that movement by about u, so we allow 4u
# of the loss, relative, which a wrong hook (gradients not averaged, or dropped) exceeds by far.
COMPRESSION_TOLERANCE = {"fp16": 4 * 2.0**-11, "bf16": 4 * 2.0**-8}


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson07"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            folder.mkdir()
            batch = ["--batch-size", str(8 // nproc)]
            args = [*COMMON, *batch, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            if nproc == 1:
                done[name] = python(lesson("07"), args, tmp_path=folder), folder
            else:
                done[name] = torchrun(lesson("07"), nproc, args, tmp_path=folder), folder
        return done[name]

    return launch


def finished(run, name: str, todo: int | str) -> dict:
    """The run's metrics, or a failure naming the TODO the run stopped at (else `todo`)."""
    result, _ = run(name)
    stopped = re.search(r"TODO (\d+):", result.output)
    what = f"TODO {stopped.group(1)}" if stopped else (f"checking TODO {todo}" if isinstance(todo, int) else todo)
    assert result.returncode == 0, f"{what}: the {name} run failed. Its last lines:\n{result.tail()}"
    return result.metrics


def weights(run, name) -> dict:
    return torch.load(run(name)[1] / "model.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def all_reduce_bytes(nbytes, n):
    return 2 * (n - 1) / n * nbytes


def all_gather_bytes(nbytes, n):
    return (n - 1) * nbytes


def load_lesson(path):
    """Import the lesson script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("lesson07", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lesson07(lesson):
    return load_lesson(lesson("07"))


def synchronous(metrics, todo):
    """Every rank holds the same parameters after every step (the checksums of all ranks are equal)."""
    assert metrics["rank_spread"] == [0.0] * STEPS, (
        f"{todo}: the ranks' parameters drifted apart ({metrics['rank_spread']}): every rank must decode the same "
        "average, in the same order"
    )


# --------------------------------------------------------------------------------------------------
# The from-scratch methods, TODO by TODO
# --------------------------------------------------------------------------------------------------


def test_todo1_allreduce_hook_averages_every_gradient_once(run):
    metrics = finished(run, "none", 1)
    assert sum(metrics["bucket_sizes"]) == P, "the hook should have seen every gradient in some bucket"
    expected = all_reduce_bytes(4 * P, 2)
    assert metrics["bytes_sent"] == [expected] * STEPS, (
        f"TODO 1: one all-reduce of the {4 * P:,}-byte bucket per step sends {expected:,.0f} bytes per rank, "
        f"not {metrics['bytes_sent']}"
    )
    synchronous(metrics, "TODO 1")
    one = finished(run, "one", 1)
    difference = max_difference(weights(run, "none"), weights(run, "one"))
    assert difference <= 1e-6, (
        f"TODO 1: 2 ranks x 4 sequences differ from 1 process x 8 by {difference:.1e} after {STEPS} SGD steps: "
        "the hook must return the average (divide the sum by the group size), not the sum"
    )
    assert metrics["losses"] == pytest.approx(one["losses"], rel=1e-5), "TODO 1"


class FakeBucket:
    """What a hook uses of dist.GradBucket: its flat buffer and its index."""

    def __init__(self, tensor, index=0):
        self.tensor, self._index = tensor, index

    def buffer(self):
        return self.tensor

    def index(self):
        return self._index


@pytest.fixture(scope="module")
def group_of_one():
    """A process group of one rank, in this test process, for calling hooks directly."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_todo2_topk_keeps_what_it_did_not_send_for_later(lesson07, group_of_one):
    state = lesson07.TopKState(ratio=1 / 3)  # k = 1 of 3 entries
    first = lesson07.topk_hook(state, FakeBucket(torch.tensor([3.0, -1.0, 2.0]))).wait()
    assert first.tolist() == [3.0, 0.0, 0.0], f"TODO 2: with k = 1, send the largest entry only, not {first}"
    second = lesson07.topk_hook(state, FakeBucket(torch.tensor([0.0, 0.0, 0.5]))).wait()
    assert second.tolist() == [0.0, 0.0, 2.5], (
        f"TODO 2: error feedback: the 2 kept back from step 1 plus 0.5 now is the largest entry; got {second}"
    )
    third = lesson07.topk_hook(state, FakeBucket(torch.tensor([0.0, 0.0, 0.0]))).wait()
    assert third.tolist() == [0.0, -1.0, 0.0], f"TODO 2: the -1 kept back since step 1 goes out last; got {third}"


@pytest.mark.parametrize("name, n", [("topk", 2), ("topk4", 4)])
def test_todo2_topk_sends_k_values_and_indices(run, name, n):
    metrics = finished(run, name, 2)
    k = [math.ceil(0.05 * size) for size in metrics["bucket_sizes"]]
    expected = sum(all_gather_bytes(ki * (4 + 4), n) for ki in k)  # float32 value + int32 index, from each rank
    assert metrics["bytes_sent"] == [expected] * STEPS, (
        f"TODO 2: k = {k} entries (value + int32 index) all-gathered from each of {n} ranks send {expected:,.0f} "
        f"bytes per rank per step, not {metrics['bytes_sent']}"
    )
    synchronous(metrics, "TODO 2")


def test_todo2_topk_of_everything_is_plain_ddp_exactly(run):
    """k = all entries: every rank sends everything, nothing is kept back, and the sum is the same sum."""
    finished(run, "topk_all", 2)
    finished(run, "none", 1)
    difference = max_difference(weights(run, "topk_all"), weights(run, "none"))
    assert difference == 0.0, f"TODO 2: --topk-ratio 1 should train exactly like --method none; differs by {difference}"


def test_todo3_stochastic_rounding_is_unbiased(lesson07):
    """The mean of many quantizations of one tensor tends to the tensor: within 6 standard errors, per entry."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    generator, draws = torch.Generator().manual_seed(1), 1000
    for bits in (2, 8):
        codes, scale = lesson07.quantize(x, bits, generator)
        levels = 2 ** (bits - 1) - 1
        assert codes.dtype == torch.int8, f"TODO 3: {bits}-bit codes travel as int8, not {codes.dtype}"
        assert int(codes.abs().max()) <= levels, f"TODO 3: {bits}-bit codes lie in [-{levels}, {levels}]"
        assert float(scale) == pytest.approx(float(x.abs().max()) / levels, rel=1e-6), "TODO 3: scale = max|x| / L"
        total = torch.zeros_like(x, dtype=torch.float64)  # summed in float64: no rounding error of its own
        for _ in range(draws):
            total += lesson07.dequantize(*lesson07.quantize(x, bits, generator)).double()
        mean = total / draws
        # Each draw rounds x/scale up with probability p = its fractional part: variance scale^2 p (1 - p).
        fraction = (x / scale - (x / scale).floor()).double()
        standard_error = float(scale) * (fraction * (1 - fraction)).sqrt() / math.sqrt(draws)
        worst = float(((mean - x).abs() - 6 * standard_error).max())
        assert worst <= 1e-6, (
            f"TODO 3: {bits} bits: the mean of {draws} quantizations misses x by more than 6 standard errors "
            "(round up with probability = the fractional part, using the generator)"
        )
        # The test can fail: rounding to the nearest level is biased, far beyond that tolerance.
        nearest = (x / scale).round() * scale
        assert float(((nearest - x).abs() - 6 * standard_error).max()) > 1e-6
    same, one = lesson07.quantize(x, 32, generator)
    assert torch.equal(lesson07.dequantize(same, one), x), "32 bits: the tensor itself, nothing rounded"


@pytest.mark.parametrize("name, n", [("quantize", 2), ("quantize4", 4)])
def test_todo4_quantized_gradients_are_one_byte_each(run, name, n):
    metrics = finished(run, name, 4)
    expected = sum(all_gather_bytes(size * 1 + 4, n) for size in metrics["bucket_sizes"])  # int8 codes + scale
    assert metrics["bytes_sent"] == [expected] * STEPS, (
        f"TODO 4: one int8 code per gradient plus one float32 scale, all-gathered from {n} ranks, sends "
        f"{expected:,.0f} bytes per rank per step, not {metrics['bytes_sent']}"
    )
    synchronous(metrics, "TODO 4")


def test_todo4_32_bit_quantization_is_plain_ddp_exactly(run):
    finished(run, "quantize32", 4)
    finished(run, "none", 1)
    difference = max_difference(weights(run, "quantize32"), weights(run, "none"))
    assert difference == 0.0, f"TODO 4: --bits 32 should train exactly like --method none; differs by {difference}"


def test_todo5_local_sgd_with_one_local_step_is_ddp(run):
    """H = 1: averaging the models after every SGD step = stepping with the averaged gradient (up to rounding)."""
    metrics = finished(run, "local1", 5)
    finished(run, "none", 1)
    difference = max_difference(weights(run, "local1"), weights(run, "none"))
    assert difference <= 1e-6, f"TODO 5: --local-steps 1 should match DDP to 1e-6 (fp32 rounding), not {difference:.1e}"
    assert metrics["bytes_sent"] == [all_reduce_bytes(4 * P, 2)] * STEPS, "TODO 5: one average of P floats per step"


def test_todo5_local_sgd_averages_every_h_steps(run):
    metrics = finished(run, "local3", 5)
    averaging = [step % 3 == 0 for step in range(1, STEPS + 1)]
    expected = [all_reduce_bytes(4 * P, 2) if avg else 0.0 for avg in averaging]
    assert metrics["bytes_sent"] == expected, (
        f"TODO 5: --local-steps 3 all-reduces the {4 * P:,} bytes of parameters at steps 3 and 6 only "
        f"(1/3 of DDP's bytes): {metrics['bytes_sent']}"
    )
    spread = metrics["rank_spread"]
    assert all(s == 0.0 for s, avg in zip(spread, averaging) if avg), (
        f"TODO 5: right after an average every rank holds the same parameters: {spread}"
    )
    assert any(s > 0.0 for s, avg in zip(spread, averaging) if not avg), "between averages the ranks drift apart"


# --------------------------------------------------------------------------------------------------
# The built-in hooks, counted the same way
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_16_bit_compression_halves_the_bytes_and_nearly_matches_full_precision(run, name):
    metrics, full = finished(run, name, "the built-in hook"), finished(run, "none", 1)
    assert metrics["bytes_sent"] == [all_reduce_bytes(2 * P, 2)] * STEPS, f"{name}: 2 bytes per gradient"
    assert [s / 2 for s in full["bytes_sent"]] == metrics["bytes_sent"], f"{name} sends 1/2 of fp32's bytes"
    tolerance = COMPRESSION_TOLERANCE[name]
    assert metrics["final_loss"] == pytest.approx(full["final_loss"], rel=tolerance), (
        f"{name}: final loss {metrics['final_loss']:.6f} vs fp32's {full['final_loss']:.6f} "
        f"(relative tolerance {tolerance:.1e})"
    )
    synchronous(metrics, name)


def powersgd_bytes(rank: int) -> int:
    """Payload of one PowerSGD step: each matrix worth compressing sends P (rows x r) and Q (cols x r), the
    others (biases, norms: 1-D) go uncompressed. Worth it when (rows + cols) x r x 2 < rows x cols."""
    floats = 0
    for parameter in build_model(CONFIG, seed=0).parameters():
        rows, cols = parameter.shape[0], parameter[0].numel()
        r = min(rows, cols, rank)
        floats += r * (rows + cols) if (rows + cols) * r * 2 < rows * cols else rows * cols
    return 4 * floats


@pytest.mark.parametrize("name, n, rank", [("powersgd1", 2, 1), ("powersgd4", 4, 4)])
def test_powersgd_sends_rank_times_rows_plus_columns(run, name, n, rank):
    metrics = finished(run, name, "PowerSGD")
    start = metrics["compress_start"]
    expected = [all_reduce_bytes(4 * P, n)] * start + [all_reduce_bytes(powersgd_bytes(rank), n)] * (STEPS - start)
    assert metrics["bytes_sent"] == pytest.approx(expected, rel=1e-12), (
        f"PowerSGD rank {rank}: full all-reduce for {start} steps, then r x (rows + cols) per matrix"
    )
    assert expected[-1] < expected[0] / 4, "the formula itself: PowerSGD sends a fraction of DDP's bytes"
    synchronous(metrics, "PowerSGD")


def test_post_local_sgd_averages_periodically_after_warm_up(run):
    metrics = finished(run, "postlocal", "post-local SGD")
    start, period = metrics["compress_start"], metrics["local_steps"]
    # Steps 1..start: DDP. Then PeriodicModelAverager averages after step start+1, start+1+period, ...;
    # gradients are all-reduced within groups of one rank: nothing on the wire.
    averaging = [step > start and (step - 1 - start) % period == 0 for step in range(1, STEPS + 1)]
    expected = [all_reduce_bytes(4 * P, 2) if step <= start or avg else 0.0 for step, avg in enumerate(averaging, 1)]
    assert metrics["bytes_sent"] == expected, metrics["bytes_sent"]
    spread = metrics["rank_spread"]
    assert all(s == 0.0 for step, (s, avg) in enumerate(zip(spread, averaging), 1) if avg or step <= start), spread
    assert any(s > 0.0 for s, avg in zip(spread, averaging) if not avg), "between averages the ranks drift apart"


# --------------------------------------------------------------------------------------------------
# The script as a learner runs it
# --------------------------------------------------------------------------------------------------


def test_rank0_prints_once_and_finishes(run):
    result, _ = run("topk4")
    finished(run, "topk4", 2)
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1, "print with print0: once, from rank 0"
    assert sum(line.startswith("step    6") for line in lines) == 1


def test_bad_option_is_one_line(lesson, tmp_path):
    result = python(lesson("07"), [*COMMON, "--method", "topk", "--topk-ratio", "0"])
    assert result.returncode == 2 and "--topk-ratio" in result.output, result.tail()
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_untouched_exercise_stops_at_todo1(tmp_path):
    """The generated exercise (not your edited copy) stops at its first backward, naming TODO 1."""
    solution = ROOT / "solutions" / "07_communication_efficient.py"
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(make_exercise(solution.read_text(), solution.name)[0])
    env = course_env(PYTHONPATH=ROOT)  # the copy lives outside the course folder
    args = [*COMMON, "--batch-size", "4", "--log-dir", tmp_path / "runs"]
    result = torchrun(exercise, 2, args, timeout=90, env=env)
    assert result.returncode != 0 and "ERROR: TODO 1: a DDP communication hook is not done yet" in result.output, (
        result.tail()
    )
