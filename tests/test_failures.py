"""Bad situations end a job with a message that names the cause, never a hang.

The launcher's timeout (tests/harness/launch.py) turns a hang into a failed test, so each test here
proves the job ended by itself well within that bound.
"""

from tests.harness.launch import ROOT, course_env, srun_tasks, torchrun

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
    ranks = srun_tasks(WORKER, 3, ["crash"], env=course_env(COURSE_TIMEOUT_S=5), timeout=60)
    assert [rank.returncode for rank in ranks] == [2, 13, 2], [rank.output for rank in ranks]
    for rank in (0, 2):
        assert f"[rank {rank}] ERROR: the collective at failure_check.py:" in ranks[rank].output, ranks[rank].output
        assert "Another rank crashed, is stuck, or skipped this collective" in ranks[rank].output, ranks[rank].output


def test_a_refusal_is_printed_once_by_rank_0_under_srun_as_under_torchrun():
    """srun sets SLURM_PROCID, not RANK: the launcher's rank decides who speaks before a group exists."""
    ranks = srun_tasks(WORKER, 3, ["refuse"], timeout=60)
    assert [rank.returncode for rank in ranks] == [2, 2, 2], [rank.output for rank in ranks]
    said = [rank.output.count("ERROR: --experts 4 cannot be shared by 3 ranks") for rank in ranks]
    assert said == [1, 0, 0], [rank.output for rank in ranks]
    assert "[rank 0] ERROR:" in ranks[0].output, ranks[0].output
