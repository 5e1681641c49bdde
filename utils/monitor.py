"""How busy a job's devices and processes are, sampled while it trains, and the job report read from the samples.

    torchrun --nproc_per_node=2 solutions/02_data_parallel.py --watch --metrics-out m.json
    python -m utils.monitor report m.json          # text, and m.monitor.png beside the metrics
    python -m utils.monitor report runs/02_data_parallel/monitor     # the same from the per-rank files

`--watch` (every course script has it; not `--monitor`, which torchrun takes for its own --monitor-interval)
starts a `Monitor` on each rank when setup() joins the job. Its thread wakes about once a second, reads counters the
operating system (and NVML on a GPU) keeps anyway, and sleeps again: it never calls a collective and never waits for
the training loop. Each rank records its own process (CPU time, its main thread's wait for a core, resident memory,
torch.cuda's peak); local rank 0 also records its node (every allocated core's utilization, network bytes, every
GPU's utilization, memory and power), so a device no rank uses shows up idle. Each sample is appended to
rank<R>.jsonl at once, so a rank that is killed leaves a readable file; TensorBoard gets the same scalars per rank
(and wandb, on rank 0 with --wandb), and write_metrics puts every rank's samples into the metrics file under
"monitor".

On the CPU path a device is a core: the cores this job may use are its devices.
"""

import argparse
import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import psutil

BUSY_PERCENT = 50  # a device (a GPU, or a core's worth of a process) busier than this on average counts as busy
_requested: dict | None = None  # what parse_args asked for: {"interval_s": ..., "folder": ...}
_running: "Monitor | None" = None


def request(interval_s: float, folder: Path):
    """Remember that this run is watched (parse_args calls it); setup() starts the sampler once ranks are known."""
    global _requested
    _requested = {"interval_s": interval_s, "folder": Path(os.environ.get("COURSE_MONITOR_DIR") or folder)}


def start_requested(rank: int, local_rank: int, world_size: int, device) -> "Monitor | None":
    """Start this rank's sampler if --watch asked for one (called by setup()); at most one per process."""
    global _running
    if _requested is None or _running is not None:
        return _running
    _running = Monitor(_requested["folder"], rank, local_rank, world_size, device, _requested["interval_s"])
    _running.start()
    return _running


def running() -> "Monitor | None":
    return _running


def stop_running():
    """Stop this process's sampler (run_main calls it after main; atexit calls it too)."""
    if _running is not None:
        _running.stop()


