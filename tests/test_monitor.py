"""--watch and the job report (utils/monitor.py): every rank records its process and node while the run trains.

One data-parallel run on 2 CPU ranks with --watch (shared by the tests below), one single-process run killed with
SIGKILL mid-run, and reports read from what they recorded. The GPU fields (NVML) are checked by
`python -m tests.harness.gpu_check` on a GPU machine.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.launch import ROOT, course_env, torchrun
from utils import monitor
from utils.training import base_parser, parse_args

INTERVAL = "0.25"  # seconds between samples: a run of a few seconds leaves several
WATCHED = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4"]
CORES = len(monitor.allocated_cores())


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """Lesson 02 on 2 ranks with --watch: (its Run, its log folder, the time it ended)."""
    folder = tmp_path_factory.mktemp("watched")
    run = torchrun(
        ROOT / "solutions" / "02_data_parallel.py", 2,
        [*WATCHED, "--steps", "250", "--watch", INTERVAL, "--log-dir", folder / "logs"], tmp_path=folder,
    )  # fmt: skip
    return run.check(), folder / "logs", time.time()


def test_watch_records_every_rank_into_the_metrics(watched):
    """Each rank's samples, in time order, in the metrics file; rank 0 also its node's cores and network."""
    run, logs, _ = watched
    assert "--watch" in map(str, run.command)
    records = run.metrics["monitor"]
    assert [r["rank"] for r in records] == [0, 1] and all(r["world_size"] == 2 for r in records)
    for record in records:
        times = [s["t"] for s in record["samples"]]
        assert len(times) >= 3, f"rank {record['rank']}: {len(times)} samples at --watch {INTERVAL}"
        assert times == sorted(times) and times[0] >= record["start"]
        assert all(s["rss_bytes"] > 50 * 2**20 and s["cpu_percent"] >= 0 for s in record["samples"])
        costs = [s["sampler_cpu_s"] for s in record["samples"]]  # the sampler's own CPU time, for the report
        assert costs == sorted(costs) and costs[-1] > 0
    node = records[0]["samples"][-1]
    assert len(node["cores_percent"]) == records[0]["devices_allocated"] == CORES
    assert node["net_sent_bytes"] > 0 and "cores_percent" not in records[1]["samples"][-1]  # one rank per node


def test_sampler_stops_with_the_run(watched):
    """The rank files end when the run ends: nothing is appended afterwards, and every line is whole."""
    _, logs, ended = watched
    sizes = {path.name: path.stat().st_size for path in (logs / "monitor").glob("rank*.jsonl")}
    assert sorted(sizes) == ["rank0.jsonl", "rank1.jsonl"]
    time.sleep(3 * float(INTERVAL))
    assert sizes == {path.name: path.stat().st_size for path in (logs / "monitor").glob("rank*.jsonl")}
    for name in sizes:
        record = monitor.read_rank_file(logs / "monitor" / name)
        assert record["samples"][-1]["t"] <= ended


def test_report_of_a_recorded_run_gives_its_lines_and_figure(watched):
    run, logs, _ = watched
    metrics_file = Path(run.command[run.command.index("--metrics-out") + 1])
    shown = subprocess.run(
        [sys.executable, "-m", "utils.monitor", "report", str(metrics_file)], cwd=ROOT, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("job report: 2 ranks on 1 node, ") and "02_data_parallel.py" in lines[0]
    # Both ranks want a core while they compute; a rank waiting for the other in a collective sleeps, so on a loaded
    # machine (the suite's other stream) one of them can fall under the threshold: at least one core is busy.
    counted = re.search(r"(\d+) cores? allocated, (\d+) busy", lines[1])
    assert counted and int(counted.group(1)) == CORES and 1 <= int(counted.group(2)) <= min(2, CORES), "\n".join(lines)
    assert sum(line.startswith("  rank ") for line in lines) == 2
    assert any(line.startswith("  --watch itself: at most ") for line in lines), "\n".join(lines)
    png = metrics_file.with_name(metrics_file.stem + ".monitor.png")
    assert lines[-1] == f"figure: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The folder of per-rank files tells the same story as the metrics file.
    assert monitor.report_lines(monitor.load(logs / "monitor"))[1] == lines[1]


def test_tensorboard_has_each_ranks_scalars(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, logs, _ = watched
    for rank in (0, 1):
        events = EventAccumulator(str(logs / "monitor" / f"rank{rank}"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"monitor/cpu_percent", "monitor/rss_mib"} <= tags, f"rank {rank}: {sorted(tags)}"
        assert len(events.Scalars("monitor/rss_mib")) >= 3
        first_core = f"monitor/core{monitor.allocated_cores()[0]}_percent"
        assert (first_core in tags) == (rank == 0), f"rank {rank}: the node's cores are local rank 0's to record"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Lesson 00 (one process) with --watch, killed with SIGKILL once it has recorded a few samples."""
    folder = tmp_path_factory.mktemp("killed") / "monitor"
    env = course_env(COURSE_MONITOR_DIR=folder)
    script = ROOT / "solutions" / "00_setup_and_baseline.py"
    process = subprocess.Popen(
        [sys.executable, script, *WATCHED, "--steps", "100000", "--watch", INTERVAL, "--log-dir", folder.parent],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            rank_file = folder / "rank0.jsonl"
            if rank_file.exists() and len(rank_file.read_text().splitlines()) >= 8:  # training for a while
                break
            time.sleep(0.2)
        assert process.poll() is None, f"the run ended before it was killed (exit {process.returncode})"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)
    return folder


