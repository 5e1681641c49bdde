"""Lesson 04's debugging lab (TODO 8): run `train_parallel_mlp` on live ranks, say what each rank did, grade it.

Lessons 01 and 02 grade their labs with utils/course/lab.py; this is the same pattern for tensor parallelism, whose
failure is not a hang but a run that trains without an error and is wrong: a row-parallel layer without its g leaves a
partial sum on every rank, so the ranks report different losses, none of them one process's.

    outcome = run_case(lesson, reference)      # on every rank: {"value": [losses], "error": ..., "seconds": ...}
    passed, lines = verdict(outcomes)          # on one process, with every rank's outcome
    message = failure(outcomes, todo=8)        # None when right, else the test's message with a hint

The reference is one process training the same three nn.Linear layers (no collectives), computed here, never
the learner's code. The lab runs on gloo with a short timeout (utils/course/lab.py says why), so a collective that only
some ranks call ends in an error within seconds instead of a hang.
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

from utils.course.lab import describe_error

FUNCTION = "train_parallel_mlp"
STEPS, LR = 3, 0.5
DIM, HIDDEN, BATCH, TOKENS = 8, 16, 2, 4  # HIDDEN splits over 2 and 4 ranks
TOLERANCE = 1e-5  # float32: the ranks' partial sums are added in another order than one process adds them
HINT = (
    "after its slice of down, each rank holds a partial sum of the MLP's output: g (ReduceFromParallelRegion) "
    "adds the ranks' parts before the bias and the residual; f (CopyToParallelRegion) on the MLP's input sums "
    "the input's gradient"
)


def lab_layers():
    """The three whole layers and the batch, identical on every rank (their own generator, not the rank's seed)."""
    generator = torch.Generator().manual_seed(4)

    def linear(n_in, n_out, bias=True):
        layer = nn.Linear(n_in, n_out, bias=bias)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) / n_in**0.5)
        return layer

    embed, up, down = linear(DIM, DIM, bias=False), linear(DIM, HIDDEN), linear(HIDDEN, DIM)
    inputs = torch.randn(BATCH, TOKENS, DIM, generator=generator)
    targets = torch.randn(BATCH, TOKENS, DIM, generator=generator)
    return embed, up, down, inputs, targets


