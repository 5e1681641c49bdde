"""Warm ranks (utils/course/warm_ranks.py) start a launch the way torchrun does, only sooner.

The suite's launches fork their ranks from one process that imported torch once. These tests run a
probe under torchrun itself and on warm ranks and compare what each rank sees, then check the parts
a test relies on: exit codes, a failing rank stopping the others, a hung rank stopped by the timeout
with nothing left behind, and the launches that must stay cold.
"""

import json
import os
import time

import psutil
import pytest

from tests.harness.launch import ROOT, course_env, python, torchrun, warm_pool
from utils.course.warm_ranks import WarmRanks, differs_at_import

PROBE = ROOT / "tests" / "workers" / "warm_probe.py"
# torchrun's own bookkeeping, and variables whose value is per launch by nature
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
              "TORCHELASTIC_AGENT_STORE_PREFIX", "TORCHELASTIC_HEARTBEAT_TIMEOUT", "TORCH_ELASTIC_WORKER_IDENTIFIER",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DEBUGPY_RUNNING"}  # fmt: skip


def probe(tmp_path, name: str, nproc: int | None, *action, cold: bool) -> tuple:
    folder = tmp_path / name
    folder.mkdir()
    args = [folder, *action]
    run = python(PROBE, args, cold=cold) if nproc is None else torchrun(PROBE, nproc, args, cold=cold, timeout=60)
    seen = [json.loads(path.read_text()) for path in sorted(folder.glob("rank-*.json"))]
    return run, seen


def test_a_rank_sees_what_it_sees_under_torchrun(tmp_path):
    cold_run, cold = probe(tmp_path, "cold", 2, cold=True)
    warm_run, warm = probe(tmp_path, "warm", 2, cold=False)
    assert cold_run.returncode == warm_run.returncode == 0, cold_run.output + warm_run.output
    assert len(cold) == len(warm) == 2
    for rank, (under_torchrun, forked) in enumerate(zip(cold, warm)):
        expected = {k: v for k, v in under_torchrun["environment"].items() if k not in PER_LAUNCH}
        got = {k: v for k, v in forked["environment"].items() if k not in PER_LAUNCH}
        assert got == expected, f"rank {rank}: environment differs: {set(got.items()) ^ set(expected.items())}"
        assert forked["argv"] == [under_torchrun["argv"][0], under_torchrun["argv"][1].replace("cold", "warm")]
        for key in ("path0", "cwd", "main", "file", "all_reduce"):
            assert forked[key] == under_torchrun[key], f"rank {rank}: {key} {forked[key]!r} != {under_torchrun[key]!r}"
    assert warm[0]["all_reduce"] == 3.0  # 1 + 2: the two forked ranks formed a process group


def test_plain_python_keeps_its_exit_code_and_output(tmp_path):
    for cold in (True, False):
        run, seen = probe(tmp_path, f"plain-{cold}", None, "exit", "2", cold=cold)
        assert run.returncode == 2 and run.output == "rank 0 done\n", (cold, run.output)
        assert "RANK" not in seen[0]["environment"] and "WORLD_SIZE" not in seen[0]["environment"]


def test_a_failing_rank_fails_the_launch_and_stops_the_others(tmp_path):
    """Rank 1 exits 3 while rank 0 sleeps: as under torchrun, the launch fails (1) and rank 0 is stopped."""
    start = time.monotonic()
    run, _ = probe(tmp_path, "wait", 2, "wait", cold=False)
    assert run.returncode == 1, run.output
    assert "[launcher] rank 1 exited with code 3: stopping the other ranks" in run.output
    assert time.monotonic() - start < 30, "rank 0 was not stopped (it sleeps 600 s)"


def test_a_raising_rank_ends_the_launch_with_its_traceback(tmp_path):
    run, _ = probe(tmp_path, "raise", 2, "raise", cold=False)
    assert run.returncode == 1, run.output
    assert "ValueError: rank 1 raises on purpose" in run.output
    assert "[launcher] rank 1 exited with code 1" in run.output


def test_a_hung_rank_is_stopped_by_the_timeout_and_nothing_is_left(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(AssertionError, match="did not finish within 20 s"):
        folder = tmp_path / "hang"
        folder.mkdir()
        torchrun(PROBE, 2, [folder, "hang"], timeout=20)
    time.sleep(1)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert not left, f"processes left behind: {[p.cmdline() for p in left]}"


def test_launches_that_need_torchrun_or_another_import_stay_cold():
    pool = warm_pool(course_env())
    assert pool is not None, f"this session's launches run cold: {differs_at_import(course_env(), _pool_environment())}"
    assert warm_pool(course_env(TORCH_DISTRIBUTED_DEBUG="DETAIL")) is None  # read when torch.distributed loads
    assert warm_pool(course_env(OMP_NUM_THREADS="2")) is None  # read when torch loads
    assert warm_pool(course_env(COURSE_TIMEOUT_S="5", PYTHONPATH=str(ROOT))) is pool  # read by the script: fine
    assert differs_at_import({"HF_HUB_OFFLINE": "1"}, {}) == ["HF_HUB_OFFLINE"]
    os.environ["COURSE_COLD_RANKS"] = "1"
    try:
        assert warm_pool(course_env()) is None
    finally:
        del os.environ["COURSE_COLD_RANKS"]


def _pool_environment() -> dict:
    pool = WarmRanks.from_environment()
    return pool.environment if pool else {}


def test_the_session_launches_warm():
    """Something in the session (an import, a test) that changes a variable an import reads would turn every
    later launch cold, silently slow: name it here."""
    assert warm_pool(course_env()) is not None, differs_at_import(course_env(), _pool_environment())
