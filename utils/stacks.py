"""Every rank's Python stack of a hung job, rank by rank, and which ranks wait somewhere else.

    python -m utils.stacks             # every torchrun job on this node
    python -m utils.stacks 123456      # Slurm job 123456: its ranks on every node (through srun)
    python -m utils.stacks --pid 4242  # only the torchrun job whose torchrun process is 4242

A hung job is usually all ranks but one waiting in the same collective, and that one somewhere else: in another
collective, in a collective with other arguments, or still computing. Each rank's stack comes from `py-spy dump`
(pip install py-spy); the summary at the end names, for each group of ranks, the innermost frame of the course's
own code (file:line and function) and the torch function it called, the smallest groups first.

py-spy reads another process's memory (ptrace): run this as the job's user or root. In a container that needs
`--cap-add SYS_PTRACE`; where `kernel.yama.ptrace_scope` is 1 (Ubuntu's default) only a parent may trace, so srun's
steps and a second shell need it at 0, or root.

Other tools (what torch does on gloo: read in 2.13.0's source, run on 2 gloo ranks with 2.13.0 and 2.11.0, alike):
- TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every gloo (and NCCL) process group in a ProcessGroupWrapper, which before
  each collective passes a monitored barrier and compares the collective's fingerprint (op, shapes, dtypes) between
  the ranks, both over a gloo helper group. A shape
  or order mismatch becomes an error on every rank at once instead of a hang or a wrong result: "Detected mismatch
  between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(... OpType=ALLREDUCE,
  TensorShape=[4] ...), but Rank 1 is running collective: ... TensorShape=[5] ... Tensor shapes: 4vs 5" (an
  all_reduce against a broadcast: "Op type: ALLREDUCEvs BROADCAST"). Those checks add round trips to every
  collective: turn it on to find a mismatch, not for a timed run (tests/test_stacks.py shows it). Without it, the same
  all_reduce (4 elements against 5) aborts one rank's process in C++ ("terminate called after throwing an instance
  of 'gloo::EnforceNotMet' ... Received data size doesn't match expected size. Is there a distributed collective
  mismatch in your code?") and the other reads "Connection reset by peer".
- The flight recorder records gloo's collectives too: with TORCH_FR_BUFFER_SIZE=N (older name
  TORCH_NCCL_TRACE_BUFFER_SIZE) every rank keeps its last N collectives, and
  `pickle.loads(torch._C._distributed_c10d._dump_fr_trace())` returns them in the rank's own process (entries
  with "profiling_name" "gloo:all_reduce", "input_sizes", "collective_seq_id"; gloo's entries stay in state
  "scheduled"). A rank that skipped a collective records one fewer, or another collective at the same
  "collective_seq_id"; gloo's send and recv are not recorded (2.13.0, 3 ranks). Lesson 08's lab shows each rank's
  last ones side by side (utils/course/lab.py's recent_collectives). The CPU build has no `_dump_nccl_trace`, and
  gloo writes no file when a collective times out (2.13.0; TORCH_FR_DUMP_TEMP_FILE is written by NCCL's watchdog):
  on gloo, the record stays in each rank's process, and py-spy's stacks are what shows a hang from outside.
  On NCCL, TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes each rank's record to TORCH_FR_DUMP_TEMP_FILE<rank>, which
  `torchfrtrace DIR -p PREFIX` (torch.distributed.flight_recorder.fr_trace) reads (see slurm/site.sh).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PY_SPY_VERSION = "0.4.1"  # the version requirements.txt pins
DUMP_TIMEOUT_S = 30  # py-spy pauses a process for a moment; one that takes longer is not answering
SRUN_TIMEOUT_S = 120
LINE = 500  # characters of a record a line, between the nodes' steps and this process
# Decorators between a course frame and the torch function it called: name the function, not its wrapper.
WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context"}


class StacksError(RuntimeError):
    """A problem the user can fix: printed as one line, exit code 1."""


def permission_advice(pid: int) -> str:
    return (
        f"permission denied reading process {pid}: run python -m utils.stacks as the job's user or as root; "
        "in a container add --cap-add SYS_PTRACE; where kernel.yama.ptrace_scope is 1 or more, "
        "only a parent may trace (sysctl kernel.yama.ptrace_scope=0, or run as root)"
    )


def find_py_spy() -> str:
    """py-spy beside this Python (a venv's bin/ is often not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise StacksError(
            f"py-spy not found (looked beside {sys.executable} and on PATH): install it with "
            f"`{sys.executable} -m pip install py-spy=={PY_SPY_VERSION}`"
        )
    return found


