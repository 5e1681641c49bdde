"""Lesson 00: the single-device baseline trains, logs, measures and refuses what it cannot do.

pytest tests/test_00_setup_and_baseline.py                      # the solution
pytest tests/test_00_setup_and_baseline.py --target exercises   # your exercise (make check LESSON=00)
"""

import json
import math
import time

import pytest
import torch

from tests.harness.launch import ROOT, course_env, finished, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext
from utils.data import load_token_dataset
from utils.metrics import param_checksum
from utils.model import TINY, ModelConfig, build_model, loss_fn

STEPS = 60
UNIFORM_LOSS = math.log(256)  # what a model that knows nothing about bytes scores


@pytest.fixture(scope="module")
def baseline(lesson, tmp_path_factory):
    """One short run under torchrun with one process, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("lesson00")
    args = ["--steps", STEPS, "--log-dir", tmp / "runs", "--checkpoint", tmp / "model.pt"]
    return torchrun(lesson("00"), 1, args, tmp_path=tmp), tmp


def reference_losses(steps: int, autocast: bool, mistake: str | None = None) -> list[float]:
    """Lesson 00's training step written out here, on the script's data order (a DataLoader shuffled by a
    generator seeded with --seed 0), model (seed 0) and SGD: what TODO 1 must reproduce. `mistake` writes out a
    known wrong step instead: "accumulates" (the gradients are never cleared), "frozen" (the weights never move)."""
    train = load_token_dataset("synthetic", TINY.seq_len, "train")
    loader = torch.utils.data.DataLoader(
        train, batch_size=8, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0)
    )
    model = build_model(TINY, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _, (inputs, targets) in zip(range(steps), loader):
        if mistake != "accumulates":
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        if mistake != "frozen":
            optimizer.step()
        losses.append(loss.item())
    return losses


# What the losses of a known wrong step look like, and the cause in the learner's terms.
TODO1_MISTAKES = {
    "accumulates": "the gradients accumulate from step to step: each backward adds to what the last one left in "
    ".grad, which nothing cleared",
    "frozen": "the weights never moved: these are the untrained model's losses on each batch (did the optimizer step "
    "while the gradients were still there?)",
}


def training_step_problem(losses: list[float], precision: str) -> str | None:
    """Where TODO 1's losses first differ from the reference step's, and the likely cause, or None."""
    expected = reference_losses(len(losses), autocast=precision == "bf16")
    if losses == pytest.approx(expected, abs=1e-5):
        return None
    step = next(i for i, (got, want) in enumerate(zip(losses, expected)) if got != pytest.approx(want, abs=1e-5))
    first = f"step {step + 1}'s loss is {losses[step]:.5f}, want {expected[step]:.5f}"
    if precision == "bf16" and losses == pytest.approx(reference_losses(len(losses), autocast=False), abs=1e-5):
        return f"{first}: these are the fp32 losses: the forward pass and the loss did not run under autocast"
    for mistake, cause in TODO1_MISTAKES.items():
        if losses == pytest.approx(reference_losses(len(losses), precision == "bf16", mistake), abs=1e-5):
            return f"{first}: {cause}"
    if step == 0:
        return f"{first}: the first step's loss is loss_fn of the model's logits for this batch" + (
            ", under autocast" if precision == "bf16" else ""
        )
    return f"{first}: the first step matches, a later one does not (what do the gradients hold when it steps?)"


@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_todo1_training_step_matches_the_reference_step(lesson, tmp_path, precision):
    """Three SGD steps, fp32 and with --autocast bf16, against the step written out in this test. First among
    TODO 1's tests: its line says which step differs, and why when a known mistake gives these losses."""
    args = ["--steps", 3, "--optimizer", "sgd", "--autocast", precision, "--log-dir", tmp_path / "runs"]
    losses = finished(python(lesson("00"), args, tmp_path=tmp_path), 1)["losses"]
    assert len(losses) == 3, f"TODO 1: {len(losses)} losses recorded in 3 steps: append one per step"
    problem = training_step_problem(losses, precision)
    assert problem is None, f"TODO 1: {problem}"


