"""Bad situations end a job with a message that names the cause, never a hang.

The launcher's timeout (tests/harness/launch.py) turns a hang into a failed test, so each test here
proves the job ended by itself well within that bound.
"""

import subprocess
import sys

from tests.harness.launch import ROOT, course_env, torchrun
from utils.distributed_utils import free_port

WORKER = ROOT / "tests" / "workers" / "failure_check.py"


def test_a_rank_that_skips_a_collective_ends_the_job_with_a_message():
    run = torchrun(WORKER, 3, ["skip"], env=course_env(COURSE_TIMEOUT_S=5), timeout=60)
    assert run.returncode != 0
    # The ranks left waiting say what happened and where, in one line each, once the group's timeout is up.
    assert "ERROR: the collective at failure_check.py:" in run.output, run.tail()
    assert "Another rank crashed, is stuck, or skipped this collective" in run.output, run.tail()
    assert "Timed out" in run.output, run.tail()


def test_a_rank_that_crashes_ends_the_job_and_torchrun_names_it():
    # torchrun stops the other ranks as soon as it sees one fail: they may be stopped before they print their
    # own line (a race with their connection-reset error), so what is sure is torchrun's report of the crash.
    run = torchrun(WORKER, 3, ["crash"], env=course_env(COURSE_TIMEOUT_S=5), timeout=60, cold=True)
    assert run.returncode != 0
    assert "exitcode: 13" in run.output and "local_rank: 1" in run.output, run.tail()


def test_the_ranks_a_crash_leaves_waiting_say_so_in_one_line_each():
    """Each rank its own process, as srun starts them when it does not stop the job at the first exit: nothing
    stops the survivors, so each must end by itself, with the line that names the collective and the cause."""
    env = course_env(COURSE_TIMEOUT_S=5, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=3)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "crash"],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(3)
    ]
    outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 13, 2], outputs
    for rank in (0, 2):
        assert f"[rank {rank}] ERROR: the collective at failure_check.py:" in outputs[rank], outputs[rank]
        assert "Another rank crashed, is stuck, or skipped this collective" in outputs[rank], outputs[rank]
