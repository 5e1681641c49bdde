"""Lesson 07: every method's bytes per step match its formula, and each reduces to plain DDP where it should.

pytest tests/test_07_communication_efficient.py                      # the solution
pytest tests/test_07_communication_efficient.py --target exercises   # your exercise (make check LESSON=07)

Each run is launched once, the first time a test needs it, and shared by the tests below. Bytes are what
the script's WireTap counted: what one rank sends on a ring, 2(n-1)/n x B for an all-reduce of B bytes and
(n-1) x B for an all-gather of B bytes from each rank. P = the model's parameters, 4 bytes each.
The reference of every parity check is one process with the whole batch ("one"), never another of your hooks.
The hooks are also checked inside real DDP by tests/workers/lesson07_hooks.py (2 ranks): top-k's error feedback
after DDP rebuilds its buckets, a top-k resume from a checkpoint, and the quantized average for every --bits.
"""

import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.harness.launch import ROOT, course_env, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext, passed, written_out_training
from utils.course.lessons import load_script
from utils.course.make_exercises import make_exercise
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
    "quantize2": (2, ["--method", "quantize", "--bits", "2"]),
    "quantize4": (2, ["--method", "quantize", "--bits", "4"]),
    "quantize8": (2, ["--method", "quantize", "--bits", "8"]),
    "quantize16": (2, ["--method", "quantize", "--bits", "16"]),
    "quantize32": (2, ["--method", "quantize", "--bits", "32"]),
    "powersgd1": (2, ["--method", "powersgd", "--powersgd-rank", "1"]),
    "local1": (2, ["--method", "localsgd", "--local-steps", "1"]),
    "local3": (2, ["--method", "localsgd", "--local-steps", "3"]),
    "postlocal": (
        2,
        ["--method", "postlocal", "--local-steps", "2", "--local-group-size", "1", "--compress-start", "3"],
    ),
    "topk4": (4, ["--method", "topk", "--topk-ratio", "0.05"]),
    "quantize8_4": (4, ["--method", "quantize", "--bits", "8"]),
    "powersgd4": (4, ["--method", "powersgd", "--powersgd-rank", "4"]),
    "autocast": (1, ["--method", "none", "--autocast", "bf16"]),
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
            fresh_folder(folder)
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
    testing = re.search(r"::test_todos?_?(\d+)", os.environ.get("PYTEST_CURRENT_TEST", ""))
    mine = int(testing.group(1)) if testing else todo
    if result.returncode != 0 and mine != 1 and name != "none":
        # The 1-process reference and every method's first steps (before --compress-start) average with TODO 1's
        # hook: when that hook is wrong, this TODO's runs fail too, and TODO 1's own line says why.
        if run("none")[0].returncode != 0 or run("one")[0].returncode != 0:
            pytest.fail(f"TODO {mine}: needs TODO 1 first (the all-reduce hook: see TODO 1's own line)", pytrace=False)
    errors = [line.strip() for line in result.tail().splitlines() if "Error" in line or "ERROR" in line]
    because = f" ({errors[-1][:160]})" if errors else ""
    assert result.returncode == 0, f"{what}: the {name} run failed{because}. Its last lines:\n{result.tail()}"
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
    return load_script(path, "lesson07")


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
    assert sum(metrics["bucket_sizes"]) == P, (
        f"TODO 1: the hook saw buckets of {sum(metrics['bucket_sizes']):,} gradients in all, the model has {P:,}"
    )
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
    assert metrics["losses"] == pytest.approx(one["losses"], rel=1e-5), (
        f"TODO 1: 2 ranks' losses {metrics['losses']} differ from 1 process's {one['losses']}"
    )


class FakeBucket:
    """What a hook uses of dist.GradBucket: its flat buffer, its index, and its parameters in buffer order."""

    def __init__(self, tensor, parameters=None, index=0):
        self.tensor, self._index = tensor, index
        self._parameters = parameters or [torch.nn.Parameter(torch.zeros_like(tensor))]

    def buffer(self):
        return self.tensor

    def index(self):
        return self._index

    def parameters(self):
        return self._parameters

    def gradients(self):
        return list(self.tensor.split([p.numel() for p in self._parameters]))


