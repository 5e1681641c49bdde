"""Every slurm/*.sbatch runs, unchanged, on a Slurm cluster and ends COMPLETED; a broken job ends FAILED.

CI starts a local two-node cluster first (`bash tests/slurm_cluster/start.sh`) and sets CI=true: there a
missing cluster fails these tests. Elsewhere, without Slurm, they are skipped with the reason. On the
workshop cluster they run as they are, from the repository on the shared file system:
    source slurm/site.sh && pytest -m slurm tests/test_slurm.py
Each lesson's job runs small: 2 processes a node (NPROC_PER_NODE=2) and a few steps.
"""

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.harness.slurm_helpers import (
    ROOT,
    SlurmError,
    cancel,
    cluster_problem,
    cluster_report,
    job_record,
    read_output,
    sbatch_gpus_per_node,
    sbatch_nodes,
    submit,
    wait,
)

pytestmark = pytest.mark.slurm

SBATCH_FILES = sorted((ROOT / "slurm").glob("*.sbatch"))
SAME_BUT = re.compile(r"^#SBATCH --(job-name|nodes)=")  # the lines a one-node file and its two-node twin may differ in


def code_lines(sbatch_file: Path) -> list[str]:
    """What the job runs: the file without its comments, blank lines, job name and node count."""
    lines = (line.split(" #")[0].rstrip() for line in sbatch_file.read_text().splitlines())
    return [line for line in lines if line and not (line.startswith("#") and not line.startswith("#SBATCH"))
            and not SAME_BUT.match(line)]  # fmt: skip


def one_node_twins() -> dict[Path, Path]:
    """One-node files whose job is their two-node twin's, but for --nodes (lessons 02, 05, 08): {one: two}."""
    pairs = {f: f.with_name(f"{f.stem}_2nodes.sbatch") for f in SBATCH_FILES}
    return {one: two for one, two in pairs.items() if two.is_file() and code_lines(one) == code_lines(two)}


# A sweep runs its lesson several times and reports on the folder: tests/test_06_sweep.py runs it and checks that.
# A one-node file whose job is its two-node twin's line for line (test_one_node_twins_run_their_two_node_job) is not
# run again: the twin runs the same body on two nodes, where the rendezvous crosses the network.
LESSON_JOBS = [f for f in SBATCH_FILES if not f.stem.endswith("_sweep") and f not in one_node_twins()]
NPROC_PER_NODE = 2
STEPS = 2
# Sizes a file asks for that are costly on a CPU, made small as --steps is (the last value of an option wins): lesson
# 09's sequence of 1024 tokens cost its two steps a minute of CPU time, which the job's plumbing does not need.
SMALLER = {"09_context_parallelism.sbatch": ["--seq-len", "256", "--dim", "64"]}
IN_CI = os.environ.get("CI") == "true"
JOB_TIMEOUT_S = 240  # a lesson's job at this size takes seconds; this bounds a hang
PENDING_S = 60  # an idle two-node cluster starts a job within seconds


@pytest.fixture(scope="module")
def cluster():
    """Skip (fail in CI) unless Slurm answers and enough nodes for every sbatch file take jobs."""
    needed = max([sbatch_nodes(f) for f in SBATCH_FILES] + [1])
    problem = cluster_problem(needed, wait_s=60 if IN_CI else 10)
    if problem:
        if IN_CI:
            pytest.fail(f"CI=true, but there is no Slurm cluster: {problem}\n{cluster_report()}", pytrace=False)
        pytest.skip(f"no Slurm cluster: {problem}")


