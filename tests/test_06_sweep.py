"""slurm/06_scaling_sweep.sbatch on a Slurm cluster: every point of the sweep leaves its metrics file in one folder,
with the world size and the nodes it says, and the job's report renders that folder (table and figure).

Like tests/test_slurm.py: skipped without a cluster (failed in CI, where `bash tests/slurm_cluster/start.sh` starts
the local two-node one), at CPU size (NPROC_PER_NODE=2: 1 and 2 processes on one node, then 2 x 2 on both).
tests/test_slurm.py checks its idiom as it checks every sbatch file's; this test is the one that runs it.
"""

import json
import os
import shutil
import time
import uuid

import pytest

from tests.harness.slurm_helpers import ROOT, cancel, cluster_problem, cluster_report, read_output, submit, wait
from utils.report import read_runs, scaling_rows

pytestmark = pytest.mark.slurm

SWEEP = ROOT / "slurm" / "06_scaling_sweep.sbatch"
NPROC_PER_NODE = 2
GLOBAL_BATCH = 16  # 16, 8 and 4 sequences per replica: 4 micro-batches each (the sbatch file asks for 4)


@pytest.fixture(scope="module")
def cluster():
    problem = cluster_problem(2, wait_s=60 if os.environ.get("CI") == "true" else 10)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, but there is no Slurm cluster: {problem}\n{cluster_report()}", pytrace=False)
        pytest.skip(f"no Slurm cluster: {problem}")


def test_the_sweep_fills_one_folder_and_reports_it(cluster, target, request):
    runs_dir = ROOT / "runs" / f"sweep-test-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    env = {"NPROC_PER_NODE": NPROC_PER_NODE, "GLOBAL_BATCH": GLOBAL_BATCH, "RUNS_DIR": runs_dir}
    job = submit(SWEEP, [target, "--steps", 2, "--n-layers", 2, "--n-heads", 2], env=env)
    failed_before = request.session.testsfailed
    try:
        wait(job, timeout_s=300, pending_s=60)
        output, story = read_output(job), job.describe()
        assert job.state == "COMPLETED" and job.exit_code == 0, f"expected COMPLETED with exit code 0. {story}"
        files = sorted(path.name for path in runs_dir.glob("gpus_*.json"))
        assert files == ["gpus_1.json", "gpus_2.json", "gpus_4.json"], f"{files}. {story}"
        hosts = job.hostnames()
        for path in runs_dir.glob("gpus_*.json"):
            metrics = json.loads(path.read_text())
            gpus = int(path.stem.split("_")[1])
            assert metrics["world_size"] == gpus and metrics["global_batch"] == GLOBAL_BATCH, (path.name, metrics)
            expected_nodes = 1 if gpus <= NPROC_PER_NODE else len(hosts)
            assert len(set(metrics["hosts"])) == expected_nodes, (path.name, metrics["hosts"], hosts)
        rows = scaling_rows(read_runs(runs_dir))
        assert [row["gpus"] for row in rows] == [1, 2, 4] and rows[-1]["nodes"] == len(hosts) == 2
        assert "efficiency" in output and f"figure: {runs_dir / 'scaling.png'}" in output, story
        # The test cluster's ranks are processes on CPUs (each metrics file says "cpu"): the report counts processes.
        assert all(json.loads(path.read_text())["device"] == "cpu" for path in runs_dir.glob("gpus_*.json"))
        header = next(line for line in output.splitlines() if line.rstrip().endswith("efficiency"))
        assert "processes" in header and "GPUs" not in header, f"{header}. {story}"
        assert (runs_dir / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        cancel(job)  # only does something for a job this test left running
        if request.session.testsfailed == failed_before:  # else keep the job's output and its folder to look at
            shutil.rmtree(runs_dir, ignore_errors=True)
            if job.record.get("StdOut") and job.output_file.is_file() and job.output_file.resolve().parent == ROOT:
                job.output_file.unlink()