def host_name() -> str:
    """The Slurm node name where there is one (several nodes may share a host), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def main_thread_waited_s() -> float | None:
    """Seconds this process's main thread (the training loop) has spent ready to run but waiting for a core; None
    off Linux. A rank that shares its core with another waits about as long as it runs: the CPU it got alone does
    not tell a rank with little to do from a rank that cannot get a core."""
    try:
        return int(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def allocated_cores() -> list[int]:
    """The cores this process may run on (the job's CPU allocation on this node)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(psutil.cpu_count() or 1))


class _Gpus:
    """The node's GPUs through NVML (package nvidia-ml-py), imported only where CUDA is there."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        # CUDA_VISIBLE_DEVICES (indices or UUIDs) names the job's GPUs; NVML sees the whole node: watch the job's.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [v.strip() for v in visible.split(",")] if visible else range(pynvml.nvmlDeviceGetCount())
        self.handles = [
            pynvml.nvmlDeviceGetHandleByIndex(int(name))
            if str(name).isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(name)
            for name in names
        ]

    def sample(self) -> list[dict]:
        readings = []
        for handle in self.handles:
            power_mw = self.nvml.nvmlDeviceGetPowerUsage(handle)
            readings.append(
                {
                    "util_percent": self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                    "mem_used_bytes": self.nvml.nvmlDeviceGetMemoryInfo(handle).used,
                    "power_w": power_mw / 1000,
                }
            )
        return readings


class Monitor:
    """One rank's sampler: start(), then a sample every `interval_s` in a daemon thread, then stop()."""

    def __init__(self, folder, rank: int, local_rank: int, world_size: int, device, interval_s: float = 1.0):
        self.folder, self.rank, self.interval_s = Path(folder), rank, interval_s
        self.device = str(device)
        self.node_level = local_rank == 0  # one rank per node records what the ranks of a node share
        self.process = psutil.Process()
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.gpus = None
        if self.cuda and self.node_level:
            try:
                self.gpus = _Gpus()
            except ImportError:  # the GPUs' own counters need NVML; the process's are still recorded
                print("monitor: no GPU utilization without NVML: pip install nvidia-ml-py", file=sys.stderr)
        cores = allocated_cores()
        self.header = {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "host": host_name(),
            "pid": os.getpid(),
            "device": self.device,
            "device_kind": "gpu" if self.cuda else "core",
            "devices_allocated": len(self.gpus.handles) if self.gpus else self._allocated_devices(cores),
            "cores": cores,
            "interval_s": interval_s,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "start": time.time(),
        }
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="course-monitor", daemon=True)
        self._writer = None
        self._file = None

    def _allocated_devices(self, cores: list[int]) -> int:
        if self.cuda:
            import torch

            return int(os.environ.get("SLURM_GPUS_ON_NODE") or torch.cuda.device_count())
        return len(cores)

    def start(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # files of a former run with more ranks would be read as this run's
            for old in self.folder.glob("rank*.jsonl"):
                if old.stem[4:].isdigit() and int(old.stem[4:]) >= self.header["world_size"]:
                    old.unlink(missing_ok=True)
        self._file = open(self.folder / f"rank{self.rank}.jsonl", "w")
        self._write({"header": self.header})
        self.process.cpu_percent()  # the first call starts the interval; it returns 0
        self._last_cores = psutil.cpu_times(percpu=True)
        self._last_wait = (time.monotonic(), main_thread_waited_s())
        from torch.utils.tensorboard import SummaryWriter  # here, before training starts, not in the sampler

        self._writer = SummaryWriter(log_dir=str(self.folder / f"rank{self.rank}"))
        self._thread.start()
        atexit.register(self.stop)

    def stop(self):
        """End the thread and close the files; safe to call twice, and from atexit."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s)
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()

    def _run(self):
        try:
            while not self._stop.wait(self.interval_s):
                self._record(self.sample())
        except Exception as error:  # a monitor must never end the run it watches: say why it stopped, once
            print(f"[rank {self.rank}] monitor stopped: {type(error).__name__}: {error}", file=sys.stderr)

    def sample(self) -> dict:
        """What this rank (and, on local rank 0, its node) is doing now."""
        memory = self.process.memory_info()
        sample = {
            "t": time.time(),
            "sampler_cpu_s": time.thread_time(),  # what --watch itself has cost so far: this thread's CPU time
            "cpu_percent": self.process.cpu_percent(),  # of one core, since the last sample: 200 = two cores
            "rss_bytes": memory.rss,
        }
        now, waited = time.monotonic(), main_thread_waited_s()
        (before, last), self._last_wait = self._last_wait, (now, waited)
        if waited is not None and last is not None:  # of one core: the CPU it got plus the time it waited for one
            sample["waited_percent"] = 100 * (waited - last) / (now - before)
            sample["wanted_percent"] = sample["cpu_percent"] + sample["waited_percent"]
        if self.cuda:
            import torch

            sample["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.node_level:
            sample["cores_percent"] = self._cores_percent()
            network = psutil.net_io_counters()
            sample["net_sent_bytes"], sample["net_recv_bytes"] = network.bytes_sent, network.bytes_recv
            if self.gpus is not None:
                try:
                    sample["gpus"] = self.gpus.sample()
                except Exception as error:  # e.g. a MIG slice reports no utilization: keep the rest
                    print(f"monitor: no more GPU readings ({type(error).__name__}: {error})", file=sys.stderr)
                    self.gpus = None
        return sample

    def _cores_percent(self) -> list[float]:
        """Each allocated core's busy share since the last sample (our own counters: psutil.cpu_percent()'s are
        shared with anything else in the process that calls it)."""
        now = psutil.cpu_times(percpu=True)
        before, self._last_cores = self._last_cores, now
        shares = []
        for core in self.header["cores"]:
            if core >= len(now):
                continue
            total = sum(now[core]) - sum(before[core])
            idle = (now[core].idle + getattr(now[core], "iowait", 0)) - (
                before[core].idle + getattr(before[core], "iowait", 0)
            )
            shares.append(100 * (total - idle) / total if total > 0 else 0.0)
        return shares

    def _record(self, sample: dict):
        self.samples.append(sample)
        self._write(sample)
        self._tensorboard(sample)

    def _write(self, record: dict):
        if self._file is not None and not self._file.closed:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # one line a sample, on disk at once: a killed rank leaves every sample but the last

    def _tensorboard(self, sample: dict):
        step, wall = len(self.samples), sample["t"]
        scalars = {"cpu_percent": sample["cpu_percent"], "rss_mib": sample["rss_bytes"] / 2**20}
        if "wanted_percent" in sample:
            scalars["wanted_percent"] = sample["wanted_percent"]
        if "cuda_peak_bytes" in sample:
            scalars["cuda_peak_mib"] = sample["cuda_peak_bytes"] / 2**20
        for index, percent in enumerate(sample.get("cores_percent", [])):
            scalars[f"core{self.header['cores'][index]}_percent"] = percent
        for index, gpu in enumerate(sample.get("gpus", [])):
            scalars[f"gpu{index}_util_percent"] = gpu["util_percent"]
            scalars[f"gpu{index}_mem_used_mib"] = gpu["mem_used_bytes"] / 2**20
            scalars[f"gpu{index}_power_w"] = gpu["power_w"]
        for name, value in scalars.items():
            self._writer.add_scalar(f"monitor/{name}", value, step, walltime=wall)
        wandb = sys.modules.get("wandb")  # rank 0's wandb run, when --wandb started one
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.run.log({f"monitor/rank{self.rank}/{k}": v for k, v in scalars.items()}, commit=False)

    def record(self) -> dict:
        """This rank's header and samples so far (what the metrics file keeps under "monitor")."""
        return {**self.header, "samples": list(self.samples)}