def is_torchrun(process: psutil.Process) -> bool:
    """`torchrun ...` or `python -m torch.distributed.run ...` (what the notebooks and tests launch)."""
    try:
        command = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if any(Path(word).name == "torchrun" for word in command[:2]):
        return True
    return any(a == "-m" and b == "torch.distributed.run" for a, b in zip(command, command[1:]))


def environment(process: psutil.Process) -> dict:
    """The process's environment as it started (/proc/PID/environ): torchrun gives each worker its RANK there."""
    try:
        return process.environ()
    except psutil.AccessDenied:
        raise StacksError(permission_advice(process.pid)) from None
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


def torchrun_jobs(agent_pid: int | None = None, slurm_job: str | None = None) -> dict[int, list[dict]]:
    """{torchrun's pid: its ranks as {"pid", "rank", "local_rank", "world_size", "host", "cwd"}}, on this node.
    Without agent_pid, only this user's jobs (root: everyone's). With slurm_job: only that job's ranks launched
    from this node's step (the local test cluster runs both of its nodes on one machine)."""
    node = os.environ.get("SLURMD_NODENAME")
    jobs = {}
    for agent in psutil.process_iter():
        if (agent_pid and agent.pid != agent_pid) or not is_torchrun(agent):
            continue
        try:
            if not agent_pid and os.getuid() not in (0, agent.uids().real):
                continue
            children = agent.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        if slurm_job:
            agent_env = environment(agent)
            if agent_env.get("SLURM_JOB_ID") != slurm_job or (node and agent_env.get("SLURMD_NODENAME") != node):
                continue
        ranks = {child: environment(child) for child in children}
        ranks = {child: env for child, env in ranks.items() if "RANK" in env}
        pids = {child.pid for child in ranks}
        workers = []
        for child, env in ranks.items():
            try:
                if child.ppid() in pids:  # a rank's own children (data loader workers) inherit its RANK
                    continue
                cwd = child.cwd()  # a relative file name in a stack is relative to it
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            workers.append({
                "pid": child.pid,
                "rank": int(env["RANK"]),
                "local_rank": int(env.get("LOCAL_RANK", -1)),
                "world_size": int(env.get("WORLD_SIZE", 0)),
                "host": env.get("SLURMD_NODENAME") or socket.gethostname(),
                "cwd": cwd,
            })  # fmt: skip
        jobs[agent.pid] = sorted(workers, key=lambda w: w["rank"])
    return jobs