@pytest.fixture(scope="module")
def group_of_one():
    """A process group of one rank, in this test process, for calling hooks directly."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_todo2_topk_keeps_what_it_did_not_send_for_later(lesson07, group_of_one):
    state, parameter = lesson07.TopKState(ratio=1 / 3), [torch.nn.Parameter(torch.zeros(3))]  # k = 1 of 3
    first = lesson07.topk_hook(state, FakeBucket(torch.tensor([3.0, -1.0, 2.0]), parameter)).wait()
    assert first.tolist() == [3.0, 0.0, 0.0], f"TODO 2: with k = 1, send the largest entry only, not {first}"
    second = lesson07.topk_hook(state, FakeBucket(torch.tensor([0.0, 0.0, 0.5]), parameter)).wait()
    assert second.tolist() == [0.0, 0.0, 2.5], (
        f"TODO 2: error feedback: the 2 kept back from step 1 plus 0.5 now is the largest entry; got {second} "
        "(add the error kept back; the entries sent leave it: set them to 0)"
    )
    third = lesson07.topk_hook(state, FakeBucket(torch.tensor([0.0, 0.0, 0.0]), parameter)).wait()
    assert third.tolist() == [0.0, -1.0, 0.0], (
        f"TODO 2: the -1 kept back since step 1 goes out last (the largest magnitude, .abs()); got {third}"
    )


def test_todo2_error_feedback_follows_the_parameters_when_buckets_change(lesson07, group_of_one):
    """DDP rebuilds its buckets after the first step: the same bucket index can hold other parameters."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    state = lesson07.TopKState(ratio=1 / 3)  # k = 1 of 3
    first = lesson07.topk_hook(state, FakeBucket(torch.tensor([3.0, -1.0, 2.0]), [a, b])).wait()  # a = [3, -1], b = [2]
    assert first.tolist() == [3.0, 0.0, 0.0], f"TODO 2: with k = 1, send the largest entry only, not {first}"
    second = lesson07.topk_hook(state, FakeBucket(torch.tensor([0.5, 0.0, 0.0]), [b, a])).wait()  # now b first
    assert second.tolist() == [2.5, 0.0, 0.0], (
        f"TODO 2: bucket 0 now holds b then a; b's leftover 2 plus its 0.5 is the largest entry, got {second}: "
        "keep the error per parameter (state.error_of(bucket), state.keep(bucket, ...)), not per bucket index"
    )


class FailedWork:
    """What an async collective returns when the link fails (or the backend refuses the dtype)."""

    def get_future(self):
        future = torch.futures.Future()
        future.set_exception(RuntimeError("the link went down"))
        return future


def check_failure_raises(monkeypatch, todo, hook, state):
    monkeypatch.setattr(dist, "all_gather_single", lambda *args, **kwargs: FailedWork())
    advice = (
        "Wait on the collectives' Futures before decoding (e.g. torch.futures.wait_all): their errors must reach DDP"
    )
    try:  # the error may come from the Future the hook returns, or from the hook itself if it waits inside
        result = hook(state, FakeBucket(torch.tensor([1.0, -2.0, 3.0, 0.5]))).wait()
    except RuntimeError as error:
        if "the link went down" in str(error):
            return  # the collective's own error reached the caller
        first = str(error).strip().splitlines()[0][:120]
        pytest.fail(
            f"TODO {todo}: the all-gather failed, and decode went on with buffers nobody filled ({first}). {advice}"
        )
    pytest.fail(
        f"TODO {todo}: the all-gather failed, yet the hook returned {result.tolist()} from unfilled buffers. {advice}"
    )


def test_todo2_a_failed_collective_raises(lesson07, group_of_one, monkeypatch):
    check_failure_raises(monkeypatch, 2, lesson07.topk_hook, lesson07.TopKState(ratio=0.5))


@pytest.fixture(scope="module")
def todo3_done(lesson07) -> bool:
    """TODO 4 sends and decodes what TODO 3's quantize makes: does TODO 3's own test pass? (Run once here.)"""
    try:
        test_todo3_stochastic_rounding_is_unbiased(lesson07)
    except (AssertionError, NotImplementedError, pytest.fail.Exception):
        return False
    return True


def needs_todo3(todo3_done: bool):
    """A wrong quantize fails TODO 3's test; TODO 4's line then waits for TODO 3 instead of blaming TODO 4."""
    if not todo3_done:
        pytest.fail("TODO 4: needs TODO 3 first (quantize: see TODO 3's own line)", pytrace=False)


def test_todo4_a_failed_collective_raises(lesson07, group_of_one, monkeypatch, todo3_done):
    needs_todo3(todo3_done)
    state = lesson07.QuantizeState(8, seed=0, device=torch.device("cpu"))
    check_failure_raises(monkeypatch, 4, lesson07.quantize_hook, state)


@pytest.fixture(scope="module")
def in_ddp(lesson, tmp_path_factory):
    """tests/workers/lesson07_hooks.py's results: the hooks inside real DDP, 2 ranks (launched once)."""
    path = tmp_path_factory.mktemp("lesson07_hooks") / "results.json"
    torchrun(ROOT / "tests/workers/lesson07_hooks.py", 2, [lesson("07"), path], timeout=180).check()
    return json.loads(path.read_text())