# --------------------------------------------------------------------------------------------------
# Reading samples back: the job report
# --------------------------------------------------------------------------------------------------


def read_rank_file(path: Path) -> dict:
    """One rank's header and samples from its rank<R>.jsonl; a line cut short by a kill is left out."""
    record, samples = None, []
    for line in Path(path).read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a rank killed while writing it
        if "header" in entry:
            record = dict(entry["header"])
        else:
            samples.append(entry)
    if record is None:
        raise ValueError(f"{path}: no header line; is it a monitor file (rank<R>.jsonl)?")
    return {**record, "samples": samples}


def load(path) -> list[dict]:
    """Every rank's record from a metrics file (its "monitor" field) or a folder of rank<R>.jsonl files."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("rank*.jsonl")) or sorted(path.glob("monitor/rank*.jsonl"))
        if not files:
            raise FileNotFoundError(f"no rank*.jsonl in {path}: run the script with --watch first")
        ranks = [read_rank_file(f) for f in files]
    elif path.is_file():
        metrics = json.loads(path.read_text())
        if "monitor" not in metrics:
            raise ValueError(f"{path} has no 'monitor' field: run the script with --watch")
        ranks = metrics["monitor"]
    else:
        raise FileNotFoundError(f"{path} does not exist: give a metrics file or a monitor folder")
    return sorted(ranks, key=lambda r: r["rank"])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(ranks: list[dict]) -> dict:
    """Per node: devices allocated and busy, each device's mean and peak utilization, each rank's use."""
    nodes = {}
    for record in ranks:
        nodes.setdefault(record["host"], []).append(record)
    starts = [s["t"] for r in ranks for s in r["samples"]] or [r["start"] for r in ranks]
    summary = {"nodes": [], "ranks": len(ranks), "elapsed_s": max(starts) - min(r["start"] for r in ranks)}
    for host, members in nodes.items():
        lead = next((r for r in members if r["local_rank"] == 0), members[0])
        kind, allocated = lead["device_kind"], lead["devices_allocated"]
        processes = [
            {
                "rank": r["rank"],
                "cpu_mean": _mean(s["cpu_percent"] for s in r["samples"]),
                "cpu_peak": max((s["cpu_percent"] for s in r["samples"]), default=0.0),
                # what the process wanted: the CPU it got plus its main thread's wait for a core
                "wanted_mean": _mean(s.get("wanted_percent", s["cpu_percent"]) for s in r["samples"]),
                "waited_mean": _mean(s.get("waited_percent", 0.0) for s in r["samples"]),
                "rss_peak": max((s["rss_bytes"] for s in r["samples"]), default=0),
                "cuda_peak": max((s.get("cuda_peak_bytes", 0) for s in r["samples"]), default=0),
            }
            for r in members
        ]
        if kind == "gpu":
            series = [[s["gpus"][i]["util_percent"] for s in lead["samples"] if "gpus" in s] for i in range(allocated)]
            series = series if any(series) else []  # recorded without NVML: nothing to say per GPU
            names = [f"GPU {i}" for i in range(allocated)]
            busy = sum(_mean(values) > BUSY_PERCENT for values in series)
        else:
            series = [
                [s["cores_percent"][i] for s in lead["samples"] if "cores_percent" in s] for i in range(allocated)
            ]
            names = [f"core {c}" for c in lead["cores"]]
            # A core is the job's when one of its processes wants it more than half the time, whether it got it
            # or waited for it (other users' load counts neither way): a process wanting 200% keeps two busy.
            busy = min(
                allocated,
                sum(max(1, round(p["wanted_mean"] / 100)) for p in processes if p["wanted_mean"] > BUSY_PERCENT),
            )
        devices = [
            {"name": name, "mean": _mean(values), "peak": max(values, default=0.0)}
            for name, values in zip(names, series)
        ]
        traffic = [s["net_sent_bytes"] + s["net_recv_bytes"] for s in lead["samples"] if "net_sent_bytes" in s]
        summary["nodes"].append(
            {
                "host": host,
                "network_bytes": traffic[-1] - traffic[0] if traffic else 0,
                "kind": kind,
                "allocated": allocated,
                "busy": busy,
                "devices": devices,
                "processes": processes,
            }  # fmt: skip
        )
    return summary


def members_of(ranks: list[dict], host: str) -> list[dict]:
    return [r for r in ranks if r["host"] == host]


def _sampler_cost(members: list[dict]) -> str:
    """What the sampling threads cost on a node: their CPU time over the time they ran, in % of one core."""
    costs = [
        (r["samples"][-1]["sampler_cpu_s"], r["samples"][-1]["t"] - r["start"], len(r["samples"]))
        for r in members
        if r["samples"] and "sampler_cpu_s" in r["samples"][-1]
    ]
    if not costs:
        return "--watch itself: its cost was not recorded"
    worst = max(costs, key=lambda c: c[0] / max(c[1], 1e-9))
    return (
        f"--watch itself: at most {1000 * worst[0] / worst[2]:.1f} ms of CPU a sample, "
        f"{100 * worst[0] / max(worst[1], 1e-9):.2f}% of a core"
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def idle_line(node: dict) -> str | None:
    """The one line that says an allocation left devices idle (None when every device was busy)."""
    if node["busy"] >= node["allocated"]:
        return None
    word = "GPU" if node["kind"] == "gpu" else "core"
    runs = _plural(len(node["processes"]), "process").replace("1 process", "one process")
    return f"{node['busy']} of {_plural(node['allocated'], word)} busy: the script runs {runs}"


def _shown_command(command: str) -> str:
    """The command without the options that only say where files go (--metrics-out, --log-dir)."""
    words, shown = command.split(), []
    for word in words:
        if shown and shown[-1] in ("--metrics-out", "--log-dir"):
            shown.pop()
        else:
            shown.append(word)
    return " ".join(shown)


def report_lines(ranks: list[dict]) -> list[str]:
    summary = summarize(ranks)
    gib = 2**30
    first = ranks[0]
    lines = [
        f"job report: {_plural(summary['ranks'], 'rank')} on {_plural(len(summary['nodes']), 'node')}, "
        f"{summary['elapsed_s']:.1f} s sampled every {first['interval_s']:g} s ({_shown_command(first['command'])})"
    ]
    for node in summary["nodes"]:
        word = "GPU" if node["kind"] == "gpu" else "core"
        lines.append(
            f"node {node['host']}: {_plural(node['allocated'], word)} allocated, {node['busy']} busy"
            + (
                ""
                if node["kind"] == "gpu"
                else f" (busy: a process of the job wants it over {BUSY_PERCENT}% of the time)"
            )
        )
        lines.append(
            "  "
            + ", ".join(f"{d['name']} mean {d['mean']:.0f}% peak {d['peak']:.0f}%" for d in node["devices"])
            + ("" if node["kind"] == "gpu" else " (the whole node's load, other users' too)")
        )
        for p in node["processes"]:
            cuda = f", torch.cuda peak {p['cuda_peak'] / gib:.2f} GiB" if p["cuda_peak"] else ""
            lines.append(
                f"  rank {p['rank']}: CPU mean {p['cpu_mean']:.0f}% peak {p['cpu_peak']:.0f}% of a core, "
                f"waited for a core {p['waited_mean']:.0f}% of the time, "
                f"peak resident memory {p['rss_peak'] / gib:.2f} GiB{cuda}"
            )
        lines.append(f"  network: {node['network_bytes'] / 2**20:,.1f} MiB sent and received by the node")
        waited = _mean(p["waited_mean"] for p in node["processes"])
        if node["kind"] == "core" and waited > BUSY_PERCENT / 2:
            lines.append(
                f"  the job's processes waited for a core {waited:.0f}% of the time: they share cores "
                "(with each other, or with other users of the node)"
            )
        lines.append("  " + _sampler_cost(members_of(ranks, node["host"])))
        if idle_line(node):
            lines.append(idle_line(node))
    return lines


def figure(ranks: list[dict]):
    """The figure: one row per node, device utilization (left) and each rank's memory (right) over time.

    A matplotlib Figure made without pyplot: saved as PNG from a script, shown as it is in a notebook."""
    from matplotlib.figure import Figure

    summary = summarize(ranks)
    t0 = min(r["start"] for r in ranks)
    nodes = summary["nodes"]
    drawing = Figure(figsize=(11, 3.2 * len(nodes)), dpi=100)
    axes = drawing.subplots(len(nodes), 2, squeeze=False)
    for row, node in enumerate(nodes):
        members = [r for r in ranks if r["host"] == node["host"]]
        lead = next((r for r in members if r["local_rank"] == 0), members[0])
        busy_axis, memory_axis = axes[row]
        times = [s["t"] - t0 for s in lead["samples"]]
        for index, device in enumerate(node["devices"]):
            if node["kind"] == "gpu":
                values = [s["gpus"][index]["util_percent"] for s in lead["samples"] if "gpus" in s]
            else:
                values = [s["cores_percent"][index] for s in lead["samples"] if "cores_percent" in s]
            busy_axis.plot(times[: len(values)], values, label=device["name"])
        for record in members:
            times_r = [s["t"] - t0 for s in record["samples"]]
            got = busy_axis.plot(times_r, [s["cpu_percent"] for s in record["samples"]], "--",
                                 label=f"rank {record['rank']}: CPU it got")[0]  # fmt: skip
            if node["kind"] == "core" and all("wanted_percent" in s for s in record["samples"]):
                wanted = [s["wanted_percent"] for s in record["samples"]]
                busy_axis.plot(
                    times_r, wanted, ":", color=got.get_color(), label=f"rank {record['rank']}: CPU it wanted"
                )
            memory = [s.get("cuda_peak_bytes") or s["rss_bytes"] for s in record["samples"]]
            memory_axis.plot(times_r, [m / 2**20 for m in memory], label=f"rank {record['rank']}")
        word = "GPU" if node["kind"] == "gpu" else "core"
        busy_axis.set(
            title=f"{node['host']}: {node['busy']} of {_plural(node['allocated'], word)} busy",
            xlabel="time since start (s)",
            ylabel="utilization (%; a rank: of one core)",
        )
        memory_axis.set(
            title=f"{node['host']}: memory per rank",
            xlabel="time since start (s)",
            ylabel="torch.cuda peak (MiB)" if node["kind"] == "gpu" else "resident memory (MiB)",
        )
        busy_axis.set_ylim(0, 1.6 * max(busy_axis.get_ylim()[1], 100))  # room for the legend above the lines
        busy_axis.legend(fontsize=9, loc="upper left", ncol=2)
        memory_axis.legend(fontsize=9, loc="best")
        for axis in (busy_axis, memory_axis):
            axis.grid(alpha=0.3)
    script = ranks[0]["command"].split()[0]
    where = f"{_plural(len(ranks), 'rank')} on {_plural(len(nodes), 'node')}"
    drawing.suptitle(f"job report: {script}, {where}, {summary['elapsed_s']:.0f} s", fontsize=12)
    drawing.tight_layout()
    return drawing


def plot(ranks: list[dict], path: Path) -> Path:
    """The figure, written as a PNG file."""
    figure(ranks).savefig(path)
    return path


def png_beside(path: Path) -> Path:
    """Where the figure goes by default: m.json -> m.monitor.png; a folder -> report.png inside it."""
    path = Path(path)
    return path / "report.png" if path.is_dir() else path.with_name(path.stem + ".monitor.png")


def report(path, png: Path | None = None) -> tuple[list[str], Path]:
    """The job report of a metrics file or a monitor folder: its lines, and the figure written as PNG."""
    ranks = load(path)
    png = Path(png) if png else png_beside(path)
    return report_lines(ranks), plot(ranks, png)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.monitor", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("report", help="the job report of a metrics file or a monitor folder")
    show.add_argument("path", type=Path, help="a metrics file written with --watch, or its monitor folder")
    show.add_argument("--png", type=Path, default=None, help="where to write the figure (default: beside PATH)")
    args = parser.parse_args(argv)
    try:
        lines, png = report(args.path, args.png)
    except (OSError, ValueError, KeyError) as error:
        print(f"python -m utils.monitor report: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"figure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
