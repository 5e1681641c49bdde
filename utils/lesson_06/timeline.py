"""Lesson 06's timeline of one 3D step: when each rank computed, and when it waited for TP, PP and DP communication.

    COURSE_TIMELINE=runs/step.json torchrun --nproc_per_node=8 solutions/06_3d_parallelism.py --tp 2 --pp 2
    timeline = read("runs/step.json"); draw(timeline)     # one row per rank, time across

The lesson script asks StepTimeline.requested(args) once (a misuse ends it with one line) and wraps its steps in
`timeline.record(last_step, grid)`: with COURSE_TIMELINE unset that does nothing. Set, the last step of a
from-scratch run (--impl scratch: its communication is called by name, so it can be wrapped) is recorded on every
rank: lesson 05's forward_step and backward_step (compute, one per micro-batch), lesson 05's exchange (the
pipeline's sends and receives with the neighbouring stages: PP) and every dist.all_reduce, named after the grid
dimension of its group (TP inside lesson 04's layers, DP in the gradient average). An interval runs from the call
to its return: a collective's includes waiting for the slowest rank of its group, an exchange's waiting for the
neighbour. Each rank's clock starts when a barrier releases it, so the rows line up to the barrier's skew. Rank 0
writes every rank's events, with the machine and the load, as JSON.
"""

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from utils.course.lessons import lesson
from utils.course.measured import cpu_name
from utils.distributed_utils import CourseError

ENV = "COURSE_TIMELINE"
COLOURS = {"F": "#c7c7c7", "B": "#8c8c8c", "tp": "#d62728", "pp": "#2ca02c", "dp": "#1f77b4", "world": "#9467bd"}
BANDS = {"F": (-0.4, 0.8), "B": (-0.4, 0.8), "tp": (0.1, 0.3)}  # (offset, height) in a row; others centred
WORDS = {
    "F": "forward of a micro-batch (compute)",
    "B": "backward of a micro-batch (compute)",
    "tp": "TP all-reduce (inside a layer)",
    "pp": "PP send/receive with the next or previous stage",
    "dp": "DP gradient all-reduce",
}


class StepTimeline:
    """The recorder of one step; false (and a no-op) unless COURSE_TIMELINE names a file."""

    def __init__(self, path: Path | None):
        self.path = path

    def __bool__(self) -> bool:
        return self.path is not None

    @classmethod
    def requested(cls, args) -> "StepTimeline":
        """Read COURSE_TIMELINE; refuse, with one line, what cannot be recorded, before any process waits."""
        value = os.environ.get(ENV)
        if value is None:
            return cls(None)
        if not value.strip():
            raise CourseError(f"{ENV} is set but empty: set it to the JSON file to write, or unset it")
        if args.impl != "scratch":
            raise CourseError(
                f"{ENV} records the from-scratch step, whose communication is called by name: run with "
                f"--impl scratch, or unset {ENV}"
            )
        path = Path(value)
        if path.is_dir() or not path.parent.is_dir():
            raise CourseError(f"{ENV}={value}: name a file in an existing folder (the JSON timeline is written there)")
        return cls(path)

    @contextmanager
    def record(self, active: bool, grid):
        """Record the step run inside the block when `active` (and the timeline was asked for)."""
        if not (self and active):
            yield
            return
        events: list[dict] = []
        steps = lesson("05")  # the module lesson 06 runs its pipeline with (utils.course.lessons imports it once)
        originals = {"all_reduce": dist.all_reduce, **{name: getattr(steps, name) for name in STEP_FUNCTIONS}}
        dist.barrier()
        origin = time.perf_counter()
        wrap(steps, grid, events, origin, originals)
        try:
            yield
        finally:
            dist.all_reduce = originals["all_reduce"]
            for name in STEP_FUNCTIONS:
                setattr(steps, name, originals[name])
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {"rank": grid.rank, "coords": grid.coords, "events": events})
        if grid.rank == 0:
            layout = grid.layout
            self.path.write_text(json.dumps(provenance(layout, ranks), indent=1) + "\n")


STEP_FUNCTIONS = ("forward_step", "backward_step", "exchange")


