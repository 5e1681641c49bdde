"""utils.course.notebook.start_ranks: live ranks for notebook cells (ipyparallel engines in one process group).

Each test starts its own ranks, so these take a while on a busy 2-core machine (about 10 s each when idle).
"""

import os
import signal
import time

import psutil
import pytest

pytest.importorskip("ipyparallel")

from ipyparallel.error import CompositeError  # noqa: E402

from tests.harness.launch import ROOT  # noqa: E402
from utils.course import notebook  # noqa: E402
from utils.course.notebook import _visible_gpus, explain, start_ranks  # noqa: E402

GPUS = _visible_gpus()  # NCCL with one GPU per rank where GPUs exist, gloo on the CPU otherwise


def no_process_left(ranks, pids):
    """Every rank and the controller have exited (a zombie awaiting its parent counts as gone)."""
    gone = []
    for pid in [*pids, *(p.pid for p in ranks.processes)]:
        try:
            gone.append(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            gone.append(True)
    return all(gone)


def assert_ranks_answer_in_rank_order(ranks, world_size):
    """One process per rank, each knowing its rank and device, and an all-reduce across them that adds up."""
    device_type = "cuda" if GPUS else "cpu"
    assert len(set(ranks.pids)) == world_size, f"{world_size} ranks must be {world_size} processes: {ranks.pids}"
    identity = ranks.pull_expression("(rank, world_size, local_rank, dist.get_rank(), device.type)")
    assert identity == [(r, world_size, r, r, device_type) for r in range(world_size)], identity
    ranks.view.execute("x = torch.arange(3.0, device=device) + 10 * rank; dist.all_reduce(x)")
    expected = [sum(10 * r + i for r in range(world_size)) for i in range(3)]
    assert [x.tolist() for x in ranks.pull("x")] == [expected] * world_size


# Four ranks started, answering in rank order and stopped with no process left, from a notebook: tests/test_browser.py
# (lesson 01 in the lab, Run All, then a kernel restart), and nbval compares their answers with the committed ones.
# Here: what a notebook's run does not show, on 2 ranks.
@pytest.mark.skipif(0 < GPUS < 2, reason="2 ranks need 2 GPUs with NCCL; hide the GPUs to test on the CPU")
def test_collective_on_some_ranks_ends_after_the_timeout_with_the_message_and_restart_repairs():
    ranks = start_ranks(2, timeout_s=3)
    try:
        pids = ranks.pids
        assert_ranks_answer_in_rank_order(ranks, 2)
        start = time.perf_counter()
        with pytest.raises(CompositeError) as failure:
            ranks.client[ranks.engine_ids[:1]].execute("dist.all_reduce(torch.ones(2, device=device))", block=True)
        waited = time.perf_counter() - start
        assert waited < 60, f"a collective on one of two ranks took {waited:.0f} s to fail (timeout 3 s)"
        lines = explain(failure.value)
        assert lines == [
            "rank 0: the collective timed out after 3 s. Another rank crashed, is stuck, or skipped this collective"
        ], lines
        ranks.restart()
        ranks.view.execute("y = torch.ones(2, device=device); dist.all_reduce(y)")
        assert [y.tolist() for y in ranks.pull("y")] == [[2.0, 2.0]] * 2, "restart() must give a working group"
        # A rank that raises: the error names that rank, and the others keep working.
        with pytest.raises(CompositeError) as failure:
            ranks.view.execute("if rank == 1: raise ValueError('no data on this rank')")
        assert explain(failure.value) == ["rank 1: ValueError: no data on this rank"]
        ranks.view.execute("z = torch.ones(1, device=device); dist.all_reduce(z)")
        assert [z.item() for z in ranks.pull("z")] == [2.0, 2.0]
    finally:
        ranks.stop()
    assert no_process_left(ranks, pids)


# What ipyparallel prints when engines it watches are stopped: each engine's log and the launcher's complaints. The
# lab's terminal stays free of it (tests/test_browser.py reads it, and checks that the lab's IPython Parallel panel,
# whose server side prints these logs, never sees the course's ranks: they live in a profile of their own).
NOISE = ("received signal 15", "Event loop stopped before Future completed", "not running", "Traceback", "Output for")

ORPHAN = """
import os, sys
sys.path.insert(0, {root!r})
from utils.course.notebook import start_ranks
ranks = start_ranks(2)
print(" ".join(str(p.pid) for p in ranks.processes), flush=True)
os._exit(0)  # like a killed kernel: no clean-up at all
"""


@pytest.mark.skipif(0 < GPUS < 2, reason="2 ranks need 2 GPUs with NCCL; hide the GPUs to test on the CPU")
def test_stop_ranks_command_cleans_up_after_a_killed_kernel():
    import subprocess
    import sys

    from tests.harness.launch import course_env

    env = course_env()
    started = subprocess.run(
        [sys.executable, "-c", ORPHAN.format(root=str(ROOT))], capture_output=True, text=True, timeout=300, env=env
    )
    pids = [int(pid) for pid in started.stdout.split()]
    assert pids and all(psutil.pid_exists(pid) for pid in pids), started.stdout + started.stderr
    stop = subprocess.run(
        [sys.executable, "-m", "utils.course.notebook", "stop-ranks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr
    printed = started.stdout + started.stderr + stop.stdout + stop.stderr
    noisy = [line for line in printed.splitlines() if any(noise in line for noise in NOISE)]
    assert not noisy, f"starting and stopping the ranks printed ipyparallel's logs: {noisy[:5]}"
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=30)
    leftover = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, f"`python -m utils.course.notebook stop-ranks` left ranks running: {leftover}"


def test_lab_ranks_use_gloo_even_with_gpus_grade_each_case_and_recover(tmp_path):
    """start_ranks(backend="gloo") hides the GPUs from the ranks (under NCCL a collective some ranks skip would
    return at once and the watchdog would kill the rank); run_lab grades a case and leaves a fresh group."""
    from utils.course.make_exercises import handed_out

    untouched = handed_out("01_collectives.py", tmp_path)  # as generated, whatever the learner did to theirs
    ranks = start_ranks(3, timeout_s=5, debug="DETAIL", backend="gloo")
    try:
        assert ranks.pull_expression("(dist.get_backend(), device.type)") == [("gloo", "cpu")] * 3
        passed, lines = ranks.run_lab("skip", str(untouched))
        assert not passed and "rank 0: count_real_tokens waited in a collective for rank 2" in lines[0], lines
        assert lines[2] == "rank 2: count_real_tokens returned 0, not 4", lines
        passed, lines = ranks.run_lab("skip", "solutions/01_collectives.py")  # the group works again
        assert passed, lines
    finally:
        ranks.stop()


@pytest.mark.skipif(0 < GPUS < 2, reason="2 ranks need 2 GPUs with NCCL; hide the GPUs to test on the CPU")
def test_ranks_that_never_answer_are_replaced_not_waited_for(monkeypatch):
    """A controller whose command queue never started (a port taken between ipyparallel's choice and its bind) left
    start_ranks() waiting forever in CI. Here an engine that never answers stands for it (stopped with SIGSTOP):
    start_ranks() gives up on those ranks within its answer timeout, kills them and starts new ones that work."""
    started = []
    start_engines = notebook.Ranks._start_engines

    def first_one_stuck(self, ipp, world_size):
        start_engines(self, ipp, world_size)
        started.append(list(self.processes))
        if len(started) == 1:  # the first set: one engine never answers
            os.kill(self.client[self.engine_ids[1]].apply_sync(os.getpid), signal.SIGSTOP)

    monkeypatch.setattr(notebook.Ranks, "_start_engines", first_one_stuck)
    monkeypatch.setattr(notebook, "ANSWER_TIMEOUT_S", 5)
    begin = time.perf_counter()
    ranks = start_ranks(2, timeout_s=5)
    try:
        assert len(started) == 2, f"started {len(started)} sets of ranks, not 2"
        assert time.perf_counter() - begin < 120
        assert ranks.pull_expression("rank") == [0, 1]
        _, alive = psutil.wait_procs([p for p in started[0] if p.is_running()], timeout=30)
        assert not [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the stuck ranks were left running"
    finally:
        ranks.stop()
