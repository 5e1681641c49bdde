"""python -m utils.stacks on a real hung job (tests/workers/stuck_rank.py), its error lines, and what
TORCH_DISTRIBUTED_DEBUG=DETAIL says on gloo when the ranks' collectives differ in shape (the same job: one launch)."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.launch import course_env
from tests.harness.slurm_helpers import FINAL_STATES, cancel, cluster_problem, job_record, submit
from utils import stacks
from utils.course.notebook import kill_tree

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "stuck_rank.py"
START_S = 120  # two ranks import torch in about 5 s on a quiet 2-core machine, over 20 s under load


def line_of(text: str) -> str:
    """'tests/workers/stuck_rank.py:N' for the worker's line that holds `text`."""
    number = next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if text in line)
    return f"tests/workers/stuck_rank.py:{number}"


def stacks_cli(*args, **run_options) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "utils.stacks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, **run_options)  # fmt: skip


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """A 2-rank torchrun job under TORCH_DISTRIBUTED_DEBUG=DETAIL that hangs (its collective timeout is far away):
    (torchrun's pid, what the ranks printed). Always killed."""
    log = tmp_path_factory.mktemp("stuck") / "output.txt"
    with log.open("w") as out:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=course_env(COURSE_TIMEOUT_S=300, TORCH_DISTRIBUTED_DEBUG="DETAIL"),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + START_S
        while log.read_text().count("waiting") < 2:
            assert job.poll() is None, f"the job ended before hanging:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the ranks did not start within {START_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        yield job.pid, log.read_text()
    finally:
        kill_tree(job.pid)


def settled_stacks(pid: int) -> str:
    """The tool's output once both ranks are inside their collective ("waiting" is printed just before)."""
    for _ in range(10):
        done = stacks_cli("--pid", str(pid))
        assert done.returncode == 0, done.stderr
        if "all_reduce at" in done.stdout and "recv at" in done.stdout:
            return done.stdout
        time.sleep(1)
    raise AssertionError(f"the ranks never showed their collectives:\n{done.stdout}")


def test_each_rank_shows_where_it_waits(hung_job):
    output = settled_stacks(hung_job[0])
    rank0, rank1 = output.split("--- rank 0 of 2")[1].split("--- rank 1 of 2")
    assert "all_reduce (torch/distributed/distributed_c10d.py" in rank0
    assert f"> average_gradients ({line_of('dist.all_reduce(grad)')})" in rank0
    assert f"> wait_for_token ({line_of('dist.recv(')})" in rank1
    summary = output.split("summary: ")[1]
    assert f"rank 0 waits in all_reduce at {line_of('dist.all_reduce(grad)')} (average_gradients)" in summary
    assert f"rank 1 in recv at {line_of('dist.recv(')} (wait_for_token)" in summary


def test_without_arguments_every_torchrun_job_on_the_node(hung_job):
    done = stacks_cli()
    assert done.returncode == 0, done.stderr
    assert f"===== torchrun {hung_job[0]}: " in done.stdout  # among other jobs this machine may be running


def record(rank: int, function: str, called: str, line: int, world_size: int = 4) -> dict:
    frames = [
        {"name": called, "filename": str(ROOT / ".venv/lib/torch/distributed/distributed_c10d.py"),
         "short_filename": "torch/distributed/distributed_c10d.py", "line": 1},
        {"name": "wrapper", "filename": str(ROOT / ".venv/lib/torch/distributed/c10d_logger.py"),
         "short_filename": "torch/distributed/c10d_logger.py", "line": 2},
        {"name": function, "filename": str(ROOT / "solutions/02_data_parallel.py"),
         "short_filename": "02_data_parallel.py", "line": line},
    ]  # fmt: skip
    return {"rank": rank, "world_size": world_size, "cwd": "/", "threads": [{"thread_name": "MainThread",
            "frames": frames}]}  # fmt: skip


def test_summary_names_the_odd_rank_first():
    records = [record(r, "train_step", "all_reduce", 120) for r in (0, 2, 3)] + [record(1, "load", "broadcast", 80)]
    assert stacks.summary(records) == (
        "rank 1 waits in broadcast at solutions/02_data_parallel.py:80 (load); "
        "ranks 0, 2, 3 in all_reduce at solutions/02_data_parallel.py:120 (train_step)"
    )
    alike = stacks.summary(records[:3]).splitlines()
    assert alike[0] == "all 3 ranks found wait in all_reduce at solutions/02_data_parallel.py:120 (train_step)"
    assert alike[1].startswith("rank 1 of 4 not found (on another node: pass the Slurm job id")


