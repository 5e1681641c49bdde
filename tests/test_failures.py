"""Bad situations end a job with a message that names the cause, never a hang.

The launcher's timeout (tests/harness/launch.py) turns a hang into a failed test, so each test here
proves the job ended by itself well within that bound.
"""

import pytest

from tests.harness.launch import ROOT, course_env, torchrun

WORKER = ROOT / "tests" / "workers" / "failure_check.py"


@pytest.mark.parametrize("mode", ["crash", "skip"])
def test_a_rank_that_crashes_or_skips_a_collective_ends_the_job_with_a_message(mode):
    run = torchrun(WORKER, 3, [mode], env=course_env(COURSE_TIMEOUT_S=5), timeout=60)
    assert run.returncode != 0
    # The ranks left waiting say what happened and where, in one line each.
    assert "ERROR: the collective at failure_check.py:" in run.output, run.tail()
    assert "Another rank crashed, is stuck, or skipped this collective" in run.output, run.tail()
    if mode == "skip":
        assert "Timed out" in run.output, run.tail()