@pytest.fixture(scope="module")
def workdir(request):
    """Metrics and outputs of this module's jobs, in the repository: compute nodes see it (shared file
    system), and runs/ is ignored by git. Removed afterwards unless a test failed."""
    path = ROOT / "runs" / f"slurm-tests-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def lesson_jobs(cluster, workdir, target, request):
    """Submit the selected lessons' sbatch files at once (they run side by side); each test waits for its own.
    (`pytest tests/test_slurm.py -k 03_` submits lesson 03's files only.)"""
    selected = {
        item.callspec.params["sbatch_file"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_sbatch_file_runs_on_slurm" and hasattr(item, "callspec")
    }
    jobs = {}
    for sbatch_file in [f for f in LESSON_JOBS if f in selected]:
        metrics = workdir / f"{sbatch_file.stem}.json"
        args = [target, "--steps", STEPS, *SMALLER.get(sbatch_file.name, []), "--metrics-out", metrics]
        try:
            jobs[sbatch_file.name] = (submit(sbatch_file, args, env={"NPROC_PER_NODE": NPROC_PER_NODE}), metrics)
        except SlurmError as error:
            jobs[sbatch_file.name] = (error, metrics)
    yield jobs
    for job, _ in jobs.values():
        if not isinstance(job, SlurmError):
            cancel(job)  # only does something for a job a failed or interrupted test left behind


def keep_output(job, workdir):
    """Move a lesson job's output (and its job report's figure) from the submit directory (the repository) into
    the test's workdir."""
    if job.record.get("StdOut") and job.output_file.is_file() and job.output_file.resolve().parent == ROOT:
        for path in (job.output_file, job.output_file.with_suffix(".png")):
            if path.is_file():
                shutil.move(path, workdir / path.name)


def test_there_are_sbatch_files():
    assert SBATCH_FILES, f"no sbatch files in {ROOT / 'slurm'}"


@pytest.mark.parametrize("sbatch_file", SBATCH_FILES, ids=[f.name for f in SBATCH_FILES])
def test_sbatch_follows_the_course_idiom(sbatch_file):
    """What a participant copies into their own project: the conventions of slurm/01_collectives.sbatch."""
    text = sbatch_file.read_text()
    expected = {
        r"^set -euo pipefail": "`set -euo pipefail`, so that a failing command fails the job",
        r'^source "\$SLURM_SUBMIT_DIR/slurm/site.sh"': "site values from slurm/site.sh",
        r"^site_environment\b": "the environment from `site_environment`",
        r"^#SBATCH --gres=gpu:\d+\b": "GPUs as #SBATCH --gres=gpu:N (4 for a whole node)",
        r"^#SBATCH --time[=\s]": "a time limit (#SBATCH --time)",
        r"^#SBATCH --output[=\s]%x-%j\.out\b": "#SBATCH --output=%x-%j.out (in the submit directory)",
        r"scontrol show hostnames": "MASTER_ADDR from `scontrol show hostnames`",
        r"^\s*(watched\s+)?srun\b.*--kill-on-bad-exit(=1)?\s": "`srun --kill-on-bad-exit=1` (a failed node ends it)",
        r"^\s*(watched\s+)?srun\b.*\btorchrun\b": "`srun ... torchrun`, one torchrun a node",
        r"^\s+(\"\$SCRIPT\" )?--watch\b": "the training script run with --watch (it records how busy each device is)",
        r"^\s*(watched\s+srun\b|job_report\b)": "the job report at the end (`watched srun ...` or `job_report`)",
        r"--rdzv_backend[=\s]c10d": "torchrun --rdzv_backend=c10d",
        r'--nnodes[=\s]"?\$SLURM_NNODES': "torchrun --nnodes=$SLURM_NNODES",
        r"NPROC_PER_NODE=\"\$\{NPROC_PER_NODE:-": "NPROC_PER_NODE overridable (for a CPU test)",
    }
    missing = [what for pattern, what in expected.items() if not re.search(pattern, text, re.M)]
    hard_coded = re.findall(r"^#SBATCH\s+(--account|-A|--partition|-p|--reservation)\b", text, re.M)
    assert not missing, f"{sbatch_file.name} lacks: " + "; ".join(missing)
    assert not hard_coded, f"{sbatch_file.name} hard-codes {hard_coded}: site values belong in slurm/site.sh"


def test_one_node_twins_run_their_two_node_job():
    """A two-node file that says it differs from the one-node file only in --nodes=2 (and the job name) does: the
    one-node job is then the two-node job's body, which test_sbatch_file_runs_on_slurm runs."""
    said = re.compile(r"differs from \S+\.sbatch only in --nodes=2 \(and the job name\)")
    claimed = {f for f in SBATCH_FILES if said.search(" ".join(f.read_text().replace("#", " ").split()))}
    twins = one_node_twins()
    assert {two for two in twins.values()} == claimed, (
        f"two-node files that say they differ only in --nodes: {sorted(f.name for f in claimed)}; "
        f"those that do: {sorted(two.name for two in twins.values())}"
    )
    assert len(twins) >= 2 and all(two in LESSON_JOBS and one not in LESSON_JOBS for one, two in twins.items())


@pytest.mark.parametrize("sbatch_file", LESSON_JOBS, ids=[f.name for f in LESSON_JOBS])
def test_sbatch_file_runs_on_slurm(sbatch_file, lesson_jobs, workdir):
    job, metrics_path = lesson_jobs[sbatch_file.name]
    if isinstance(job, SlurmError):
        raise job
    nodes = sbatch_nodes(sbatch_file)
    # NPROC_PER_NODE shrinks a job to 2 processes a node; a job that asks for fewer GPUs runs fewer.
    per_node = min(NPROC_PER_NODE, sbatch_gpus_per_node(sbatch_file) or NPROC_PER_NODE)
    try:
        wait(job, timeout_s=JOB_TIMEOUT_S, pending_s=PENDING_S)
        output = read_output(job)
        story = job.describe()
        assert job.state == "COMPLETED" and job.exit_code == 0, f"expected COMPLETED with exit code 0. {story}"
        assert job.output_file.resolve().parent == ROOT, f"the output should be in the submit directory {ROOT}. {story}"
        assert any(line.startswith("FINISHED") for line in output.splitlines()), f"no FINISHED line. {story}"
        assert metrics_path.is_file(), f"no metrics file {metrics_path}. {story}"
        metrics = json.loads(metrics_path.read_text())
        hostnames = job.hostnames()
        assert len(hostnames) == nodes, f"asked for {nodes} nodes, got {hostnames}. {story}"
        ranks = {key: metrics.get(key) for key in ("world_size", "hosts")}
        assert metrics["world_size"] == nodes * per_node, f"expected {nodes} x {per_node} ranks, got {ranks}. {story}"
        # Ranks on every node of the job took part: per_node of them on each node, none elsewhere.
        assert sorted(metrics["hosts"]) == sorted(hostnames * per_node), (
            f"expected {per_node} ranks on each of {hostnames}, got hosts {metrics['hosts']}. {story}"
        )
        check_job_report(job, output, nodes * per_node, hostnames, story)
    finally:
        keep_output(job, workdir)


def check_job_report(job, output: str, ranks: int, hostnames: list[str], story: str):
    """The job report ends the output: every rank and node counted, each node's devices named, the figure beside
    the .out file, and Slurm's own view of the job after it."""
    report = output[output.rfind("=== job report") :] if "=== job report" in output else ""
    assert report, f"no job report at the end of the output. {story}"
    counted = f"{ranks} rank{'s' * (ranks > 1)} on {len(hostnames)} node{'s' * (len(hostnames) > 1)}"
    assert f"job report: {counted}, " in report, f"{report}\n{story}"
    for host in hostnames:
        assert re.search(rf"^node {re.escape(host)}: \d+ (core|GPU)s? allocated, \d+ busy", report, re.M), (
            f"no line for node {host} with its devices in the job report:\n{report}\n{story}"
        )
    assert "=== Slurm's view of job" in report, f"no Slurm view after the job report:\n{report}\n{story}"
    png = job.output_file.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG", f"no figure {png} beside the output. {story}"


def write_job(path: Path, body: str, options=(), output="%x-%j.out") -> Path:
    """A throwaway sbatch file: one small task, its output next to it."""
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name=course-{path.stem}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --time=00:02:00",
        f"#SBATCH --output={path.parent / output}",
        *(f"#SBATCH {option}" for option in options),
    ]
    path.write_text("\n".join(header) + "\n" + body)
    return path