def test_a_slurm_job_is_dumped_on_each_of_its_nodes():
    command = stacks.srun_command("4242", 2)
    assert command[:4] == ["srun", "--jobid=4242", "--overlap", "--nodes=2"]
    assert "--ntasks-per-node=1" in command and command[-4:] == ["-m", "utils.stacks", "--local", "4242"]


# One torchrun a node, as the course's two-node sbatch files start them; the job's time limit bounds a stray hang.
TWO_NODE_JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --time=5
export COURSE_TIMEOUT_S=300 OMP_NUM_THREADS=1 TORCH_DISTRIBUTED_DEBUG=DETAIL
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun {python} -m torch.distributed.run --nnodes=2 --nproc_per_node=1 --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d \
    --rdzv_endpoint="$MASTER_ADDR:$(( 20000 + SLURM_JOB_ID % 20000 ))" {worker}
"""


@pytest.mark.slurm
def test_a_hung_two_node_slurm_job(tmp_path):
    problem = cluster_problem(nodes_needed=2, wait_s=10)
    if problem:
        pytest.skip(f"no Slurm cluster: {problem}")
    script = tmp_path / "stuck.sbatch"
    script.write_text(TWO_NODE_JOB.format(python=sys.executable, worker=WORKER))
    output = tmp_path / "job.out"
    job = submit(script, options=[f"--output={output}"])
    try:
        deadline = time.monotonic() + START_S
        while not output.exists() or output.read_text().count("waiting") < 2:
            assert time.monotonic() < deadline, f"the ranks did not start within {START_S} s\n{job.describe()}"
            job.record = job_record(job.job_id) or job.record
            assert job.state not in FINAL_STATES, f"the job ended before hanging\n{job.describe()}"
            time.sleep(1)
        for _ in range(10):  # until both ranks are inside their collectives
            done = stacks_cli(job.job_id)
            if "all_reduce at" in done.stdout and "recv at" in done.stdout:
                break
            time.sleep(1)
        assert done.returncode == 0, done.stderr
        assert {"--- rank 0 of 2", "--- rank 1 of 2"} <= set(re.findall(r"--- rank \d of 2", done.stdout))
        assert f"rank 1 in recv at {line_of('dist.recv(')} (wait_for_token)" in done.stdout
    finally:
        cancel(job)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1 and not done.stdout, (done.returncode, done.stdout)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_no_torchrun_job():
    assert "no torchrun process 1 on this node" in one_line(stacks_cli("--pid", "1"))


def test_a_job_id_not_in_the_queue():
    if not shutil.which("squeue"):
        pytest.skip("no Slurm here")
    assert "Slurm job 99999999 is not in the queue" in one_line(stacks_cli("99999999"))


def test_py_spy_missing(hung_job, monkeypatch, capsys):
    monkeypatch.setattr(sys, "executable", "/nowhere/bin/python")
    monkeypatch.setenv("PATH", "/nowhere")
    with pytest.raises(SystemExit) as stopped:
        stacks.main(["--pid", str(hung_job[0])])
    assert stopped.value.code == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith("utils.stacks: py-spy not found") and "pip install py-spy==" in said


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to act as another user")
def test_permission_denied(hung_job):
    """Another user may not read the job's processes: say who may, and what a container or the kernel needs."""
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # nobody may not write the course's __pycache__
    done = subprocess.run([*nobody, sys.executable, "-m", "utils.stacks", "--pid", str(hung_job[0])], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    said = one_line(done)
    assert "permission denied reading process" in said
    assert "SYS_PTRACE" in said and "kernel.yama.ptrace_scope" in said


def test_detail_debug_names_a_shape_mismatch_on_gloo(hung_job):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL compares each collective's fingerprint across ranks before running it: the
    worker's first all-reduce (4 elements on rank 0, 5 on rank 1) fails on both ranks, saying how they differ."""
    printed = hung_job[1]
    for rank, mine, theirs in ((0, 4, 5), (1, 5, 4)):
        said = [line for line in printed.splitlines() if line.startswith(f"rank {rank} mismatch: ")]
        assert len(said) == 1, f"rank {rank} said no mismatch in:\n{printed}"
        said = said[0]
        assert "Detected mismatch between collectives on ranks" in said
        assert f"OpType=ALLREDUCE, TensorShape=[{mine}]" in said and f"TensorShape=[{theirs}]" in said
        assert f"Tensor shapes: {mine}vs {theirs}" in said