def dump(py_spy: str, worker: dict) -> dict:
    """The worker with its threads ({"thread_name", "frames": [innermost first]}) or an "error" line."""
    try:
        done = subprocess.run(
            [py_spy, "dump", "--json", "--pid", str(worker["pid"])],
            capture_output=True, text=True, timeout=DUMP_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {**worker, "error": f"py-spy did not answer within {DUMP_TIMEOUT_S} s"}
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        if any(word in said for word in ("Permission", "not permitted", "os error 1)", "os error 13)")):
            raise StacksError(permission_advice(worker["pid"]))
        if not psutil.pid_exists(worker["pid"]):
            return {**worker, "error": "exited before its stack was taken"}
        return {**worker, "error": f"py-spy failed: {said.splitlines()[-1] if said else done.returncode}"}
    return {**worker, "threads": json.loads(done.stdout)}


def dump_all(workers: list[dict]) -> list[dict]:
    if not workers:
        return []
    py_spy = find_py_spy()
    with ThreadPoolExecutor(max_workers=min(8, len(workers))) as pool:  # py-spy mostly waits: run them together
        return list(pool.map(lambda worker: dump(py_spy, worker), workers))


def course_file(filename: str, cwd: str) -> Path | None:
    """The file's path in the course (relative to its root), or None for torch's, Python's and other code."""
    path = Path(cwd, filename).resolve() if not filename.startswith("<") else None
    if path is None or not path.is_relative_to(ROOT) or path.is_relative_to(ROOT / ".venv"):
        return None
    return path.relative_to(ROOT)


def main_thread(record: dict) -> list[dict]:
    threads = record.get("threads") or []
    main = [t for t in threads if t.get("thread_name") == "MainThread"] or threads[:1]
    return main[0]["frames"] if main else []


def where(record: dict) -> str:
    """'recv at tests/workers/x.py:25 (wait_for_token)': the innermost course frame and what it called."""
    if "error" in record:
        return record["error"]
    frames = main_thread(record)
    course = next((i for i, f in enumerate(frames) if course_file(f["filename"], record["cwd"])), None)
    if course is None:
        if not frames:
            return "no Python frames"
        return f"outside the course's code, in {frames[0]['name']} at {frames[0]['short_filename']}:{frames[0]['line']}"
    frame = frames[course]
    place = f"{course_file(frame['filename'], record['cwd'])}:{frame['line']} ({frame['name']})"
    called = [f["name"] for f in reversed(frames[:course]) if f["name"] not in WRAPPERS]
    return f"{called[0]} at {place}" if called else f"at {place}"


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def summary(records: list[dict]) -> str:
    """One line: the groups of ranks that wait at the same place, the smallest (the odd ones) first."""
    groups = defaultdict(list)
    for record in records:
        groups[where(record)].append(record["rank"])
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1]))
    world = max((r["world_size"] for r in records), default=0)
    missing = sorted(set(range(world)) - {r["rank"] for r in records})
    lines = []
    if len(ordered) == 1:
        place, ranks = ordered[0]
        lines.append(f"all {len(ranks)} ranks found wait in {place}")
    else:
        verb = [" waits in ", " wait in "]
        lines.append("; ".join(f"{ranks_text(r)}{verb[len(r) > 1] if i == 0 else ' in '}{p}" for i, (p, r) in
                               enumerate(ordered)))  # fmt: skip
    if missing:
        lines.append(
            f"{ranks_text(missing)} of {world} not found (on another node: pass the Slurm job id; or exited: "
            "read the job's first error)"
        )
    return "\n".join(lines)


def report(title: str, records: list[dict]) -> str:
    """Each rank's stacks as py-spy shows them (innermost frame first), the course's frames marked '>'."""
    lines = [f"===== {title}"]
    for record in sorted(records, key=lambda r: r["rank"]):
        lines.append(
            f"--- rank {record['rank']} of {record['world_size']} (local rank {record['local_rank']}, "
            f"{record['host']}, pid {record['pid']})"
        )
        if "error" in record:
            lines.append(f"    ({record['error']})")
        for thread in record.get("threads", []):
            lines.append(f"  thread {thread.get('thread_name') or thread.get('thread_id')}")
            for frame in thread["frames"]:
                mine = course_file(frame["filename"], record["cwd"])
                lines.append(
                    f"  {'>' if mine else ' '} {frame['name']} ({mine or frame['short_filename']}:{frame['line']})"
                )
    lines.append("summary: " + summary(records))
    return "\n".join(lines)


