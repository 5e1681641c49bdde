"""Lesson 05: pipeline stages with micro-batches train like one process (to float32 rounding), with the bubble the
formula says.

pytest tests/test_05_pipeline_parallel.py                      # the solution
pytest tests/test_05_pipeline_parallel.py --target exercises   # your exercise (make check LESSON=05)

The reference is never the learner's own code: the schedules, the bubble and the communication plan are checked
in pure Python against their definitions; one micro-batch's forward (TODO 5) and backward (TODO 6) against the
whole model in this process; the runs against lesson 00's solution on one process (the same batches, the same
seed); the debugging lab (TODO 8) in pure Python, then on live ranks with the solution's engine
(utils/lesson_05/lab.py). A test that needs earlier TODOs is skipped, naming them, until their own tests pass, so
`make check` blames only the TODO at fault. Timings are noisy on a shared CPU: no test asserts on one.
"""

import argparse
import json
import os
import re
from fractions import Fraction

import pytest
import torch

from tests.harness.launch import ROOT, course_env, finished, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext, passed
from tests.harness.todo_calls import call, prerequisites
from utils.course.lessons import load_script
from utils.course.make_exercises import handed_out
from utils.distributed_utils import CourseError
from utils.lesson_05.lab import HINT, check_warmups, failure
from utils.lesson_05.plumbing import cost_aware_partition, forward_flops_per_token, simulate_order, stage_costs
from utils.lesson_05.timing import SWEEP_MICROBATCHES, measured_bubble, rendezvous_completes
from utils.model import ModelConfig, build_model, flops_per_token, loss_fn

TOLERANCE = 1e-6  # fp32, SGD: stages and one process differ only by the order of additions
COMMON = [
    "--dim", "32", "--n-layers", "4", "--n-heads", "2", "--seq-len", "32", "--steps", "3",
    "--batch-size", "8", "--optimizer", "sgd", "--log-every", "1",
]  # fmt: skip
RUNS = {  # name: (processes, arguments); every one trains on the same batches of 8 sequences as lesson 00
    "gpipe2": (2, ["--schedule", "gpipe", "--microbatches", "4"]),
    "1f1b2": (2, ["--schedule", "1f1b", "--microbatches", "4"]),
    "1f1b4": (4, ["--schedule", "1f1b", "--microbatches", "2"]),  # fewer micro-batches than stages
    "builtin_gpipe2": (2, ["--pp-impl", "builtin", "--schedule", "gpipe", "--microbatches", "4"]),
    "builtin_interleaved2": (2, ["--pp-impl", "builtin", "--schedule", "interleaved", "--microbatches", "4"]),
    "builtin_1f1b4": (4, ["--pp-impl", "builtin", "--schedule", "1f1b", "--microbatches", "4"]),
    "builtin_zbv2": (2, ["--pp-impl", "builtin", "--schedule", "zbv", "--microbatches", "4"]),  # B split: B and W
}
SCRATCH = ["gpipe2", "1f1b2", "1f1b4"]
BUILTIN = ["builtin_gpipe2", "builtin_interleaved2", "builtin_1f1b4", "builtin_zbv2"]
ENV = course_env(PYTHONPATH=ROOT)  # `import utils` also for a script in another folder (--target-dir)
SCRATCH_NEEDS = {"gpipe2": (1, 2, 4, 5, 6), "1f1b2": (1, 3, 4, 5, 6), "1f1b4": (1, 3, 4, 5, 6)}


