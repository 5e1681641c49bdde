"""Lesson 01: the hand-written all-reduces equal dist.all_reduce; the script runs and reports.

`make check LESSON=01` runs these against exercises/01_collectives.py: each failure names its TODO.
"""

import json

import pytest

from tests.harness.launch import ROOT, python, torchrun
from utils.course.lab import failure
from utils.course.lessons import load_script

WORKER = ROOT / "tests" / "workers" / "collectives_check.py"
LAB_WORKER = ROOT / "tests" / "workers" / "lab_check.py"


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}ranks")
def checks(request, lesson, tmp_path_factory):
    """One launch per world size checks every TODO (3 ranks: chunks of unequal size, odd ring)."""
    out = tmp_path_factory.mktemp("collectives") / "checks.json"
    run = torchrun(WORKER, request.param, [lesson("01"), out], timeout=120)
    if run.returncode == 0:
        return {**json.loads(out.read_text()), "world_size": request.param}
    # A crash (a receive too small for what arrives, an error in a TODO's code) ends every check of the launch:
    # run each check alone, so that the crash is blamed on its own TODO and the others are still graded. The
    # shapes checked before the crash come first: a wrong value there says more than the crash.
    results = {}
    for name in ("todo1", "todo2", "ring", "todo3"):
        out.unlink(missing_ok=True)
        alone = torchrun(WORKER, request.param, [lesson("01"), out, name], timeout=120)
        done = json.loads(out.read_text()).get(name, {}) if out.exists() else {}
        crashed = f"the ranks crashed (exit {alone.returncode}): {alone.tail(3)}"
        results[name] = done if alone.returncode == 0 else {**done, "(all)": crashed}
    return {**results, "world_size": request.param}


def assert_exact(checks: dict, check: str, todo: str):
    """Each shape's largest difference from dist.all_reduce must be 0 on every rank; the message says where the
    result first differs (rank, element, got and want) and the likely cause when a known mistake gives it."""
    for shape, outcome in checks[check].items():
        where = f"{todo}: at {checks['world_size']} ranks"
        where += "" if shape == "(all)" else f", on a tensor of shape {shape}"  # "(all)": the launch crashed
        assert not isinstance(outcome, str), f"{where}: {outcome}"
        # Integer-valued inputs: every order of summation gives exactly the library's answer (NaN: a chunk of
        # TODO 2's check still to arrive, which fails too).
        assert outcome["gap"] == 0.0, f"{where}: {outcome['problem']}"


def test_todo1_ring_reduce_scatter_phase(checks):
    assert_exact(checks, "todo1", "TODO 1 (ring reduce-scatter)")


def test_todo2_ring_all_gather_phase(checks):
    assert_exact(checks, "todo2", "TODO 2 (ring all-gather)")


def test_ring_all_reduce_of_todos_1_and_2_equals_library(checks):
    """The two phases together (an "other check": TODOs 1 and 2 are each graded on their own above)."""
    assert_exact(checks, "ring", "TODOs 1 and 2 together (ring_all_reduce)")


def test_todo3_all_reduce_from_reduce_scatter_and_all_gather(checks):
    assert_exact(checks, "todo3", "TODO 3 (reduce-scatter + all-gather)")


@pytest.fixture(scope="module")
def lab(lesson, tmp_path_factory):
    """The debugging lab (TODOs 4-8): one launch at 3 ranks (an odd world: one rank without a partner,
    one rank with an empty slice), each case in a fresh gloo group with a 5 s timeout."""
    out = tmp_path_factory.mktemp("lab") / "lab.json"
    torchrun(LAB_WORKER, 3, [lesson("01"), out, "skip", "raise", "shapes", "swap", "branch"], timeout=300).check()
    return json.loads(out.read_text())


def assert_lab(outcomes: dict, case: str, todo: int):
    """The case's verdict (utils/course/lab.py); a failure's line says what the rank closest to the cause did and,
    when a known mistake gives what came back, its likely cause (else the case's hint)."""
    message = failure(case, outcomes[case], todo)
    assert message is None, message


def test_todo4_lab_a_collective_some_ranks_skip(lab):
    assert_lab(lab, "skip", 4)


def test_todo5_lab_a_rank_that_raises(lab):
    assert_lab(lab, "raise", 5)


def test_todo6_lab_shapes_that_differ_between_ranks(lab):
    assert_lab(lab, "shapes", 6)


def test_todo7_lab_send_and_recv_in_the_wrong_order(lab):
    assert_lab(lab, "swap", 7)


def test_todo8_lab_a_rank_dependent_branch_around_a_collective(lab):
    assert_lab(lab, "branch", 8)


