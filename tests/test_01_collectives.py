"""Lesson 01: the hand-written all-reduces equal dist.all_reduce; the script runs and reports.

`make check LESSON=01` runs these against exercises/01_collectives.py: each failure names its TODO.
"""

import json

import pytest

from tests.launch import ROOT, python, torchrun

WORKER = ROOT / "tests" / "workers" / "collectives_check.py"


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}ranks")
def checks(request, lesson, tmp_path_factory):
    """One launch per world size checks every TODO (3 ranks: chunks of unequal size, odd ring)."""
    out = tmp_path_factory.mktemp("collectives") / "checks.json"
    torchrun(WORKER, request.param, [lesson("01"), out], timeout=120).check()
    return json.loads(out.read_text())


def assert_exact(results: dict, todo: str):
    for shape, outcome in results.items():
        assert not isinstance(outcome, str), f"{todo}, tensor of shape {shape}: {outcome}"
        # Integer-valued inputs: every order of summation gives exactly the library's answer.
        assert outcome == 0.0, f"{todo}, tensor of shape {shape}: differs from the library by {outcome}"


def test_todo1_ring_reduce_scatter_phase(checks):
    assert_exact(checks["todo1"], "TODO 1 (ring reduce-scatter)")


def test_todo2_ring_all_gather_phase(checks):
    assert_exact(checks["todo2"], "TODO 2 (ring all-gather)")


def test_todos_1_2_ring_all_reduce_equals_library(checks):
    assert_exact(checks["ring"], "TODOs 1 and 2 together (ring_all_reduce)")


def test_todo3_all_reduce_from_reduce_scatter_and_all_gather(checks):
    assert_exact(checks["todo3"], "TODO 3 (reduce-scatter + all-gather)")


def test_script_runs_and_writes_metrics(lesson, tmp_path):
    run = torchrun(lesson("01"), 4, ["--sizes", "4K,64K", "--steps", "2"], tmp_path=tmp_path).check()
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
            assert row[name]["seconds"] > 0
            assert row[name]["busbw_GBps"] == pytest.approx(row[name]["algbw_GBps"] * 2 * 3 / 4)


def test_runs_without_torchrun_as_a_world_of_one(lesson, tmp_path):
    run = python(lesson("01"), ["--skip-benchmark"], tmp_path=tmp_path).check()
    assert run.metrics["world_size"] == 1
    assert "world size 1" in run.output