def checked_in_ddp(results, check: str, todo: int) -> dict:
    stopped, failed = results["stopped"].get(check), results["failed"].get(check)
    assert stopped is None, f"{stopped.split(':')[0]}: not done yet ({stopped}); complete it, then TODO {todo}"
    assert failed is None, f"TODO {todo}: the {check} check inside DDP failed: {failed}"
    return results[check]


def test_todo1_hook_returns_before_the_all_reduce_completes(in_ddp):
    """The hook runs during backward: it must start the all-reduce and return its Future at once, so that DDP goes
    on computing the next gradients while the bucket travels. The other rank joins 3 s late in this check."""
    result = checked_in_ddp(in_ddp, "hook_at_once", 1)
    assert not result["done_on_return"], (
        "TODO 1: the hook's Future was already done when the hook returned, expected a Future still running: the "
        "hook waited for the all-reduce (start it asynchronously and return its Future)"
    )
    assert result["difference"] < 1e-6, f"TODO 1: the Future's value differs from the average by {result['difference']}"


def test_todo2_error_feedback_survives_ddp_rebuilding_its_buckets(in_ddp):
    result = checked_in_ddp(in_ddp, "topk_buckets", 2)
    first, *later = result["layouts"]
    assert len(later) >= 3 and max(result["buckets"]) > 1 and later[0] != first, (
        f"the check needs several buckets and a rebuild; got {result['buckets']}"
    )
    assert result["worst"] < 1e-5, (
        f"TODO 2: after DDP rebuilt its buckets, what {result['where']} sent plus what it kept back differs from "
        f"the sum of its gradients by {result['worst']:.1e} (relative): its leftover went to another parameter or "
        "was dropped (keep the error per parameter: state.error_of(bucket) / state.keep(bucket, ...)), or the sum of "
        "the ranks' values was not divided by n"
    )


def test_todo2_topk_resumes_from_a_checkpoint_with_its_error_memory(in_ddp):
    result = checked_in_ddp(in_ddp, "topk_resume", 2)
    assert result["saved_errors"] > 0, (
        "TODO 2: TopKState.state_dict() found no error memory by parameter: store it with state.keep(bucket, ...)"
    )
    assert result["resumed"] == pytest.approx(result["straight"], abs=1e-6), (
        f"TODO 2: 3 steps + checkpoint + 3 steps gave losses {result['resumed']}, 6 steps straight "
        f"{result['straight']}: the error memory must come back with the checkpoint"
    )
    # The check can fail: without the error memory, the resumed run takes other steps.
    assert result["without_error_memory"][3:] != pytest.approx(result["straight"][3:], abs=1e-6)


@pytest.mark.parametrize("name, n", [("topk", 2), ("topk4", 4)])
def test_todo2_topk_sends_k_values_and_indices(run, name, n):
    metrics = finished(run, name, 2)
    ratio = float(passed(run(name)[0], "--topk-ratio"))
    k = [math.ceil(ratio * size) for size in metrics["bucket_sizes"]]
    expected = sum(all_gather_bytes(ki * (4 + 4), n) for ki in k)  # float32 value + int32 index, from each rank
    assert metrics["bytes_sent"] == [expected] * STEPS, (
        f"TODO 2: k = {k} entries (value + int32 index) all-gathered from each of {n} ranks send {expected:,.0f} "
        f"bytes per rank per step, not {metrics['bytes_sent']}"
    )
    synchronous(metrics, "TODO 2")


def test_todo2_topk_of_everything_is_one_process(run):
    """k = all entries: every rank sends everything, nothing is kept back: the average of the gradients."""
    finished(run, "topk_all", 2)
    finished(run, "one", "the 1-process reference")
    difference = max_difference(weights(run, "topk_all"), weights(run, "one"))
    assert difference <= 1e-6, (
        f"TODO 2: --topk-ratio 1 on 2 ranks should train like 1 process with the whole batch (to 1e-6, fp32 "
        f"rounding); differs by {difference:.1e}: add every rank's values, then divide by n"
    )