def test_script_runs_and_writes_metrics(lesson, tmp_path):
    reference = tmp_path / "reference.json"
    args = ["--sizes", "4K,64K", "--steps", "2", "--benchmark-out", reference]
    run = torchrun(lesson("01"), 4, args, tmp_path=tmp_path).check()
    assert run.output.strip().splitlines()[-1].startswith("FINISHED"), run.tail()
    metrics = run.metrics
    assert metrics["world_size"] == 4 and len(metrics["hosts"]) == 4
    # The demos are the real tensors before and after: all-reduce of [10r+1, ...] sums over ranks.
    expected_sum = [sum(10 * r + i for r in range(4)) for i in range(1, 5)]
    assert metrics["demos"]["all_reduce"]["after"] == [expected_sum] * 4
    assert metrics["demos"]["broadcast"]["after"] == [[1.0, 2.0, 3.0, 4.0]] * 4
    assert metrics["errors"]["ring"] < 1e-5 and metrics["errors"]["rs_ag"] < 1e-5
    assert [row["bytes"] for row in metrics["benchmark"]] == [4096, 65536]
    for row in metrics["benchmark"]:
        for name in ("library", "ring", "rs_ag"):
            timing = row[name]
            assert 0 < timing["seconds_min"] <= timing["seconds"] <= timing["seconds_max"], timing
            assert timing["algbw_GBps"] == pytest.approx(row["bytes"] / timing["seconds"] / 1e9)
            assert timing["busbw_GBps"] == pytest.approx(timing["algbw_GBps"] * 2 * 3 / 4)
    assert set(metrics["alpha_beta"]) == {"alpha_s", "beta_s_per_byte", "link_bandwidth_GBps"}
    assert "alpha-beta fit" in run.output and "ring speed = library time / ring time" in run.output
    # --benchmark-out: the reference file the notebook renders, with the machine and versions beside it.
    saved = json.loads(reference.read_text())["runs"]["4"]
    assert saved["rows"] == metrics["benchmark"]
    assert {"cpu", "cpu_cores", "torch", "python", "backend"} <= set(saved["machine"])
    assert saved["rounds"] == 2 and "--nproc_per_node=4" in saved["command"]


def test_alpha_beta_fit_recovers_the_ring_model(lesson):
    """Timings made from t(S) = 2(n-1) alpha + 2(n-1)/n S beta give back alpha and beta themselves."""
    module = load_script(lesson("01"), "lesson01")
    alpha, beta, n = 50e-6, 1 / 2e9, 4  # 50 us per message, 2 GB/s per link
    rows = [
        {"bytes": size, "library": {"seconds": 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta}}
        for size in (1024, 65536, 1 << 20, 16 << 20)
    ]
    fitted_alpha, fitted_beta = module.fit_alpha_beta(rows, "library", n)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6), "alpha must be the one-way cost of one message"
    assert fitted_beta == pytest.approx(beta, rel=1e-6), "beta must be seconds per byte on one link"


@pytest.mark.parametrize(
    "option, value",
    [("--sizes", "16Q"), ("--sizes", "1K,6"), ("--sizes", "0"), ("--steps", "0")],
    ids=["unit", "not-a-multiple-of-4", "zero-size", "zero-steps"],
)
def test_bad_options_end_at_once_with_one_line(lesson, option, value):
    run = python(lesson("01"), [option, value], timeout=60)
    assert run.returncode == 2, run.output
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and f"argument {option}" in lines[0] and "Traceback" not in run.output, run.output


def test_runs_without_torchrun_as_a_world_of_one(lesson, tmp_path):
    metrics_path = tmp_path / "metrics" / "m.json"
    run = python(lesson("01"), ["--skip-benchmark", "--metrics-out", metrics_path]).check()
    metrics = json.loads(metrics_path.read_text())  # --metrics-out: written where it says, folder created
    assert metrics["world_size"] == 1
    assert "world size 1" in run.output
    # --skip-benchmark: parts 1 and 2 only (the default runs part 3, as test_script_runs_and_writes_metrics shows)
    assert metrics["benchmark"] == [] and "Part 3" not in run.output, run.tail()
    assert "Part 2" in run.output and metrics["errors"]["ring"] < 1e-5


def test_untouched_exercise_stops_at_once_naming_todo_1(tmp_path):
    """The generated exercise, as a learner first gets it: one line naming TODO 1, no hang."""
    exercise = ROOT / "exercises" / "01_collectives.py"
    run = torchrun(exercise, 2, ["--skip-benchmark"], timeout=120)  # at once; the margin is for a busy machine
    assert run.returncode != 0
    assert "TODO 1: the reduce-scatter phase of the ring is not done yet" in run.output, run.tail()
