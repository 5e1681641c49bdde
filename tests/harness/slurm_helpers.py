"""Submit sbatch files to a Slurm cluster from a test, wait for them with a bound, and explain failures.

Works on the local two-node cluster of tests/slurm_cluster/ (what CI runs) and on a real cluster.
Every call to a Slurm command has a timeout, every wait has a deadline, and every failure message
carries the job's record, the queue, the nodes and the tails of the daemons' logs.
"""

import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where tests/slurm_cluster/start.sh keeps the local cluster's state and logs.
LOCAL_CLUSTER_DIR = Path(os.environ.get("COURSE_SLURM_DIR", "/tmp/course-slurm"))
COMMAND_TIMEOUT_S = 20  # a Slurm command that takes longer means slurmctld is not answering
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
}  # fmt: skip
# sinfo's short node states that take jobs; plnd: idle, but held by the backfill scheduler for a waiting job
UP_STATES = {"idle", "mix", "alloc", "comp", "plnd"}


class SlurmError(AssertionError):
    """A job or the cluster did not do what the test expected; the message says what Slurm says."""


def slurm(*args: str, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm command; never hangs, never raises for a non-zero exit (the caller decides)."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"`{' '.join(args)}` did not answer in {timeout:.0f} s")
    except OSError as error:
        return subprocess.CompletedProcess(args, 127, "", str(error))


def _out(*args: str) -> str:
    done = slurm(*args)
    return (done.stdout + done.stderr).strip()


def tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error.strerror}: {path})"


def _log_files() -> list[Path]:
    """slurmctld's and each slurmd's log: the local cluster's, else what the configuration names."""
    local = sorted((LOCAL_CLUSTER_DIR / "log").glob("slurm*.log"))
    if local:
        return local
    config = dict(re.findall(r"^(\w+)\s*=\s*(\S+)", _out("scontrol", "show", "config"), re.M))
    files = [config.get("SlurmctldLogFile")]
    slurmd_log = config.get("SlurmdLogFile")
    if slurmd_log and "%n" in slurmd_log:
        nodes = _out("sinfo", "-h", "-N", "-o", "%N").split()
        files += [slurmd_log.replace("%n", node) for node in sorted(set(nodes))[:4]]
    else:
        files.append(slurmd_log)
    return [Path(f) for f in files if f and f != "(null)"]


def cluster_report(job_id: str | None = None, log_lines: int = 25) -> str:
    """What Slurm says about a job, the queue and the nodes, and the tails of the daemons' logs."""
    parts = []
    if job_id:
        parts.append(f"--- scontrol show job {job_id}\n{_out('scontrol', 'show', 'job', job_id)}")
    parts.append(f"--- squeue\n{_out('squeue', '-o', '%.8i %.9P %.24j %.8T %.10M %.6D %R')}")
    parts.append(f"--- sinfo -N\n{_out('sinfo', '-N', '-o', '%N %P %T %C %G %E')}")
    for log in _log_files():
        parts.append(f"--- tail {log}\n{tail(log, log_lines)}")
    return "\n".join(parts)


def cluster_problem(nodes_needed: int = 1, wait_s: float = 60) -> str | None:
    """None when `sbatch` is here and `nodes_needed` nodes take jobs (waiting up to `wait_s`);
    else one line saying why not."""
    if shutil.which("sbatch") is None:
        return "`sbatch` is not on PATH (start one with `sudo bash tests/slurm_cluster/start.sh`)"
    deadline = time.monotonic() + wait_s
    while True:
        done = slurm("sinfo", "-h", "-N", "-o", "%N %t")
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            problem = f"the cluster does not answer: {said[-1] if said else f'sinfo exited {done.returncode}'}"
        else:
            states = dict(line.split()[:2] for line in done.stdout.splitlines() if len(line.split()) >= 2)
            up = [node for node, state in states.items() if state.rstrip("*~#!%$@^-") in UP_STATES]
            if len(up) >= nodes_needed:
                return None
            problem = f"{len(up)} of the {nodes_needed} nodes needed take jobs (sinfo: {states})"
        if time.monotonic() >= deadline:
            return problem
        time.sleep(1)


def sbatch_nodes(path: Path) -> int:
    """The node count an sbatch file asks for (#SBATCH --nodes=N or -N N), 1 if it does not say."""
    for line in Path(path).read_text().splitlines():
        found = re.match(r"#SBATCH\s+(?:--nodes[=\s]|-N\s*)(\d+)", line.strip())
        if found:
            return int(found.group(1))
    return 1


def sbatch_gpus_per_node(path: Path) -> int | None:
    """The GPUs a node an sbatch file asks for (#SBATCH --gres=gpu[:type]:N or --gpus-per-node=N)."""
    for line in Path(path).read_text().splitlines():
        found = re.match(
            r"#SBATCH\s+(?:--gres[=\s]gpu(?::[\w.-]+)?:|--gpus-per-node[=\s](?:[\w.-]+:)?)(\d+)", line.strip()
        )
        if found:
            return int(found.group(1))
    return None