@pytest.fixture(scope="module")
def script(lesson):
    """The lesson script imported as a module (its functions, without running main)."""
    return load_script(lesson("05"), "lesson05")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Lesson 00's solution on one process, on the same batches: the reference every run is compared with."""
    folder = tmp_path_factory.mktemp("lesson00")
    args = [*COMMON, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
    result = python(ROOT / "solutions" / "00_setup_and_baseline.py", args, tmp_path=folder).check()
    return result.metrics, weights(folder)


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson05"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            fresh_folder(folder)
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            done[name] = torchrun(lesson("05"), nproc, args, tmp_path=folder, env=ENV), folder
        return done[name]

    return launch


def weights(folder) -> dict:
    return torch.load(folder / "model.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


# ---------------------------------------------------------------------------------------------------------------
# The checks of each TODO on its own, as functions: the tests call them, and later TODOs' tests call them first
# ---------------------------------------------------------------------------------------------------------------


# The known mistakes of TODOs 1 to 4, each as the answer it gives, with its cause in the learner's terms: a failure
# whose answer is one mistake's names that cause (": as if ..."), never a guess.
def as_if(got, mistakes: dict, *case) -> str:
    """The causes (": as if ...") of the known mistakes whose answer for this case, mistake(*case), is `got`."""
    causes = [cause for cause, mistake in mistakes.items() if mistake(*case) == got]
    return ": as if " + " or ".join(causes) if causes else ""


def first_difference(got: list, want: list, name: str = "step") -> str:
    """Where two lists first differ, in words: "step 2 is ('B', 1), want ('B', 0)"."""
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if index == len(want):
        return f"{len(got)} {name}s, want {len(want)}: {name} {index} is {got[index]}, one too many"
    if index == len(got):
        return f"{len(got)} {name}s, want {len(want)}: {name} {index} ({want[index]}) is missing"
    return f"{name} {index} is {got[index]}, want {want[index]}"


PARTITION_MISTAKES = {  # cause: the ranges it gives for (n_layers, n_stages)
    "the spare blocks (n_layers % n_stages) belonged to no stage": lambda n, s: [
        (i * (n // s), (i + 1) * (n // s)) for i in range(s)
    ],
    "the last stage took every spare block": lambda n, s: [
        (i * (n // s), (i + 1) * (n // s) if i < s - 1 else n) for i in range(s)
    ],
}


def check_todo1(script):
    for n_layers in range(1, 13):
        for n_stages in range(1, n_layers + 1):
            ranges = [tuple(piece) for piece in call(1, script.partition, n_layers, n_stages)]  # any pairs
            sizes = [end - start for start, end in ranges]
            where = f"TODO 1: partition({n_layers}, {n_stages}) returned {ranges}"
            cause = as_if(ranges, PARTITION_MISTAKES, n_layers, n_stages)
            assert len(ranges) == n_stages, f"{where}: {len(ranges)} ranges, want one for each of {n_stages} stages"
            assert ranges[0][0] == 0, f"{where}: the first range starts at {ranges[0][0]}, want 0{cause}"
            end = ranges[-1][1]
            assert end == n_layers, (
                f"{where}: the last range ends at {end}, want {n_layers}"
                + (
                    f" (block {end}{f' to {n_layers - 1}' if n_layers - end > 1 else ''} in no stage)"
                    if end < n_layers
                    else ""
                )
                + cause
            )
            gaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if a[1] != b[0]]
            assert not gaps, f"{where}: not contiguous, {gaps[0][0]} is followed by {gaps[0][1]}"
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, (
                f"{where}: stage sizes {sizes}, want {n_layers // n_stages} or {-(-n_layers // n_stages)} blocks "
                f"each{cause}"
            )


GPIPE_MISTAKES = {  # cause: the steps it gives for m micro-batches
    "the backwards ran newest micro-batch first": lambda m: (
        [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    ),
    "each forward were followed at once by its backward (no two micro-batches in flight)": lambda m: [
        step for i in range(m) for step in (("F", i), ("B", i))
    ],
}


def check_todo2(script):
    cases = [(3, 2, 1)] + [(n, m, r) for n in range(1, 7) for m in range(1, 10) for r in range(n)]
    for p, m, rank in cases:
        got = steps_of(2, script.gpipe_steps, p, m, rank)
        expected = reference_step_lists(p, m, "gpipe", rank)
        assert got == expected, (
            f"TODO 2: gpipe_steps(p={p}, m={m}, rank={rank}) returned {got}: {first_difference(got, expected)}"
            f"{as_if(got, GPIPE_MISTAKES, m)}"
        )
    for p in range(1, 7):
        for m in range(1, 10):
            _, bubble = script.simulate("gpipe", p, m)
            assert bubble == Fraction(p - 1, m + p - 1), f"TODO 2: GPipe p={p} m={m}: idle {bubble} != (p-1)/(m+p-1)"


def one_f_one_b_with(warmup: int, m: int, steady_backward=lambda warmup, i: i) -> list:
    """1F1B's code with a given warm-up (and the steady phase's backward of step i): what a mistake there gives."""
    steps = [("F", mb) for mb in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", warmup + i), ("B", steady_backward(warmup, i))]
    return steps + [("B", mb) for mb in range(m - warmup, m)]


ONE_F_ONE_B_MISTAKES = {  # cause: the steps it gives for (p, m, rank)
    "the warm-up held one forward too many": lambda p, m, r: one_f_one_b_with(min(p - r, m), m),
    "the warm-up were not limited to the m micro-batches (forwards of micro-batches that do not exist)": (
        lambda p, m, r: one_f_one_b_with(p - r - 1, m)
    ),
    "the steady phase ran the backward of the newest micro-batch, not the oldest": lambda p, m, r: one_f_one_b_with(
        min(p - r - 1, m), m, lambda warmup, i: warmup + i
    ),
}


def check_todo3(script):
    for p in range(1, 7):
        for m in range(1, 10):
            for rank in range(p):
                steps = steps_of(3, script.one_f_one_b_steps, p, m, rank)
                expected = reference_step_lists(p, m, "1f1b", rank)
                if steps == expected:
                    continue
                where = f"TODO 3: one_f_one_b_steps(p={p}, m={m}, rank={rank}) returned {steps}"
                cause = f"{first_difference(steps, expected)}{as_if(steps, ONE_F_ONE_B_MISTAKES, p, m, rank)}"
                assert sorted(steps) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]), (
                    f"{where}: not one F and one B for each of the {m} micro-batches; {cause}"
                )
                forwards = [mb for kind, mb in steps if kind == "F"]
                assert forwards == list(range(m)), f"{where}: forwards in the order {forwards}; {cause}"
                late = [i for i in range(m) if steps.index(("B", i)) < steps.index(("F", i))]
                assert not late, f"{where}: B{late[0]} runs before F{late[0]}; {cause}"
                warmup = next((i for i, (kind, _) in enumerate(steps) if kind == "B"), len(steps))
                assert warmup == min(p - rank, m), (
                    f"{where}: {warmup} forwards before the first backward, want {min(p - rank, m)}; {cause}"
                )
                held = script.in_flight(steps)
                assert held == min(p - rank, m), (
                    f"{where}: holds up to {held} micro-batches, want at most {min(p - rank, m)}; {cause}"
                )
                pytest.fail(f"{where}: {cause}", pytrace=False)
            _, bubble = script.simulate("1f1b", p, m)
            assert bubble == Fraction(p - 1, m + p - 1), f"TODO 3: 1F1B p={p} m={m}: idle {bubble} != (p-1)/(m+p-1)"


def steps_of(todo: int, function, *args) -> list:
    """A step list as a list of (kind, micro-batch) tuples, whatever sequences the learner built it from."""
    steps = call(todo, function, *args)
    try:
        return [tuple(step) for step in steps]
    except TypeError:
        pytest.fail(f"TODO {todo}: {function.__name__} returned {steps!r}, not a list of steps", pytrace=False)


def reference_step_lists(p: int, m: int, schedule: str, rank: int):
    """The schedules by definition (not the learner's TODOs 2-3): TODO 4's test must not depend on them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - rank - 1, m)
    steps = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", warmup + i), ("B", i)]
    return steps + [("B", i) for i in range(m - warmup, m)]


def plan_with(steps, rank: int, p: int, backward_peers=True, send_later=True, gradient_label="gradient") -> list:
    """The point-to-point plan by definition (not the learner's TODO 4), or with one known mistake: gradients
    exchanged with the neighbours activations use (backward_peers=False), a result sent in the batch of the step
    that computes it (send_later=False), gradients labelled as something else. Batches as sorted lists of tuples."""
    previous, following = (rank - 1 if rank > 0 else None), (rank + 1 if rank < p - 1 else None)
    batches: list[list] = [[] for _ in range(len(steps) + 1)]
    for i, (kind, mb) in enumerate(steps):
        forward = kind == "F" or not backward_peers
        source, target = (previous, following) if forward else (following, previous)
        what = "activation" if kind == "F" else gradient_label
        if source is not None:
            batches[i].append(("recv", source, what, mb))
        if target is not None:
            batches[i + send_later].append(("send", target, what, mb))
    return [sorted(batch, key=repr) for batch in batches]


P2P_MISTAKES = {  # cause: the plan it gives for (steps, rank, p)
    "a backward's gradient came from the previous rank and went to the following one, as activations do": (
        lambda steps, rank, p: plan_with(steps, rank, p, backward_peers=False)
    ),
    "each result were sent in the batch posted before the step that computes it": (
        lambda steps, rank, p: plan_with(steps, rank, p, send_later=False)
    ),
    "gradients were labelled as activations": lambda steps, rank, p: plan_with(
        steps, rank, p, gradient_label="activation"
    ),
}


def in_words(batch) -> str:
    """A batch of the plan in words: "[send activation 0 to rank 1, receive gradient 0 from rank 1]"."""

    def words(operation) -> str:
        if len(operation) != 4:
            return repr(operation)
        op, peer, what, mb = operation
        if op not in ("send", "recv"):
            return repr(operation)
        return f"send {what} {mb} to rank {peer}" if op == "send" else f"receive {what} {mb} from rank {peer}"

    return "[" + ", ".join(map(words, batch)) + "]"


def check_todo4(script):
    for schedule in ("gpipe", "1f1b"):
        for p in range(1, 7):
            for m in range(1, 10):
                step_lists = [reference_step_lists(p, m, schedule, r) for r in range(p)]
                plans = [call(4, script.p2p_plan, step_lists[r], r, p) for r in range(p)]
                for rank, (steps, plan) in enumerate(zip(step_lists, plans)):
                    where = f"TODO 4: p2p_plan for {schedule} p={p} m={m}, rank {rank}"
                    assert len(plan) == len(steps) + 1, (
                        f"{where}: {len(plan)} batches for {len(steps)} steps, want {len(steps) + 1} (one before "
                        "each step, one after the last)"
                    )
                    got = [sorted((tuple(op) for op in batch), key=repr) for batch in plan]
                    want = plan_with(steps, rank, p)
                    if got == want:
                        continue
                    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                    before = f"before {''.join(map(str, steps[i]))}" if i < len(steps) else "after the last step"
                    pytest.fail(
                        f"{where}: batch {i} ({before}) holds {in_words(got[i])}, want {in_words(want[i])}"
                        f"{as_if(got, P2P_MISTAKES, steps, rank, p)}",
                        pytrace=False,
                    )
                sent = sum(op == "send" for plan in plans for batch in plan for op, *_ in batch)
                assert sent == 2 * m * (p - 1), (
                    f"TODO 4: p={p} m={m}: each of {p - 1} links carries m activations forward and m gradients back"
                )
                try:
                    completes = rendezvous_completes(plans)
                except AssertionError as error:
                    raise AssertionError(f"TODO 4: {schedule} p={p} m={m}: {error}") from None
                assert completes, f"TODO 4: {schedule} p={p} m={m}: the ranks wait for each other forever"


CONFIG = ModelConfig(seq_len=16, dim=32, n_layers=4, n_heads=2)
M = 4  # micro-batches in the one-process checks of TODOs 5 and 6 (m, 2m and m * m differ)


def two_stages(script):
    """A fresh model from the seed, cut in two stages by hand (not with TODO 1), and a batch of 4 sequences."""
    model = build_model(CONFIG, seed=0)
    first = script.Stage(model, range(0, 2), first=True, last=False)
    last = script.Stage(model, range(2, 4), first=False, last=True)
    generator = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len), generator=generator) for _ in "xy")
    return model, first, last, tokens.chunk(M), targets.chunk(M)


def check_todo5(script):
    model, first, last, tokens, targets = two_stages(script)
    for mb in range(M):
        x, activation = call(5, script.forward_step, first, tokens[mb], None, M)
        assert torch.equal(x, tokens[mb]), f"TODO 5: the first stage returned the input {x}, not the tokens"
        difference = float((activation - first(tokens[mb])).detach().abs().max())
        assert difference <= 1e-6, f"TODO 5: the first stage's output differs from the stage's by {difference:.1e}"
        received = activation.detach().clone()
        x, loss = call(5, script.forward_step, last, received, targets[mb], M)
        if not (isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf and torch.equal(x, received)):
            state = (
                f"a tensor with requires_grad={x.requires_grad}, is_leaf={x.is_leaf}, equal to the received "
                f"activation: {torch.equal(x, received)}"
                if isinstance(x, torch.Tensor)
                else type(x).__name__
            )
            cause = (
                ": as if the received activation were used as it came" if x is received and not x.requires_grad else ""
            )
            pytest.fail(
                f"TODO 5: the last stage returned as its input {state}; want the received activation as a leaf that "
                f"requires grad, whose gradient goes back to the previous stage{cause}",
                pytrace=False,
            )
        (through,) = torch.autograd.grad(loss, x, retain_graph=True, allow_unused=True)
        assert through is not None, "TODO 5: the loss returned does not depend on the input returned (no gradient)"
        whole = float(loss_fn(model(tokens[mb]), targets[mb]).detach())
        got = float(loss.detach()) if loss.dim() == 0 else None
        if got is None or got != pytest.approx(whole / M, rel=1e-5):
            known = {"not divided by m": whole, "divided by m twice": whole / M / M, "divided by 2m": whole / (2 * M)}
            causes = [cause for cause, value in known.items() if got == pytest.approx(value, rel=1e-5)]
            pytest.fail(
                f"TODO 5: the last stage's loss for micro-batch {mb} is "
                f"{f'{got:.5f}' if got is not None else f'of shape {list(loss.shape)}'}, want {whole / M:.5f}, its "
                f"share of the mean loss of m = {M} micro-batches (its own loss is {whole:.5f})"
                + (f": as if the loss were {' or '.join(causes)}" if causes else ""),
                pytrace=False,
            )


def largest_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two tensors differ most, with both values: "most at (3, 1): got 0.1234, want 0.0567"."""
    index = tuple(int(i) for i in torch.unravel_index((got - want).abs().argmax(), got.shape))
    return f"most at {index}: got {float(got[index]):.4g}, want {float(want[index]):.4g}"


def check_todo6(script):
    model, first, last, tokens, targets = two_stages(script)
    reference = build_model(CONFIG, seed=0)
    loss_fn(reference(torch.cat(tokens)), torch.cat(targets)).backward()  # one process, the whole batch
    summed = build_model(CONFIG, seed=0)  # a known mistake: the first stage backpropagates from its output's sum
    summed_first = script.Stage(summed, range(0, 2), first=True, last=False)
    summed_last = script.Stage(summed, range(2, 4), first=False, last=True)
    for mb in range(M):  # the forward done here, not with TODO 5
        activation = first(tokens[mb])
        received = activation.detach().requires_grad_()
        loss = loss_fn(last(received), targets[mb]) / M
        summed_first(tokens[mb]).sum().backward()
        summed_received = summed_first(tokens[mb]).detach().requires_grad_()
        (loss_fn(summed_last(summed_received), targets[mb]) / M).backward()
        want = summed_received.grad  # the input's gradient, as the correct backward gives it
        gradient = call(6, script.backward_step, received, loss, None)
        if not (isinstance(gradient, torch.Tensor) and gradient.shape == activation.shape):
            got = f"of shape {list(gradient.shape)}" if isinstance(gradient, torch.Tensor) else repr(gradient)
            cause = ": as if it returned the gradient it received (None on the last stage), or nothing"
            cause = cause if gradient is None else ""
            pytest.fail(
                f"TODO 6: the last stage's backward_step for micro-batch {mb} returned {got}, want its input's "
                f"gradient of shape {list(activation.shape)}, for the previous stage{cause}",
                pytrace=False,
            )
        unset = next((name for name, p in last.named_parameters() if p.grad is None), None)
        if unset:
            right = torch.allclose(gradient, want, rtol=1e-4, atol=1e-7)
            pytest.fail(
                f"TODO 6: after the last stage's backward_step for micro-batch {mb}, {unset}.grad is None, want "
                f"the parameters' gradients too (its input's gradient is {'right' if right else 'wrong'})"
                + (": as if the backward computed only the input's gradient" if right else ""),
                pytrace=False,
            )
        returned = call(6, script.backward_step, tokens[mb], activation, gradient)
        if returned is not None:
            cause = ": as if it returned the gradient it received, not its input's" if returned is gradient else ""
            pytest.fail(
                f"TODO 6: the first stage's backward_step for micro-batch {mb} returned a {type(returned).__name__}, "
                f"want None (its input is tokens, which have no gradient){cause}",
                pytrace=False,
            )
    mistaken = all(
        p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        for p, q in zip(model.parameters(), summed.parameters())
    )
    cause = ": as if the first stage backpropagated from its output's sum, not with the received gradient"
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, f"TODO 6: after the {M} micro-batches' backwards, {name}.grad is None"
        difference = float((p.grad - q.grad).abs().max())
        assert difference <= 1e-6, (
            f"TODO 6: after the {M} micro-batches' backwards, {name}.grad differs from the whole batch's by "
            f"{difference:.1e}, {largest_difference(p.grad, q.grad)}{cause if mistaken else ''}"
        )


CHECKS = {1: check_todo1, 2: check_todo2, 3: check_todo3, 4: check_todo4, 5: check_todo5, 6: check_todo6}


@pytest.fixture(scope="module")
def needs(script):
    """needs(1, 4, ...): skip this test, naming them, while those TODOs fail their own tests."""
    return prerequisites(lambda todo: CHECKS[todo](script))


# ---------------------------------------------------------------------------------------------------------------
# Pure Python and one process: each TODO against its definition
# ---------------------------------------------------------------------------------------------------------------


def test_todo1_partition_is_balanced_and_refuses_more_stages_than_blocks(script):
    check_todo1(script)
    with pytest.raises(CourseError, match="--n-layers"):
        script.partition(2, 3)


def test_todo2_gpipe_steps_and_bubble_formula(script):
    check_todo2(script)


def test_todo3_1f1b_steps_bounded_memory_and_bubble_formula(script):
    check_todo3(script)


def test_todo4_point_to_point_plan_pairs_up_and_never_deadlocks(script):
    check_todo4(script)


def test_the_naive_plan_deadlocks_under_1f1b_and_the_check_sees_it(script, needs):
    """The check that passes TODO 4 can fail: one blocking operation at a time deadlocks 1F1B, not GPipe."""
    needs(4)
    for p, m in [(2, 2), (4, 8)]:
        naive = [script.naive_p2p_plan(reference_step_lists(p, m, "1f1b", r), r, p) for r in range(p)]
        assert not rendezvous_completes(naive), f"1F1B p={p} m={m}: the naive plan should deadlock"
        naive = [script.naive_p2p_plan(reference_step_lists(p, m, "gpipe", r), r, p) for r in range(p)]
        assert rendezvous_completes(naive), f"GPipe p={p} m={m}: the naive plan happens to complete"


def test_todo5_forward_step_matches_the_whole_model(script):
    check_todo5(script)


def test_todo6_backward_steps_add_up_to_the_whole_batch_gradient(script):
    check_todo6(script)


def test_measured_bubble_is_none_when_nothing_was_recorded():
    assert measured_bubble([[("F", 0, 0.0, 1.0, 0)], []]) is None
    assert measured_bubble([]) is None
    assert measured_bubble([[("F", 0, 0.0, 1.0, 0)], [("F", 0, 1.0, 2.0, 1)]]) == pytest.approx(0.5)


def test_simulate_order_gives_the_formulas_and_a_split_backward_idles_less():
    """The ideal-machine simulator of built-in orders (utils.lesson_05.plumbing), against definitions and by hand."""
    unit = {"F": 1, "B": 2, "I": 1, "W": 1}
    for p in range(1, 6):
        for m in range(1, 9):
            orders = [[(kind, r, mb) for kind, mb in reference_step_lists(p, m, "1f1b", r)] for r in range(p)]
            _, idle = simulate_order(orders, p, lambda kind, stage: unit[kind])
            assert idle == Fraction(p - 1, m + p - 1), f"1F1B p={p} m={m}: {idle}"
    # p = 2, m = 2, each backward split into I and W; rank 1 defers its W's to the end. By hand: rank 0 idles from 2
    # to 3, rank 1 from 0 to 1, both end at 7: 2 of 14 units, against 1F1B's 1/3.
    split = [
        [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)],
        [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("I", 1, 1), ("W", 1, 0), ("W", 1, 1)],
    ]
    timelines, idle = simulate_order(split, 2, lambda kind, stage: unit[kind])
    assert idle == Fraction(1, 7) and max(end for t in timelines for _, _, _, end, _ in t) == 7, timelines
    with pytest.raises(RuntimeError, match="no rank can go on"):  # rank 0 waits for a gradient before its forward
        simulate_order([[("I", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("I", 1, 0)]], 2, lambda kind, stage: 1)
    # One rank holding both stages, cost growing with the stage: F 1 + 2, then B of the last stage (after its own F)
    # 4, then B of the first 2: 9 units, no idle time.
    chain = [[("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]]
    timelines, idle = simulate_order(chain, 2, lambda kind, stage: unit[kind] * (stage + 1))
    assert idle == 0 and timelines[0][-1][3] == 9, timelines
    for wrong in ([("W", 0, 0), ("F", 0, 0), ("I", 0, 0)], [("I", 0, 0), ("F", 0, 0)]):  # W before its I; I before F
        with pytest.raises(RuntimeError, match="no rank can go on"):
            simulate_order([wrong], 1, lambda kind, stage: 1)


def test_cost_aware_partition_is_the_best_cut_and_never_slower_than_equal_blocks():
    """Against every contiguous cut (brute force), with heavy and light first and last stages."""
    from itertools import combinations

    for n_layers in range(1, 8):
        for n_stages in range(1, n_layers + 1):
            for first, last in [(0, 0), (0, 3), (2, 5), (7, 0)]:
                blocks = [1 + (i % 3) for i in range(n_layers)]  # blocks of unequal cost too
                cuts = [list(zip((0, *c), (*c, n_layers))) for c in combinations(range(1, n_layers), n_stages - 1)]
                best = min(max(stage_costs(ranges, blocks, first, last)) for ranges in cuts)
                ranges = cost_aware_partition(blocks, n_stages, first, last)
                assert ranges in cuts, ranges
                assert max(stage_costs(ranges, blocks, first, last)) == best, (n_layers, n_stages, first, last, ranges)
    for config in (ModelConfig(), ModelConfig(seq_len=32, dim=32, n_layers=4, n_heads=2, vocab_size=32_000)):
        pieces = forward_flops_per_token(config)
        total = pieces["embedding"] + config.n_layers * pieces["block"] + pieces["head"]
        assert 3 * total == flops_per_token(config), pieces  # forward x 3 = the course's training estimate


def test_stage_placement_holds_every_stage_once(script):
    """Loop placement (interleaved): rank r holds r and r + p; ZBV's V: r and 2p - 1 - r."""
    for schedule in script.SCHEDULES:
        for p in range(1, 6):
            held = [index for rank in range(p) for index in script.stage_indices(schedule, rank, p)]
            assert sorted(held) == list(range(len(held))), f"{schedule} p={p}: {held}"
    assert script.stage_indices("zbv", 0, 4) == [0, 7] and script.stage_indices("interleaved", 0, 4) == [0, 4]


def test_refused_layouts(script, needs):
    needs(1)

    def args(**changes):
        values = dict(batch_size=8, microbatches=4, schedule="gpipe", pp_impl="scratch", n_layers=4)
        return argparse.Namespace(**{**values, **changes})

    for changes, world_size, words in [
        (dict(batch_size=6), 2, "multiple of 4"),
        (dict(schedule="interleaved"), 2, "--pp-impl builtin"),
        (dict(schedule="interleaved", pp_impl="builtin", n_layers=3), 2, "--n-layers 4 or more"),
        (dict(schedule="zbv"), 2, "--pp-impl builtin"),
        (dict(schedule="zbv", pp_impl="builtin", n_layers=3), 2, "--n-layers 4 or more"),
        (dict(n_layers=3), 4, "--n-layers 4 or more"),
        (dict(schedule="1f1b", pp_impl="builtin", microbatches=2), 4, "--microbatches >= 4"),
        (dict(bubble_sweep="sweep.json", pp_impl="builtin"), 2, "leave out --pp-impl builtin"),
    ]:
        with pytest.raises(CourseError, match=re.escape(words)):
            script.check_layout(args(**changes), world_size)
    script.check_layout(args(schedule="1f1b", microbatches=1, batch_size=1), 4)  # scratch 1F1B: any m


def test_docstring_examples_are_accepted(script, needs):
    needs(1)
    for line in script.__doc__.splitlines():
        match = re.search(r"torchrun --nproc_per_node=(\d+) solutions/05_pipeline_parallel.py(.*)", line)
        if match:
            words = match.group(2).split()
            options = dict(batch_size=8, microbatches=4, schedule="1f1b", pp_impl="scratch", n_layers=2)
            for option, value in zip(words[::2], words[1::2]):
                key = option.lstrip("-").replace("-", "_")
                options[key] = int(value) if value.isdigit() else value
            script.check_layout(argparse.Namespace(**options), int(match.group(1)))


def test_bad_options_end_with_one_line(lesson, tmp_path, needs):
    needs(1)
    args = [*COMMON, "--n-layers", "1", "--log-dir", tmp_path / "runs"]
    result = torchrun(lesson("05"), 2, args, timeout=90, env=ENV)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode != 0 and errors and "--n-layers 2 or more" in errors[0], result.tail()
    refused = python(lesson("05"), [*COMMON, "--autocast", "bf16"], timeout=60, env=ENV)
    assert refused.returncode == 2 and "unrecognized arguments: --autocast bf16" in refused.output, refused.tail()


# ---------------------------------------------------------------------------------------------------------------
# Runs, against lesson 00's solution on one process
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCRATCH)
def test_todo6_scratch_schedules_match_lesson_00(run, baseline, needs, name):
    needs(*SCRATCH_NEEDS[name])
    reference, reference_weights = baseline
    result, folder = run(name)
    metrics = finished(result, 6)
    difference = max_difference(weights(folder), reference_weights)
    assert difference <= TOLERANCE, (
        f"TODO 6: after 3 SGD steps, {name} differs from lesson 00 on one process by {difference:.1e} on some "
        "parameter: each micro-batch's loss divided by m, each input kept for its backward, gradients added up"
    )
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5), f"TODO 6: losses {metrics['losses']}"
    assert metrics["param_checksum"] == pytest.approx(reference["param_checksum"], rel=1e-9), "TODO 6: checksum"


def test_todo7_builtin_on_one_process_gives_the_whole_batch_gradient(lesson):
    """Each built-in schedule in a world of one process, stages cut by hand (not TODO 1), against the model."""
    result = python(ROOT / "tests" / "workers" / "pipeline_builtin_check.py", [lesson("05")], timeout=240)
    lines = [line for line in result.output.splitlines() if line.startswith("TODO 7:")]
    assert result.returncode == 0, lines[0] if lines else f"TODO 7: the check failed:\n{result.tail()}"


@pytest.mark.parametrize("name", BUILTIN)
def test_todo7_builtin_schedules_match_lesson_00(run, baseline, needs, name):
    needs(1)
    reference, reference_weights = baseline
    result, folder = run(name)
    metrics = finished(result, 7)
    difference = max_difference(weights(folder), reference_weights)
    assert difference <= TOLERANCE, (
        f"TODO 7: {name} differs from lesson 00 on one process by {difference:.1e} on some parameter (the built-in "
        "schedule averages the micro-batches' gradients itself: give it the micro-batch's mean loss)"
    )
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5), f"TODO 7: losses {metrics['losses']}"
    assert metrics["stages"] == metrics["world_size"] * metrics["stages_per_rank"]
    if metrics["timeline"] is not None:  # recorded through PipelineStage methods that are not public API
        kinds = "FBW" if metrics["schedule"] in ("interleaved-zb", "zbv") else "FB"  # zero bubble: B split in two
        for timeline in metrics["timeline"]:
            assert sorted({kind for kind, *_ in timeline}) == sorted(kinds), timeline
            assert len(timeline) == len(kinds) * metrics["microbatches"] * metrics["stages_per_rank"], timeline


@pytest.mark.parametrize("name", ["builtin_interleaved2", "builtin_zbv2"])
def test_builtin_order_in_the_metrics_runs_every_action_once_and_gives_its_bubble(run, script, needs, name):
    """`schedule_order`: torch's own order (pipeline_order) of the multi-stage runs, on the ideal machine."""
    needs(1)
    metrics = finished(run(name)[0], 7)
    order, p, m = metrics["schedule_order"], metrics["world_size"], metrics["microbatches"]
    if order is None:
        pytest.skip(f"torch {torch.__version__}: {metrics['schedule']} has no pipeline_order")
    kinds = ["F", "I", "W"] if metrics["schedule"] == "zbv" else ["F", "B"]
    for rank, actions in enumerate(order):
        expected = [[kind, stage, mb] for stage in script.stage_indices(metrics["schedule"], rank, p)
                    for kind in kinds for mb in range(m)]  # fmt: skip
        assert sorted(actions) == sorted(expected), f"{name} rank {rank}: {actions}"
    _, idle = simulate_order(order, metrics["stages"], lambda kind, stage: {"F": 1, "I": 1, "W": 1, "B": 2}[kind])
    if metrics["schedule"] == "interleaved":
        assert idle == Fraction(p - 1, 2 * m + p - 1), idle
    else:
        assert idle < Fraction(p - 1, m + p - 1), f"ZBV idles {idle}, no less than 1F1B"
    assert finished(run("builtin_gpipe2")[0], 7)["schedule_order"] is None  # single-stage: no order of its own


def test_todo6_activation_memory_gpipe_grows_with_m_1f1b_bounded_by_p(run, needs):
    """Bytes saved for backward are deterministic: peak = micro-batches in flight x one micro-batch's bytes."""
    needs(1, 2, 3, 4, 5, 6)
    runs = {name: finished(run(name)[0], 6) for name in SCRATCH}
    for name, metrics in runs.items():
        p, m = metrics["world_size"], metrics["microbatches"]
        expected = [m if metrics["schedule"] == "gpipe" else min(p - r, m) for r in range(p)]
        assert metrics["in_flight_per_rank"] == expected, (
            f"TODO 6: {name}: micro-batches in flight per rank {metrics['in_flight_per_rank']}, expected {expected}"
        )
        assert metrics["peak_activation_bytes_per_rank"] == metrics["predicted_activation_bytes_per_rank"], (
            f"TODO 6: {name}: measured peak {metrics['peak_activation_bytes_per_rank']} != in flight x one micro-batch "
            f"{metrics['predicted_activation_bytes_per_rank']} (a micro-batch's graph must be freed by its backward)"
        )
    gpipe, one_f_one_b = runs["gpipe2"], runs["1f1b2"]
    assert gpipe["peak_activation_bytes_per_rank"][0] == 4 * gpipe["microbatch_activation_bytes_per_rank"][0]
    assert (
        one_f_one_b["peak_activation_bytes_per_rank"][0] == 2 * one_f_one_b["microbatch_activation_bytes_per_rank"][0]
    )
    assert gpipe["peak_activation_bytes_per_rank"][0] > one_f_one_b["peak_activation_bytes_per_rank"][0]


@pytest.mark.parametrize("name", ["gpipe2", "1f1b4"])
def test_bubble_and_timeline_in_the_metrics(run, script, needs, name):
    needs(*SCRATCH_NEEDS[name])
    metrics = finished(run(name)[0], 6)
    p, m = metrics["world_size"], metrics["microbatches"]
    assert metrics["bubble_predicted"] == pytest.approx((p - 1) / (m + p - 1))
    assert metrics["bubble_from_steps"] == pytest.approx(metrics["bubble_predicted"])
    assert 0 <= metrics["bubble_measured_min"] <= metrics["bubble_measured"] <= metrics["bubble_measured_max"] < 1
    for rank, timeline in enumerate(metrics["timeline"]):
        steps = reference_step_lists(p, m, metrics["schedule"], rank)
        assert [[kind, mb] for kind, mb, *_ in timeline] == [list(s) for s in steps], f"rank {rank} ran {timeline}"
        assert all(0 <= start <= end for _, _, start, end, _ in timeline)


def test_each_rank_holds_a_share_of_the_parameters(run, baseline, needs):
    needs(1, 3, 4, 5, 6)
    metrics = finished(run("1f1b4")[0], 6)
    assert metrics["bytes_per_rank"]["params"] < baseline[0]["bytes_per_rank"]["params"]


def test_rank0_prints_once_and_finishes(run, needs):
    needs(1, 3, 4, 5, 6)
    result, _ = run("1f1b2")
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1


def test_a_rank_dying_mid_schedule_ends_the_job(lesson, tmp_path, needs):
    needs(1, 3, 4, 5, 6)
    args = [*COMMON, "--schedule", "1f1b", "--crash-at-step", "2", "--log-dir", tmp_path / "runs"]
    result = torchrun(lesson("05"), 2, args, timeout=120, env=course_env(COURSE_TIMEOUT_S=20, PYTHONPATH=ROOT))
    assert result.returncode != 0, result.tail()
    assert "crashing on purpose" in result.output, result.tail()
    assert "step    1  loss" in result.output and "step    2  loss" not in result.output, "--crash-at-step 2: step 2"
    assert "FINISHED" not in result.output
    shown = python(lesson("05"), ["--help"], timeout=60, env=ENV)  # an option for tests: hidden from learners
    assert shown.returncode == 0 and "--schedule" in shown.output and "--crash-at-step" not in shown.output


def test_untouched_exercise_stops_at_todo1(tmp_path):
    exercise = handed_out("05_pipeline_parallel.py", tmp_path / "exercises")
    result = python(exercise, [*COMMON, "--log-dir", tmp_path / "runs"], env=ENV, timeout=90)
    assert result.returncode != 0 and "ERROR: TODO 1: balanced partition is not done yet" in result.output, (
        result.tail()
    )


def test_bubble_sweep_fixes_the_micro_batch_and_records_its_conditions(tmp_path):
    """--bubble-sweep's plumbing with a stand-in for train(): the batch grows with m, the file says where and how."""
    from utils.lesson_05.timing import bubble_sweep

    asked = []

    def train(args, schedule, m):
        asked.append((schedule, m, args.batch_size))
        timeline = [("F", 0, 0.0, 1.0, 0)]
        return dict(bubble_predicted=0.0, bubble_from_steps=0.0, bubble_measured=0.0, bubble_measured_per_step=[0.0],
                    timeline=[timeline], tokens_per_s=1.0, steps=1)  # fmt: skip

    args = argparse.Namespace(batch_size=2, n_layers=4, dim=32, seq_len=16)
    path = tmp_path / "sweep.json"
    bubble_sweep(train, args, 0, 1, torch.device("cpu"), path)
    assert asked == [(s, m, 2 * m) for s in ("gpipe", "1f1b") for m in SWEEP_MICROBATCHES], asked
    record = json.loads(path.read_text())["1"]
    for key in ("command", "machine", "load_average_1min", "loaded", "versions", "date", "micro_batch_size"):
        assert key in record, f"the sweep file does not record {key}"
    assert record["machine"]["cores"] and set(record["load_average_1min"]) == {"before", "after"}
    with pytest.raises(CourseError, match="cores"):
        bubble_sweep(train, args, 0, (os.cpu_count() or 1) + 1, torch.device("cpu"), path)


def test_pp_impl_schedule_and_microbatches_shape_what_each_rank_runs(run, script, needs):
    """What --pp-impl, --schedule and --microbatches change in the runs above: the stages on each rank, and the
    forwards (F) and backwards (B, and W for zero bubble) each rank ran in the last step, per micro-batch. From
    scratch the steps are the schedule's definition; the built-in's are torch's own (no step lists of ours)."""
    needs(1, 2, 3, 4, 5, 6)
    covered = set()
    for name in RUNS:
        result = run(name)[0]
        impl, schedule = passed(result, "--pp-impl", "scratch"), passed(result, "--schedule")
        m = int(passed(result, "--microbatches"))
        metrics = finished(result, 6 if impl == "scratch" else 7)
        p, v, covered = metrics["world_size"], 2 if schedule in script.MULTI_STAGE else 1, covered | {schedule}
        assert (metrics["pp_impl"], metrics["schedule"], metrics["microbatches"]) == (impl, schedule, m), name
        assert (metrics["stages"], metrics["stages_per_rank"]) == (v * p, v), f"--schedule {schedule}: {metrics}"
        if impl == "scratch":
            assert metrics["in_flight_per_rank"] is not None and metrics["bubble_from_steps"] is not None, name
            for rank, timeline in enumerate(metrics["timeline"]):
                ran = [(kind, mb) for kind, mb, *_ in timeline]
                assert ran == reference_step_lists(p, m, schedule, rank), f"{name} rank {rank} ran {ran}"
            continue
        assert metrics["in_flight_per_rank"] is None and metrics["bubble_from_steps"] is None, f"--pp-impl {impl}"
        if metrics["timeline"] is None:  # recorded through PipelineStage methods that are not public API
            continue
        kinds = "FBW" if schedule in ("interleaved-zb", "zbv") else "FB"
        for rank, timeline in enumerate(metrics["timeline"]):
            for stage in script.stage_indices(schedule, rank, p):
                for kind in kinds:
                    ran = sorted(mb for k, mb, *_, index in timeline if k == kind and index == stage)
                    assert ran == list(range(m)), f"{name} rank {rank} stage {stage}: {kind} of micro-batches {ran}"
            order = "".join(kind for kind, *_ in timeline)
            if schedule == "gpipe":
                assert order == "F" * m + "B" * m, f"--schedule gpipe: rank {rank} ran {order}"
            if schedule == "1f1b" and rank == p - 1:
                assert order == "FB" * m, f"--schedule 1f1b: the last stage alternates, ran {order}"
    shared_run = {"interleaved-zb"}  # run on one process by test_shared_options_change_the_run
    assert covered | shared_run == set(script.SCHEDULES), f"--schedule: no run of {set(script.SCHEDULES) - covered}"


def test_shared_options_change_the_run(lesson, tmp_path, needs):
    """Every shared option but --autocast (refused), at a value other than its default, on one process holding
    both stages of the built-in interleaved zero-bubble schedule (the one --schedule choice the runs above leave
    out): the run trains like the same steps written out with PyTorch alone on lesson 00's batches
    (tests/harness/option_effects.py), logged where it says, each stage running F, B and W for each micro-batch."""
    needs(1)
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 2, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json", "--pp-impl", "builtin", "--schedule", "interleaved-zb",
        "--microbatches", 2,
    ]  # fmt: skip
    result = python(lesson("05"), args, timeout=180, env=ENV)
    finished(result, 7)
    metrics = check_shared_options(result, order="generator")
    assert (metrics["stages"], metrics["stages_per_rank"], metrics["bubble_predicted"]) == (2, 2, None), metrics
    if metrics["timeline"] is not None:  # recorded through PipelineStage methods that are not public API
        ran = sorted((kind, mb, stage) for kind, mb, *_, stage in metrics["timeline"][0])
        assert ran == sorted((kind, mb, stage) for kind in "FBW" for mb in range(2) for stage in range(2)), ran


def test_bubble_sweep_runs_both_schedules_at_every_m_and_writes_the_file(lesson, tmp_path, needs):
    """--bubble-sweep through the script, on one process: GPipe and 1F1B at each m with micro-batches of
    --batch-size sequences, each run's steps recorded in the file under the world size (the formula: no bubble)."""
    needs(1, 2, 3, 4, 5, 6)
    sweep = tmp_path / "sweep.json"
    args = [
        "--dim", 16, "--n-layers", 1, "--n-heads", 2, "--seq-len", 8, "--steps", 2, "--batch-size", 1,
        "--optimizer", "sgd", "--log-dir", tmp_path / "runs", "--bubble-sweep", sweep,
    ]  # fmt: skip
    result = python(lesson("05"), args, tmp_path=tmp_path, timeout=180, env=ENV)
    metrics = finished(result, 6)
    record = json.loads(sweep.read_text())["1"]
    runs = [(run["schedule"], run["microbatches"]) for run in record["runs"]]
    assert runs == [(s, m) for s in ("gpipe", "1f1b") for m in SWEEP_MICROBATCHES], runs
    assert record["micro_batch_size"] == 1 and "--bubble-sweep" in record["command"], record["command"]
    for run in record["runs"]:
        assert run["bubble_predicted"] == 0 and len(run["timeline"][0]) == 2 * run["microbatches"], run
    assert metrics["bubble_sweep"] == record["runs"], "the metrics carry the sweep the file records"


# ---------------------------------------------------------------------------------------------------------------
# TODO 8: the debugging lab (a schedule that deadlocks), graded like lesson 01's labs
# ---------------------------------------------------------------------------------------------------------------

LAB = ROOT / "utils" / "lesson_05" / "lab.py"


def test_todo8_lab_capped_warm_ups_do_not_deadlock(script, lesson, tmp_path):
    """Pure Python first (a deadlock is named at once, nothing launched), then the 4-stage run on live ranks: the
    learner's warm-ups through the solution's engine, the gradients against one process."""
    if not hasattr(script, "capped_warmup"):
        pytest.fail("TODO 8: the script has no capped_warmup (the lab at the end of the exercise)", pytrace=False)
    message = check_warmups(script.capped_warmup)
    assert message is None, f"TODO 8: {message}. Hint: {HINT}"
    result = torchrun(LAB, 4, [lesson("05")], tmp_path=tmp_path, timeout=120, env=ENV).check()
    message = failure(result.metrics, 8)
    assert message is None, message


def test_the_lab_deadlock_ends_within_seconds_naming_the_ranks(target, request, tmp_path):
    """The untouched lab deadlocks on live ranks: the run must end by the 5 s timeout and name the waiting pair."""
    if target == "exercises" or request.config.getoption("--target-dir"):
        pytest.skip("a property of the lab itself, checked with the solutions")
    exercise = handed_out("05_pipeline_parallel.py", tmp_path)
    result = torchrun(LAB, 4, [exercise], tmp_path=tmp_path, timeout=120, env=ENV).check()
    ranks = result.metrics["ranks"]
    assert all(outcome["error"] for outcome in ranks), ranks
    assert max(outcome["seconds"] for outcome in ranks) < 60, [outcome["seconds"] for outcome in ranks]
    message = failure(result.metrics, 8)
    assert "rank 0 (after F0 F1) waits before B0 for gradient 0 from rank 1" in message, message
    assert "rank 1 (after F0 F1) waits before F2 for activation 2 from rank 0" in message, message
    assert "rank 0: warm-up 1, stuck in batch_isend_irecv [send activation 1 to rank 1, receive gradient 0" in message