BROKEN_JOBS = {
    # name: (script body, expected state, expected exit code); "not-reached" must never be printed
    "exit-3": ("set -euo pipefail\necho started\nexit 3\necho not-reached\n", "FAILED", 3),
    "failing-step-with-set-e": ("set -euo pipefail\nsrun false\necho not-reached\n", "FAILED", 1),
    # Without `set -e` the script goes on after the failed step and Slurm reports success: this is why
    # every sbatch file of the course starts with `set -euo pipefail`.
    "failing-step-without-set-e": ("srun false\necho reached\n", "COMPLETED", 0),
}


@pytest.mark.parametrize("name", BROKEN_JOBS)
def test_broken_job_is_reported(name, cluster, workdir):
    body, expected_state, expected_exit_code = BROKEN_JOBS[name]
    job = wait(submit(write_job(workdir / f"{name}.sbatch", body), cwd=workdir), timeout_s=60, pending_s=PENDING_S)
    output = read_output(job)
    story = job.describe()
    assert (job.state, job.exit_code) == (expected_state, expected_exit_code), (
        f"expected {expected_state} with exit code {expected_exit_code}. {story}"
    )
    assert "not-reached" not in output, f"the script went on after the failure. {story}"


def test_lesson_sbatch_with_a_wrong_argument_fails_loudly(cluster, workdir):
    """A typo in the first argument (exercises|solutions) must end the job FAILED, naming the problem."""
    sbatch_file = next((f for f in SBATCH_FILES if sbatch_nodes(f) == 1), None)
    if sbatch_file is None:
        pytest.skip("no single-node sbatch file")
    job = submit(sbatch_file, ["no_such_directory", "--steps", 1], env={"NPROC_PER_NODE": NPROC_PER_NODE})
    try:
        wait(job, timeout_s=JOB_TIMEOUT_S, pending_s=PENDING_S)
        output = read_output(job)
        story = job.describe()
        assert job.state == "FAILED" and job.exit_code != 0, f"expected FAILED with a non-zero exit code. {story}"
        assert "no_such_directory" in output, f"the output does not name the missing directory. {story}"
    finally:
        keep_output(job, workdir)