@dataclass
class Job:
    job_id: str
    command: str  # how it was submitted, for messages
    record: dict  # the last `scontrol show job` fields seen

    @property
    def state(self) -> str:
        return self.record.get("JobState", "UNKNOWN")

    @property
    def exit_code(self) -> int:
        """The batch script's exit status (ExitCode=status:signal), or 128+signal if it was killed."""
        status, _, signal = self.record.get("ExitCode", "0:0").partition(":")
        return int(status) if int(signal or 0) == 0 else 128 + int(signal)

    @property
    def output_file(self) -> Path:
        return Path(self.record.get("StdOut", ""))

    def output_tail(self, lines: int = 40) -> str:
        return tail(self.output_file, lines) if self.record.get("StdOut") else "(no output file known)"

    def error_lines(self, tail_lines: int, most: int = 15) -> str:
        """Lines that look like errors above the tail (torchrun's summary can push the cause out of it)."""
        try:
            lines = self.output_file.read_text(errors="replace").splitlines()[:-tail_lines]
        except OSError:
            return ""
        errors = [line for line in lines if re.search(r"\bERROR\b|\w(Error|Exception)\b|error:", line)]
        return "\n".join(errors[:most])

    def describe(self, tail_lines: int = 40) -> str:
        """The whole story of this job for a failure message."""
        errors = self.error_lines(tail_lines) if self.record.get("StdOut") else ""
        return (
            f"job {self.job_id} ({self.command}): state {self.state}, exit code "
            f"{self.record.get('ExitCode', '?')}, reason {self.record.get('Reason', '?')}\n"
            + (f"--- error lines of {self.output_file}\n{errors}\n" if errors else "")
            + f"--- last lines of {self.output_file}\n{self.output_tail(tail_lines)}\n{cluster_report(self.job_id)}"
        )

    def hostnames(self) -> list[str]:
        """The job's nodes, one name each (`scontrol show hostnames` of its NodeList)."""
        return _out("scontrol", "show", "hostnames", self.record.get("NodeList", "")).split()


def job_record(job_id: str) -> dict | None:
    """The job's fields from `scontrol show job`: {} once Slurm has forgotten the job, None if no answer."""
    done = slurm("scontrol", "show", "job", "-o", job_id)
    if "JobId=" in done.stdout:
        return dict(re.findall(r"(\w[\w/:.]*)=(\S*)", done.stdout))
    return {} if "Invalid job id" in done.stderr else None


def _accounting_record(job_id: str) -> dict:
    """State and exit code from sacct where accounting is configured ({} where it is not)."""
    done = slurm("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode")
    line = done.stdout.strip().splitlines()[:1] if done.returncode == 0 else []
    if not line or "|" not in line[0]:
        return {}
    state, exit_code = line[0].split("|")[:2]
    return {"JobId": job_id, "JobState": state.split()[0], "ExitCode": exit_code}


def submit(sbatch_file, args=(), *, env: dict | None = None, options=(), cwd=ROOT) -> Job:
    """`source slurm/site.sh && sbatch [options] sbatch_file args...` from `cwd`, as a learner does.

    `env` adds variables to the job's environment (sbatch --export=ALL,NAME=value,...).
    """
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in (env or {}).items())])
    sbatch = ["sbatch", "--parsable", f"--export={export}", *options, str(sbatch_file), *map(str, args)]
    command = f"source {shlex.quote(str(ROOT / 'slurm' / 'site.sh'))} && {shlex.join(sbatch)}"
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as error:
        raise SlurmError(f"`{command}` did not answer in {COMMAND_TIMEOUT_S} s\n{cluster_report()}") from error
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job_id.isdigit():
        raise SlurmError(f"`{command}` was refused (exit {done.returncode}): {done.stderr.strip()}\n{cluster_report()}")
    return Job(job_id, shlex.join(sbatch), job_record(job_id) or {"JobId": job_id, "JobState": "PENDING"})


def cancel(job: Job) -> None:
    slurm("scancel", job.job_id)


def wait(job: Job, *, timeout_s: float = 180, pending_s: float = 60, poll_s: float = 0.5) -> Job:
    """Wait until the job ends; it may pend at most `pending_s` and take at most `timeout_s` in all.

    On either deadline the job is cancelled and SlurmError says where it was stuck and why.
    """
    start = time.monotonic()
    while True:
        record = job_record(job.job_id)
        if record == {}:  # gone from slurmctld's memory: ask the accounting database, if any
            record = _accounting_record(job.job_id)
            if not record:
                raise SlurmError(f"Slurm has no record of the job any more. {job.describe()}")
        if record:  # None: slurmctld did not answer this time; the deadlines below still hold
            job.record = record
        if job.state in FINAL_STATES:
            return job
        state = job.state
        elapsed = time.monotonic() - start
        stuck = None
        if state == "PENDING" and elapsed > pending_s:
            stuck = f"still PENDING after {pending_s:.0f} s"
        elif elapsed > timeout_s:
            stuck = f"still {state} after {timeout_s:.0f} s"
        if stuck:
            message = f"{stuck}; cancelled it. {job.describe()}"
            cancel(job)
            raise SlurmError(message)
        time.sleep(poll_s)


def read_output(job: Job, wait_s: float = 10) -> str:
    """The job's output file (it can appear late on a shared file system); SlurmError if it never does."""
    deadline = time.monotonic() + wait_s
    while not job.output_file.is_file():
        if time.monotonic() > deadline or not job.record.get("StdOut"):
            raise SlurmError(f"the job's output file {job.output_file} does not exist. {job.describe()}")
        time.sleep(0.5)
    return job.output_file.read_text(errors="replace")
