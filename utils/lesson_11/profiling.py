"""torch.profiler around a few steps of training, one trace per rank, and the trace read back as events.

    profiler = StepProfiler(args.profile, rank, device)   # folder None: only the memory of one step is measured
    for step in ...:
        with profiler.step(step):
            ...one training step...
    profiler.peak_bytes                                    # the most bytes a step allocated on this rank

A trace is Chrome's trace-event JSON ({"traceEvents": [...]}): TensorBoard's profiler plugin and Perfetto
(ui.perfetto.dev) open it as it is. Each operation is a complete event ("ph": "X") with its name, category ("cat":
cpu_op, user_annotation, kernel on a GPU...), thread ("tid"), start ("ts") and duration ("dur"), in microseconds.
"""

import json
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from utils.lesson_11.options import PROFILED_STEPS

SKIPPED, WARMUP = 1, 1  # the first step pays for one-off work; the profiler's warm-up step is not recorded
MEMORY_STEP = 2  # without --profile: the step whose allocations are measured (after the first)


def trace_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pt.trace.json"  # .pt.trace.json: the name TensorBoard's profiler plugin reads


def activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


class StepProfiler:
    """With a folder: steps SKIPPED + WARMUP + 1 ... are recorded (PROFILED_STEPS of them) and written to
    folder/rank<r>.pt.trace.json; without one, step MEMORY_STEP alone is profiled, for its memory. Either way,
    `peak_bytes` is the most bytes a step held above what was allocated when it began (activations, gradients,
    temporaries): on a GPU the allocator's own peak, on the CPU the profiler's count of allocations and frees."""

    def __init__(self, folder, rank: int, device: torch.device, steps: int = SKIPPED + WARMUP + PROFILED_STEPS):
        self.folder, self.rank, self.device, self.peak_bytes = folder, rank, device, 0
        self.profiler = None
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            # A short run (a smoke test of an sbatch file) skips and warms up less, and records what is left.
            skipped = SKIPPED if steps >= SKIPPED + WARMUP + PROFILED_STEPS else 0
            warmup = WARMUP if steps - skipped > WARMUP else 0
            active = min(PROFILED_STEPS, steps - skipped - warmup)
            self.profiler = profile(
                activities=activities(device), profile_memory=True,
                schedule=schedule(wait=skipped, warmup=warmup, active=active, repeat=1),
                on_trace_ready=self._write,
            )  # fmt: skip
            self.profiler.start()

    def _write(self, profiler):
        path = trace_path(self.folder, self.rank)
        profiler.export_chrome_trace(str(path))
        self.peak_bytes = max(self.peak_bytes, peak_allocated(read_events(path)))

    @contextmanager
    def step(self, step: int):
        cuda = self.device.type == "cuda"
        measure_here = self.profiler is None and step == MEMORY_STEP
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
        context = profile(activities=activities(self.device), profile_memory=True) if measure_here and not cuda \
            else nullcontext()  # fmt: skip
        with context as memory_profile:
            yield
        if cuda and step >= MEMORY_STEP:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device) - start)
        if memory_profile is not None:
            with tempfile.TemporaryDirectory() as folder:
                memory_profile.export_chrome_trace(f"{folder}/step.json")
                self.peak_bytes = max(self.peak_bytes, peak_allocated(read_events(f"{folder}/step.json")))
        if self.profiler is not None:
            self.profiler.step()

    def close(self):
        if self.profiler is not None:
            self.profiler.stop()


def peak_allocated(events) -> int:
    """The largest 'Total Allocated' of the trace's memory events: the profiler counts every allocation and free
    from the moment it started, so this is the most bytes held at once above what was held then."""
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]" and "args" in e]
    return int(max(totals, default=0))


def read_events(path) -> list[dict]:
    """A trace's events (every kind: complete events "X", instants, metadata)."""
    return json.loads(Path(path).read_text())["traceEvents"]


def training_thread(events: list[dict]) -> int:
    """The thread that ran the training loop: the one the profiler's step markers (ProfilerStep#n) are on."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep#n events: was it written by torch.profiler with a schedule?")
    return steps[0]["tid"]


def step_spans(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of each recorded step, in microseconds."""
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]  # fmt: skip


@contextmanager
def native_stderr_silenced():
    """The profiler's native start and stop lines (and its allocator warning), written straight to the process's
    stderr with a timestamp, kept out of a notebook's output: file descriptor 2 points at /dev/null meanwhile."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