def test_todo1_training_step_lowers_the_loss(baseline):
    metrics = finished(baseline[0], 1)
    losses = metrics["losses"]
    assert len(losses) == STEPS, f"TODO 1: {len(losses)} losses recorded in {STEPS} steps, expected one per step"
    # 60 AdamW steps on the generated corpus reach about 2.1; a model that does not learn stays near 5.5.
    assert metrics["final_loss"] < 0.7 * UNIFORM_LOSS, (
        f"TODO 1: the final loss is {metrics['final_loss']:.2f}, expected below {0.7 * UNIFORM_LOSS:.2f} (a model "
        f"that learned nothing scores log(256) = {UNIFORM_LOSS:.2f}); every 10th loss: {losses[::10]}"
    )
    assert sum(losses[-10:]) < sum(losses[:10]) - 10 * 1.0, (
        f"TODO 1: the last 10 losses are not 1.0 below the first 10 on average: every 10th loss {losses[::10]}"
    )


def test_todo2_tokens_per_step_are_batch_times_sequence_length(lesson, tmp_path):
    """What the training loop feeds the throughput meter (tests/workers/throughput_probe.py records it)."""
    out = tmp_path / "tokens.json"
    args = ["--steps", 3, "--batch-size", 4, "--seq-len", 32, "--log-dir", tmp_path / "runs"]
    run = python(ROOT / "tests" / "workers" / "throughput_probe.py", [out, lesson("00"), *args], timeout=180)
    finished(run, 2)
    counted = json.loads(out.read_text())["tokens"]
    assert len(counted) == 3, f"TODO 2: the meter was fed {len(counted)} times in 3 steps: once per step"
    assert counted == [4 * 32] * 3, f"TODO 2: {tokens_problem(counted, batch=4, seq_len=32)}"


def tokens_problem(counted: list[int], batch: int, seq_len: int) -> str:
    """The first step that fed the meter a wrong count, and what that count is when a known mistake gives it."""
    step = next(i for i, tokens in enumerate(counted) if tokens != batch * seq_len)
    got = counted[step]
    causes = {
        batch: f"{batch} is the batch's number of sequences: each of a sequence's {seq_len} positions is a "
        "prediction too",
        seq_len: f"{seq_len} is one sequence's length: the batch holds {batch} sequences",
        batch * (seq_len + 1): f"{batch} x {seq_len + 1} counts each block's T + 1 tokens, but the inputs hold T = "
        f"{seq_len} (a block's last token is only a target)",
        batch * seq_len * (step + 1): "that is the running total: the meter adds up each step's count itself",
    }
    cause = causes.get(got, f"a batch of {batch} sequences of {seq_len} tokens trains {batch} x {seq_len} predictions")
    return f"step {step + 1} fed the meter {got} tokens, want {batch} x {seq_len} = {batch * seq_len}: {cause}"