def test_todo3_stochastic_rounding_is_unbiased(lesson07):
    """The mean of many quantizations of one tensor tends to the tensor: within 6 standard errors, per entry."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    generator, draws = torch.Generator().manual_seed(1), 1000
    for bits in (2, 8):
        again = lesson07.quantize(x, bits, torch.Generator().manual_seed(5))[0]
        assert torch.equal(again, lesson07.quantize(x, bits, torch.Generator().manual_seed(5))[0]), (
            "TODO 3: draw the random numbers from `generator` (torch.rand(..., generator=generator)): the same "
            "seed must give the same codes"
        )
        codes, scale = lesson07.quantize(x, bits, generator)
        levels = 2 ** (bits - 1) - 1
        assert codes.dtype == torch.int8, f"TODO 3: {bits}-bit codes travel as int8, not {codes.dtype}"
        assert int(codes.abs().max()) <= levels, (
            f"TODO 3: {bits}-bit codes lie in [-{levels}, {levels}], got up to {int(codes.abs().max())}"
        )
        assert float(scale) == pytest.approx(float(x.abs().max()) / levels, rel=1e-6), (
            f"TODO 3: {bits} bits: scale {float(scale):.4g}, expected max|x| / L = {float(x.abs().max()) / levels:.4g}"
        )
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
    assert torch.equal(lesson07.dequantize(same, one), x), "TODO 3: 32 bits must give the tensor itself, not rounded"


def test_todo4_decodes_every_rank_with_its_own_scale_for_every_bits(in_ddp, todo3_done):
    """Inside DDP's process group: rank 1's gradient is twice rank 0's, so their scales differ."""
    needs_todo3(todo3_done)
    result = checked_in_ddp(in_ddp, "quantize", 4)
    for bits, check in result.items():
        assert check["difference"] <= 1e-6 * check["size"], (
            f"TODO 4: --bits {bits}: the decoded average differs from the mean of each rank's own dequantized "
            f"codes by {check['difference']:.2e} (values up to {check['size']:.2f}): decode row r with rank r's "
            "scale (an n x 1 column), unpack the bytes with from_bytes, sum the rows and divide by n"
        )


@pytest.mark.parametrize(
    "name, n, bits", [("quantize2", 2, 2), ("quantize4", 2, 4), ("quantize8", 2, 8), ("quantize16", 2, 16),
                      ("quantize32", 2, 32), ("quantize8_4", 4, 8)]
)  # fmt: skip
def test_todo4_every_bits_sends_its_bytes_and_trains(run, name, n, bits, todo3_done):
    needs_todo3(todo3_done)
    metrics = finished(run, name, 4)
    assert int(passed(run(name)[0], "--bits")) == bits
    # ceil(N x bits / 8) bytes of codes (2- and 4-bit codes packed into bytes) + one float32 scale, from each rank
    expected = sum(all_gather_bytes(math.ceil(size * bits / 8) + 4, n) for size in metrics["bucket_sizes"])
    assert metrics["bytes_sent"] == [expected] * STEPS, (
        f"TODO 4: {bits}-bit codes as bytes plus one float32 scale, all-gathered from {n} ranks, send "
        f"{expected:,.0f} bytes per rank per step, not {metrics['bytes_sent']}: send to_bytes(codes, bits)"
    )
    synchronous(metrics, "TODO 4")
    reference = finished(run, "one", "the 1-process reference")
    # Unbiased noise of at most one level (max|g| / L) per entry: a few percent of the loss's drop at 2 bits,
    # far less at 8 and more; a wrong scale or an undecoded buffer is off by orders of magnitude (or nan).
    tolerance = max(1e-5, min(0.03, 2.0 ** (2 - bits)))  # (and float32 rounding at 32 bits)
    assert all(math.isfinite(loss) for loss in metrics["losses"]), f"TODO 4: --bits {bits}: {metrics['losses']}"
    assert metrics["final_loss"] == pytest.approx(reference["final_loss"], rel=tolerance), (
        f"TODO 4: --bits {bits}: final loss {metrics['final_loss']:.4f}, 1 process {reference['final_loss']:.4f} "
        f"(relative tolerance {tolerance:.0e})"
    )


def test_todo4_32_bit_quantization_is_one_process(run, todo3_done):
    needs_todo3(todo3_done)
    finished(run, "quantize32", 4)
    finished(run, "one", "the 1-process reference")
    difference = max_difference(weights(run, "quantize32"), weights(run, "one"))
    assert difference <= 1e-6, (
        f"TODO 4: --bits 32 (nothing rounded) on 2 ranks should train like 1 process with the whole batch (to "
        f"1e-6); differs by {difference:.1e}"
    )