def one_process_losses(bias_times: float = 1.0, sum_times: float = 1.0) -> list[float]:
    """The answer: the same model and steps on one process, whole layers, no collectives. bias_times, sum_times:
    the down layer's bias and its partial sums' total scaled, as the known mistakes scale them on every rank."""
    embed, up, down, inputs, targets = lab_layers()
    optimizer = torch.optim.SGD([*embed.parameters(), *up.parameters(), *down.parameters()], lr=LR)
    losses = []
    for _ in range(STEPS):
        h = embed(inputs)
        # the mistaken bias is added in each rank's partial output, whose gradient g passes through unchanged
        bias = down.bias + (bias_times - 1) * down.bias.detach()
        out = sum_times * F.linear(F.gelu(up(h)), down.weight) + bias
        loss = F.mse_loss(h + out, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_case(lesson, reference, group=None) -> dict:
    """Run the lesson's train_parallel_mlp on this rank: {"value": its losses, "error", "seconds"}.

    f and g are the reference's (solutions/04), so the lab grades TODO 8 whatever the state of TODO 1."""
    lesson.CopyToParallelRegion = reference.CopyToParallelRegion
    lesson.ReduceFromParallelRegion = reference.ReduceFromParallelRegion
    start = time.perf_counter()
    try:
        value = getattr(lesson, FUNCTION)(*lab_layers(), STEPS, LR, group)
        return {"value": [float(v) for v in value], "error": None, "seconds": time.perf_counter() - start}
    except NotImplementedError as error:
        return {"value": None, "error": f"not done: {error}", "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - the lab reports whatever the learner's code raised
        return {"value": None, "error": describe_error(error), "seconds": time.perf_counter() - start}


def _losses(values) -> str:
    return ", ".join(f"{v:.5f}" for v in values)


def _first_difference(values, expected) -> int | None:
    """The first step (from 1) where `values` differ from `expected`, None when they agree."""
    if not isinstance(values, list) or len(values) != len(expected):
        return 1
    return next((step for step, (v, e) in enumerate(zip(values, expected), 1) if abs(v - e) > TOLERANCE), None)


def verdict(outcomes: list[dict]) -> tuple[bool, list[str]]:
    """(passed, lines): one line per rank against one process, then whether the ranks agree with each other."""
    expected = one_process_losses()
    lines, passed = [], True
    for rank, outcome in enumerate(outcomes):
        if outcome["error"]:
            lines.append(f"rank {rank}: {FUNCTION} {outcome['error']}")
            passed = False
            continue
        step = _first_difference(outcome["value"], expected)
        if step is None:
            lines.append(f"rank {rank}: {FUNCTION} returned losses {_losses(outcome['value'])} (right)")
        else:
            lines.append(
                f"rank {rank}: {FUNCTION} returned losses {_losses(outcome['value'])}, not one process's "
                f"{_losses(expected)} (from step {step})"
            )
            passed = False
    values = [o["value"] for o in outcomes if not o["error"]]
    if len(values) == len(outcomes) > 1:
        apart = [_first_difference(v, values[0]) for v in values[1:]]
        steps = [s for s in apart if s is not None]
        lines.append(f"the ranks disagree from step {min(steps)}" if steps else "every rank reports the same losses")
    return passed, lines


def failure(outcomes: list[dict], todo: int) -> str | None:
    """None when every rank matched one process; else the test's message: the TODO, the first wrong rank, a hint,
    then what every rank did."""
    passed, lines = verdict(outcomes)
    if passed:
        return None
    first = next(line for line in lines if line.startswith("rank") and not line.endswith("(right)"))
    cause = likely_cause(outcomes)
    return f"TODO {todo}: {first}{cause}. Hint: {HINT}.\nEvery rank:\n" + "\n".join(lines)


def likely_cause(outcomes: list[dict]) -> str:
    """The known mistakes, recognised by their losses (computed here on one process) or by when the ranks part."""
    values = [o["value"] for o in outcomes]
    if any(o["error"] for o in outcomes) or len(values) < 2:
        return ""
    n, expected = len(values), one_process_losses()
    known = {
        f"the down layer's bias is added {n} times (on every rank before g sums them)": one_process_losses(n),
        f"g averages the {n} partial outputs instead of summing them": one_process_losses(sum_times=1 / n),
    }
    cause = next((why for why, losses in known.items() if _first_difference(values[0], losses) is None), None)
    if cause:
        return f": {cause}"
    agree = all(_first_difference(v, values[0]) is None for v in values[1:])
    if _first_difference(values[0], expected) != 1 and not agree:
        return (": right at step 1, then the ranks drift apart: the forward is right, but a gradient stays partial "
                "on each rank (likely the MLP's input does not pass through f)")  # fmt: skip
    if not agree:
        return ": wrong from step 1 and the ranks disagree: likely each rank's MLP output is left a partial sum (no g)"
    return ""


# --------------------------------------------------------------------------------------------------
# On the notebook's live ranks (utils.course.notebook.start_ranks)
# --------------------------------------------------------------------------------------------------

_ON_EACH_RANK = """
from utils.course.lessons import load_script
from utils.lesson_04.lab import run_case
_tp_lab_outcome = run_case(load_script({path!r}, "tp_lab_lesson"), load_script({reference!r}, "tp_lab_reference"))
"""


def run_on_ranks(ranks, script: str) -> tuple[bool, list[str]]:
    """Run the lab with `script`'s train_parallel_mlp (e.g. "exercises/04_tensor_parallel.py", loaded afresh: your
    latest edit counts) on every live rank; (passed, lines). The ranks get a fresh process group afterwards."""
    from utils.course.notebook import ROOT

    code = _ON_EACH_RANK.format(path=str(ROOT / script), reference=str(ROOT / "solutions" / "04_tensor_parallel.py"))
    ranks.view.execute(code, block=True)
    passed, lines = verdict(ranks.view.pull("_tp_lab_outcome", block=True))
    ranks.restart()  # a collective that timed out leaves the group unusable: start every lab from a fresh one
    return passed, lines