def test_stuck_job_fails_fast_and_is_cancelled(cluster, workdir):
    """A job that never starts (here: held) fails the wait within its bound, says why, and is cancelled."""
    job = submit(write_job(workdir / "held.sbatch", "echo never\n"), options=["--hold"], cwd=workdir)
    started = time.monotonic()
    with pytest.raises(SlurmError) as failure:
        wait(job, timeout_s=60, pending_s=3)
    message = str(failure.value)
    assert time.monotonic() - started < 30
    assert "still PENDING" in message and "JobHeldUser" in message, message
    assert "--- squeue" in message and "--- sinfo" in message, message
    for _ in range(40):  # scancel is asynchronous
        if (job_record(job.job_id) or {}).get("JobState") == "CANCELLED":
            break
        time.sleep(0.25)
    assert (job_record(job.job_id) or {}).get("JobState") in ("CANCELLED", None), cluster_report(job.job_id)


def test_missing_output_file_is_reported(cluster, workdir):
    """A job whose output cannot be written fails, and the test says so instead of waiting for the file."""
    body = "echo lost\n"
    job = submit(write_job(workdir / "lost.sbatch", body, output="/nonexistent/dir/%j.out"), cwd=workdir)
    wait(job, timeout_s=60, pending_s=PENDING_S)
    assert job.state != "COMPLETED", job.describe()
    with pytest.raises(SlurmError, match="does not exist"):
        read_output(job, wait_s=1)


def test_jupyterlab_on_a_compute_node_prints_the_tunnel_and_serves(cluster, workdir):
    """slurm/jupyterlab.sh (for sites without a Jupyter service): the job prints the ssh tunnel command, then
    JupyterLab's address with its token, which opens the README, and serves the course root as `make lab` does
    (tests/test_browser.py checks that front door in a browser); the test cancels the job once it has checked."""
    import urllib.request

    job = submit(ROOT / "slurm" / "jupyterlab.sh", options=["--time=00:03:00"])  # from the course root, as a learner
    printed = re.compile(r"http://127\.0\.0\.1:\d+/lab/tree/README\.md\?token=\w+")  # the tunnel's end
    try:
        deadline, output = time.monotonic() + 120, ""
        while time.monotonic() < deadline and not printed.search(output):
            time.sleep(1)
            job.record = job_record(job.job_id) or job.record
            output = job.output_file.read_text() if job.record.get("StdOut") and job.output_file.is_file() else ""
        story = job.describe()
        assert "ssh -N -L" in output, f"no tunnel command in the job's output. {story}"
        address = printed.search(output)
        assert address, f"JupyterLab printed no address of the README within 120 s. {story}"
        assert f"Serving notebooks from local directory: {ROOT}\n" in output, f"not the course root. {story}"
        readme = address.group(0).replace("/lab/tree/README.md?", "/api/contents/README.md?content=0&")
        with urllib.request.urlopen(readme, timeout=30) as answer:  # the nodes are this machine: no tunnel needed
            assert json.load(answer)["path"] == "README.md", f"{readme} is not the course's README. {story}"
    finally:
        cancel(job)
        keep_output(job, workdir)