def wrap(steps, grid, events: list, origin: float, originals: dict):
    """Replace dist.all_reduce and lesson 05's step functions by versions that append their interval to `events`."""
    clock = time.perf_counter
    dimension = {}  # id(group) -> "tp" / "dp" / "pp" / "world"
    counts = {"F": 0, "B": 0}  # micro-batches run so far: F and B each come in micro-batch order

    def named(group) -> str:
        if id(group) not in dimension:
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            dimension[id(group)] = next(
                (dim for dim, members in grid.members.items() if list(members) == ranks), "world"
            )
        return dimension[id(group)]

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # async: the interval is the call's
        start = clock()
        result = originals["all_reduce"](tensor, op=op, group=group, async_op=async_op)
        events.append({"kind": named(group), "start": start - origin, "end": clock() - origin, "bytes": tensor.nbytes})
        return result

    def compute(kind: str):
        def run(*args, **kwargs):
            start = clock()
            result = originals[f"{'forward' if kind == 'F' else 'backward'}_step"](*args, **kwargs)
            events.append({"kind": kind, "mb": counts[kind], "start": start - origin, "end": clock() - origin})
            counts[kind] += 1
            return result

        return run

    def exchange(batch, buffers, shape, device):
        start = clock()
        result = originals["exchange"](batch, buffers, shape, device)
        if batch:  # a step with nothing to send or receive posts nothing
            size = math.prod(shape) * torch.get_default_dtype().itemsize  # lesson 05 receives in the default dtype
            events.append({
                "kind": "pp", "start": start - origin, "end": clock() - origin, "bytes": size * len(batch),
                "sends": [peer for op, peer, _, _ in batch if op == "send"],
                "receives": [peer for op, peer, _, _ in batch if op == "recv"],
            })  # fmt: skip
        return result

    dist.all_reduce = all_reduce
    steps.forward_step, steps.backward_step, steps.exchange = compute("F"), compute("B"), exchange


def provenance(layout, ranks: list[dict]) -> dict:
    return {
        "layout": {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp},
        "ranks": sorted(ranks, key=lambda rank: rank["rank"]),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average_1min": os.getloadavg()[0]},
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def read(path) -> dict:
    return json.loads(Path(path).read_text())


def events(rank: dict, *kinds: str) -> list[dict]:
    """One rank's events of the given kinds, in the order they ended."""
    return [event for event in rank["events"] if event["kind"] in kinds]


def inside(event: dict, intervals: list[dict]) -> bool:
    return any(span["start"] <= event["start"] and event["end"] <= span["end"] for span in intervals)


def overlaps(event: dict, intervals: list[dict]) -> bool:
    return any(span["start"] < event["end"] and event["start"] < span["end"] for span in intervals)


def draw(timeline: dict, title: str):
    """Every rank's step as a row: compute in grey (forward light, backward dark, micro-batch numbers on them),
    communication in colour (TP's in a band at the bottom of the compute that calls it). Intervals too short to
    see are drawn at a minimum width."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = timeline["ranks"]
    span = 1e3 * max(event["end"] for rank in ranks for event in rank["events"])  # ms
    shortest = span / 400
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}):
        fig, ax = plt.subplots(figsize=(12, 0.55 * len(ranks) + 2.4), constrained_layout=True)
        for row, rank in enumerate(ranks):
            computing = events(rank, "F", "B")  # first: the communication inside them is drawn over them
            for event in computing + [event for event in rank["events"] if event not in computing]:
                start, width = 1e3 * event["start"], max(1e3 * (event["end"] - event["start"]), shortest)
                low, height = BANDS.get(event["kind"], (-0.22, 0.44))
                ax.broken_barh([(start, width)], (row + low, height), color=COLOURS[event["kind"]], lw=0)
                if event in computing and width > span / 40:
                    ax.text(start + width / 2, row - 0.15, str(event["mb"]), ha="center", va="center", fontsize=10)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r['rank']} (pp {r['coords']['pp']}, dp {r['coords']['dp']}, tp {r['coords']['tp']})"
                            for r in ranks])  # fmt: skip
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel("time since the step began (ms)")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        shown = [kind for kind in WORDS if any(events(rank, kind) for rank in ranks)]
        handles = [Patch(color=COLOURS[kind], label=WORDS[kind]) for kind in shown]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    return fig