def local_jobs(agent_pid: int | None) -> str:
    jobs = torchrun_jobs(agent_pid)
    if not jobs:
        which = f"torchrun process {agent_pid}" if agent_pid else "torchrun job"
        raise StacksError(f"no {which} on this node (looked for `torchrun` and `python -m torch.distributed.run`)")
    texts = []
    for pid, workers in sorted(jobs.items()):
        command = " ".join(psutil.Process(pid).cmdline()[1:])[:200]
        if not workers:
            texts.append(f"===== torchrun {pid}: no workers running ({command})")
            continue
        texts.append(report(f"torchrun {pid}: {command}", dump_all(workers)))
    return "\n\n".join(texts)


def srun_command(job_id: str, nodes: int) -> list[str]:
    """One step on each of the job's nodes, beside its running step (--overlap), each dumping its own node."""
    return [
        "srun", f"--jobid={job_id}", "--overlap", f"--nodes={nodes}", "--ntasks-per-node=1", f"--chdir={ROOT}",
        "--label",  # "0: ..." before each line: srun would otherwise interleave two nodes' long lines
        sys.executable, "-m", "utils.stacks", "--local", job_id,
    ]  # fmt: skip


def slurm_job(job_id: str) -> str:
    if not shutil.which("srun"):
        raise StacksError(f"a Slurm job id ({job_id}) needs srun, which is not on PATH: run this on the cluster")
    found = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %D"], capture_output=True, text=True, timeout=30)
    state = found.stdout.split()
    if found.returncode != 0 or not state:
        raise StacksError(f"Slurm job {job_id} is not in the queue (squeue -j {job_id}): is the id right?")
    if state[0] != "RUNNING":
        raise StacksError(f"Slurm job {job_id} is {state[0]}, not RUNNING: nothing to dump")
    try:
        done = subprocess.run(srun_command(job_id, int(state[1])), capture_output=True, text=True,
                              timeout=SRUN_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise StacksError(f"srun on job {job_id}'s nodes did not finish within {SRUN_TIMEOUT_S} s") from None
    records, seen = [], set()
    parts = defaultdict(str)
    for line in done.stdout.splitlines():  # "node: +part of a rank's record" ... "node: =its last part"
        node, _, part = line.partition(": ")
        if part[:1] not in ("+", "="):
            continue
        parts[node] += part[1:]
        if part[0] == "=":
            record, parts[node] = json.loads(parts[node]), ""
            if (record["host"], record["pid"]) not in seen:  # the local test cluster's nodes share one machine
                seen.add((record["host"], record["pid"]))
                records.append(record)
    if not records:
        said = (done.stderr.strip().splitlines() or ["no torchrun worker found on its nodes"])[-1]
        raise StacksError(f"no stacks from Slurm job {job_id}: {said}")
    return report(f"Slurm job {job_id}", records)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m utils.stacks", description=__doc__.splitlines()[0])
    parser.add_argument("job_id", nargs="?", help="a Slurm job id: dump its ranks on all its nodes")
    parser.add_argument("--pid", type=int, help="only the torchrun job whose torchrun process has this id")
    parser.add_argument("--local", action="store_true", help=argparse.SUPPRESS)  # one node's part, a JSON line a rank
    args = parser.parse_args(argv)
    if args.job_id and not args.job_id.isdigit():
        parser.error(f"a Slurm job id is a number, not {args.job_id!r}")
    try:
        if args.local:
            workers = [w for ws in torchrun_jobs(slurm_job=args.job_id).values() for w in ws]
            for record in dump_all(workers):
                text = json.dumps(record)  # srun splits lines of about 1 kB: send it in shorter ones
                chunks = [text[i : i + LINE] for i in range(0, len(text), LINE)]
                print("\n".join(["+" + c for c in chunks[:-1]] + ["=" + chunks[-1]]), flush=True)
        elif args.job_id:
            print(slurm_job(args.job_id))
        else:
            print(local_jobs(args.pid))
    except StacksError as error:
        print(f"utils.stacks: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