def test_a_killed_rank_leaves_a_readable_file(killed):
    record = monitor.read_rank_file(killed / "rank0.jsonl")
    assert record["world_size"] == 1 and len(record["samples"]) >= 7
    assert monitor.load(killed)[0]["samples"] == record["samples"]


@pytest.mark.skipif(CORES < 2, reason="a machine with one core leaves no core idle")
def test_fewer_processes_than_cores_says_so_in_one_line(killed):
    lines = monitor.report_lines(monitor.load(killed))
    assert lines[-1] == f"1 of {CORES} cores busy: the script runs one process", "\n".join(lines)


def gpu_record(rank, busy_gpus, allocated=4):
    """A recorded GPU rank, as local rank 0 of a node writes it: every GPU's utilization in each sample."""
    samples = [
        {
            "t": 100.0 + i,
            "cpu_percent": 100.0,
            "rss_bytes": 2**30,
            "cuda_peak_bytes": 2**33,
            "gpus": [
                {"util_percent": 95 if g in busy_gpus else 0, "mem_used_bytes": 2**34, "power_w": 300.0}
                for g in range(allocated)
            ],
        }  # fmt: skip
        for i in range(5)
    ]
    return {"rank": rank, "local_rank": rank, "world_size": 1, "host": "node1", "device": f"cuda:{rank}",
            "device_kind": "gpu", "devices_allocated": allocated, "cores": [0], "interval_s": 1.0,
            "command": "00_setup_and_baseline.py --watch", "start": 99.5, "samples": samples}  # fmt: skip


def test_one_gpu_of_four_is_named_a_waste():
    lines = monitor.report_lines([gpu_record(0, busy_gpus={0})])
    assert "node node1: 4 GPUs allocated, 1 busy" in lines[1]
    assert "GPU 0 mean 95% peak 95%, GPU 1 mean 0% peak 0%" in lines[2]
    assert "torch.cuda peak 8.00 GiB" in lines[3]
    assert lines[-1] == "1 of 4 GPUs busy: the script runs one process"
    assert monitor.idle_line(monitor.summarize([gpu_record(0, busy_gpus={0, 1, 2, 3})])["nodes"][0]) is None


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_interval_is_refused_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(base_parser("test"), ["--watch", value])
    message = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(message.splitlines()) == 1 and "--watch" in message, message


def test_report_of_a_file_without_samples_says_what_to_do(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"world_size": 1}))
    shown = subprocess.run(
        [sys.executable, "-m", "utils.monitor", "report", str(tmp_path / "m.json")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert shown.returncode == 2 and "run the script with --watch" in shown.stderr and not shown.stdout