def test_todo5_local_sgd_with_one_local_step_is_one_process(run):
    """H = 1 with SGD: averaging the models after every step = stepping with the averaged gradient (a linear
    update), up to rounding. (Not with AdamW: each rank's moments would see only its own gradients.)"""
    metrics = finished(run, "local1", 5)
    finished(run, "one", "the 1-process reference")
    difference = max_difference(weights(run, "local1"), weights(run, "one"))
    assert difference <= 1e-6, (
        f"TODO 5: --local-steps 1 with SGD should match 1 process to 1e-6 (fp32 rounding), not {difference:.1e}: "
        "divide the summed parameters by the number of ranks and write them back"
    )
    assert metrics["bytes_sent"] == [all_reduce_bytes(4 * P, 2)] * STEPS, "TODO 5: one average of P floats per step"


def test_todo5_local_sgd_averages_every_h_steps(run):
    metrics = finished(run, "local3", 5)
    h = int(passed(run("local3")[0], "--local-steps"))
    averaging = [step % h == 0 for step in range(1, STEPS + 1)]
    expected = [all_reduce_bytes(4 * P, 2) if avg else 0.0 for avg in averaging]
    assert metrics["bytes_sent"] == expected, (
        f"TODO 5: --local-steps 3 all-reduces the {4 * P:,} bytes of parameters at steps 3 and 6 only "
        f"(1/3 of DDP's bytes): {metrics['bytes_sent']}"
    )
    spread = metrics["rank_spread"]
    assert all(s == 0.0 for s, avg in zip(spread, averaging) if avg), (
        f"TODO 5: right after an average every rank holds the same parameters: {spread}"
    )
    assert any(s > 0.0 for s, avg in zip(spread, averaging) if not avg), (
        f"TODO 5: between averages the ranks should drift apart, but every spread is 0: {spread}"
    )


# --------------------------------------------------------------------------------------------------
# The built-in hooks, counted the same way
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_16_bit_compression_halves_the_bytes_and_nearly_matches_full_precision(run, name):
    metrics, full = finished(run, name, "the built-in hook"), finished(run, "none", 1)
    assert passed(run(name)[0], "--method") == name and passed(run("none")[0], "--method") == "none"
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
    assert int(passed(run(name)[0], "--powersgd-rank")) == rank
    start = metrics["compress_start"]
    expected = [all_reduce_bytes(4 * P, n)] * start + [all_reduce_bytes(powersgd_bytes(rank), n)] * (STEPS - start)
    assert metrics["bytes_sent"] == pytest.approx(expected, rel=1e-12), (
        f"PowerSGD rank {rank}: full all-reduce for {start} steps, then r x (rows + cols) per matrix"
    )
    assert expected[-1] < expected[0] / 4, "the formula itself: PowerSGD sends a fraction of DDP's bytes"
    synchronous(metrics, "PowerSGD")


def test_post_local_sgd_averages_periodically_after_warm_up(run):
    metrics = finished(run, "postlocal", "post-local SGD")
    result = run("postlocal")[0]
    start, period = int(passed(result, "--compress-start")), int(passed(result, "--local-steps"))
    assert start != 2, "the check needs a --compress-start other than the default 2"
    assert passed(result, "--local-group-size") == "1"  # groups of one rank: no gradient all-reduce after warm-up
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


def test_autocast_bf16_runs_the_forward_in_bf16(run):
    """--autocast is honoured, not ignored: the bf16 forward changes the losses a little, not much."""
    metrics, fp32 = finished(run, "autocast", 1), finished(run, "one", 1)
    assert passed(run("autocast")[0], "--autocast") == "bf16"
    assert metrics["losses"] != fp32["losses"], "--autocast bf16 trained exactly like float32: it was ignored"
    assert metrics["final_loss"] == pytest.approx(fp32["final_loss"], rel=0.02), (metrics["losses"], fp32["losses"])


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line at a value other than its default, on one process: the run trains
    like the same steps written out with PyTorch alone (tests/harness/option_effects.py), logged where it says."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json", "--method", "none",
    ]  # fmt: skip
    result = python(lesson("07"), args, timeout=180)
    finished(lambda name: (result, tmp_path), "shared options", 1)
    check_shared_options(result, order="sampler")


def test_todo1_one_process_reference_is_the_plain_training_loop(run):
    """The reference of every parity test above ("one": this script on one process, --method none) is itself
    checked against the same SGD steps written out with PyTorch alone: a mistake that bent the reference and the
    2-rank runs alike would otherwise pass them."""
    metrics = finished(run, "one", 1)
    losses, checksum, _ = written_out_training(run("one")[0], "sampler", samples_per_step=8, lr=0.2)
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5), (
        f"TODO 1: on one process the losses {metrics['losses']} are not plain training's {losses}: the hook must "
        "return the average of the gradients, nothing else"
    )
    assert metrics["param_checksum"] == pytest.approx(checksum, rel=1e-6), "TODO 1: the final parameters differ"


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