def test_todo3_loss_logged_to_tensorboard(baseline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tmp = baseline
    metrics = finished(run, 3)
    assert list((tmp / "runs").glob("events.out.tfevents.*")), "TODO 3: no tensorboard event file was written"
    events = EventAccumulator(str(tmp / "runs")).Reload()
    scalars = events.Tags()["scalars"]
    assert "loss" in scalars, f"TODO 3: tensorboard has no scalar named `loss`, only {scalars}"
    logged = events.Scalars("loss")
    steps = [e.step for e in logged]
    from_zero = " (counted from 0: the loop's `step` is already 1 at the first step)" * (steps[:1] == [0])
    assert steps == list(range(1, STEPS + 1)), (
        f"TODO 3: `loss` logged at steps {steps[:5]}..., want 1, 2, ..., {STEPS}{from_zero}"
    )
    values = [e.value for e in logged]
    assert values == pytest.approx(metrics["losses"], rel=1e-6), f"TODO 3: {logged_loss_problem(values, metrics)}"
    assert "tokens_per_s" in scalars, f"TODO 3: tensorboard has no scalar named `tokens_per_s`, only {scalars}"


def logged_loss_problem(values: list[float], metrics: dict) -> str:
    """The first step whose logged `loss` is not that step's loss, and whose loss it is when it is another step's."""
    losses = metrics["losses"]
    step = next(i for i, (v, loss) in enumerate(zip(values, losses)) if v != pytest.approx(loss, rel=1e-6))
    first = f"step {step + 1}'s `loss` is logged as {values[step]:.4f}, but that step's loss was {losses[step]:.4f}"
    if values == pytest.approx([losses[0]] * len(values), rel=1e-6):
        return f"{first}: every step logs the first step's loss"
    other = next((i for i, loss in enumerate(losses) if values[step] == pytest.approx(loss, rel=1e-6)), None)
    return first + (f": it is step {other + 1}'s loss" if other is not None else "")


def test_metrics_file_is_complete(baseline):
    metrics = finished(baseline[0], 1)
    for field in ("final_loss", "losses", "steps", "world_size", "tokens_per_s", "param_checksum", "bytes_per_rank"):
        assert field in metrics, field
    assert metrics["world_size"] == 1 and metrics["steps"] == STEPS
    assert metrics["bytes_per_rank"]["params"] == 4 * 137_216  # the tiny model in fp32
    assert metrics["bytes_per_rank"]["optimizer"] == 2 * 4 * 137_216  # AdamW: two moments per parameter
    assert baseline[0].output.rstrip().splitlines()[-1].startswith("FINISHED")


def test_checkpoint_loads_on_one_process(baseline):
    run, tmp = baseline
    metrics = finished(run, 1)
    state = torch.load(tmp / "model.pt", weights_only=True)
    model = build_model(ModelConfig(**state["config"]), seed=123)
    model.load_state_dict(state["model"])
    assert param_checksum(model) == pytest.approx(metrics["param_checksum"], rel=1e-12)


def test_same_seed_same_run_with_or_without_torchrun(lesson, tmp_path):
    """A plain `python script.py` and `torchrun --nproc_per_node=1` are the same world of one."""
    args = ["--steps", 3, "--optimizer", "sgd", "--log-dir", tmp_path / "runs"]
    plain = python(lesson("00"), args, tmp_path=tmp_path)
    launched = torchrun(lesson("00"), 1, args, tmp_path=tmp_path)
    assert finished(plain, 1)["losses"] == finished(launched, 1)["losses"]
    assert plain.metrics["param_checksum"] == launched.metrics["param_checksum"]


def test_two_processes_are_refused_with_a_clear_message(lesson, tmp_path):
    start = time.perf_counter()
    run = torchrun(lesson("00"), 2, ["--steps", 2, "--log-dir", tmp_path / "runs"], timeout=90)
    assert run.returncode != 0
    assert "lesson 00 is the single-device baseline: run it with 1 process" in run.output, run.tail()
    assert "lesson 02 makes it data parallel" in run.output
    assert time.perf_counter() - start < 60


def test_wikitext_without_prepared_cache_stops_at_once(lesson, tmp_path):
    """A compute node: no internet, no prepared copy. One line telling what to run on the login node."""
    env = course_env(COURSE_DATA=tmp_path / "empty")
    start = time.perf_counter()
    run = python(lesson("00"), ["--dataset", "wikitext", "--log-dir", tmp_path / "runs"], env=env, timeout=60)
    elapsed = time.perf_counter() - start
    assert run.returncode == 2, run.tail()
    assert "python -m utils.data prepare --dataset wikitext" in run.output, run.tail()
    assert "Traceback" not in run.output
    assert elapsed < 20, f"took {elapsed:.0f} s: the missing cache must be found before any download attempt"


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line, at a value other than its default, trains another run: the one
    the same steps written out with PyTorch alone give (tests/harness/option_effects.py), logged where it says."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json",
    ]  # fmt: skip
    check_shared_options(python(lesson("00"), args, timeout=180), order="generator")
