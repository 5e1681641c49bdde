"""The debugging labs' plumbing: run a lab function on the live ranks, say what each rank did, grade it.

A lesson's lab is a few short multi-rank functions in its script (lesson 01: TODOs 4-8, lesson 02: TODO 12). The same
cases run in the notebook (on live ranks) and in `make check` (tests/workers/lab_check.py), so what the
learner sees in the notebook is what the check grades:

    outcome = run_case(lesson_module, "skip")   # on every rank: {"value": ..., "error": ...}
    ok, lines = verdict("skip", outcomes)       # on one process, with every rank's outcome

Labs run on gloo, CPU tensors, with a short timeout and (but for DDP's case) TORCH_DISTRIBUTED_DEBUG=DETAIL.
Why gloo, even on a GPU node: a collective that only some ranks call makes gloo wait and then raise a timeout on those
ranks, which the lab can show and recover from. NCCL enqueues the collective on the GPU and returns at
once; its watchdog then finds the collective timed out and kills the whole process, so there is nothing
left to inspect. Why DETAIL: gloo aborts the process (SIGABRT) when ranks all-gather different sizes;
DETAIL checks shapes first and raises a readable error on every rank instead.
"""

import argparse
import contextlib
import json
import os
import pickle
import re
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from utils.course.lessons import load_script

LAB_TIMEOUT_S = 5.0  # how long a lab collective waits for a missing rank before it raises
ROOT = Path(__file__).resolve().parents[2]
LESSON_SCRIPT = re.compile(r"^\d\d_\w+\.py$")  # exercises/07_communication_efficient.py, a copy of one, a solution


def _inputs(name: str, rank: int, world_size: int):
    """The case's arguments on `rank`, and the answer every rank must return (from every rank's inputs)."""
    if name == "skip":  # the last rank's batch is empty; the others hold real tokens and padding (-1)

        def batch(r):
            return torch.tensor([] if r == world_size - 1 else [5, 7, -1, 3][: r + 2], dtype=torch.long)

        return (batch(rank),), sum(int((batch(r) >= 0).sum()) for r in range(world_size))
    if name == "raise":  # 2(n-1) values in slices of 2: the last rank's slice is empty; negative, so 0 is wrong
        values = torch.tensor([float((7 * i) % 11 - 20) for i in range(2 * (world_size - 1))])  # all below 0
        return (values,), values.max().item()
    if name == "shapes":  # rank r has r + 1 values

        def values(r):
            return torch.arange(r + 1, dtype=torch.float32) + 100 * r

        return (values(rank),), torch.cat([values(r) for r in range(world_size)]).tolist()
    if name == "swap":
        partner = rank ^ 1
        mine = torch.full((3,), float(rank))
        return (mine,), [float(partner if partner < world_size else rank)] * 3
    if name == "branch":  # each rank's loss falls at its own pace; rank 0's crosses the target first

        def losses(r):
            return [4.0 / (1 + step * (world_size - r) ** 2) for step in range(8)]

        target = 1.0
        means = [sum(losses(r)[step] for r in range(world_size)) / world_size for step in range(8)]
        return (losses(rank), target), next(step + 1 for step, mean in enumerate(means) if mean < target)
    if name == "uneven":  # 3n - 2 samples, one per batch: rank 0 has one batch more than the others
        expected = len(range(world_size - 1, 3 * world_size - 2, world_size))  # the fewest batches of a rank
        if not dist.is_initialized():  # grading only needs the answer
            return None, expected
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(nn.Linear(4, 1))  # DDP broadcasts rank 0's weights
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        samples = [(torch.full((4,), float(i)), torch.tensor([float(i)])) for i in range(3 * world_size - 2)]
        return (model, samples, 1, optimizer), expected
    raise ValueError(f"no lab case {name!r}")


# Which function of the lesson each case calls, and what the learner must get right.
LAB_CASES = {
    # lesson 01: the idea, not the fix (`make hint LESSON=01 TODO=n` gives the steps, then nearly the code)
    "skip": ("count_real_tokens", "a collective completes only once every rank of the group has called it"),
    "raise": ("largest_value", "an empty slice must take part in the maximum with a value that never wins it"),
    "shapes": ("gather_all", "all-gather needs one size on every rank: what must each rank learn first?"),
    "swap": ("swap_with_partner", "a blocking send completes only once its partner receives"),
    "branch": ("steps_until_converged", "every rank must take the same branch: decide from a value they all share"),
    # lesson 02
    "uneven": ("train_one_epoch", "every rank runs as many batches as the rank with the fewest (all-reduce MIN)"),
}


# DDP's own checks crash (SIGSEGV) under a DETAIL set after start-up: the DDP cases run without it.
WITHOUT_DETAIL = {"uneven"}


STUCK = "was stuck waiting for another rank until the timeout (or until a stuck peer gave up)"

# The words of a wait that ended without its partner: gloo's timeout, or a peer that gave up (or crashed) first.
WAITED_IN_VAIN = ("timed out", "Timed out", "Connection closed", "Connection reset")


def describe_error(error: BaseException) -> str:
    text = str(error)
    gist = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else type(error).__name__)
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if missing:  # DETAIL's check before each collective: these ranks never arrived
        return f"waited in a collective for rank {missing.group(1).strip()}, which never joined it"
    if "Detected mismatch between collectives" in text:
        shapes = re.findall(r"Rank (\d+) is running collective: .*?OpType=(\w+), TensorShape=\[([^\]]*)\]", text)
        said = "; ".join(f"rank {r}: {op} of shape [{shape}]" for r, op, shape in shapes)
        return f"DETAIL found a mismatch ({said})"
    if any(words in text for words in WAITED_IN_VAIN) or isinstance(error, dist.DistError):
        return STUCK  # which of the waiting ranks times out first, and which then loses its peer, varies
    return f"raised {type(error).__name__}{where_raised(error)}: {gist[:120]}"


def run_case(lesson, name: str) -> dict:
    """Run case `name` with the lesson module's function on this rank: {"value", "error", "seconds"}."""
    function, _ = LAB_CASES[name]
    args, _ = _inputs(name, dist.get_rank(), dist.get_world_size())
    start = time.perf_counter()
    try:
        value = getattr(lesson, function)(*args)
        value = value.tolist() if isinstance(value, torch.Tensor) else value
        return {"value": value, "error": None, "seconds": time.perf_counter() - start}
    except NotImplementedError as error:
        return {"value": None, "error": f"not done: {error}", "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - the lab reports whatever the learner's code raised
        return {"value": None, "error": describe_error(error), "seconds": time.perf_counter() - start}


def verdict(name: str, outcomes: list[dict]) -> tuple[bool, list[str]]:
    """(passed, one line per rank): each rank's result or error, and whether it is the expected answer."""
    function, _ = LAB_CASES[name]
    lines, passed = [], True
    for rank, outcome in enumerate(outcomes):
        _, expected = _inputs(name, rank, len(outcomes))
        if outcome["error"]:
            lines.append(f"rank {rank}: {function} {outcome['error']}")
            passed = False
        elif not _same(outcome["value"], expected):
            lines.append(f"rank {rank}: {function} returned {outcome['value']!r}, not {expected!r}")
            passed = False
        else:
            lines.append(f"rank {rank}: {function} returned {outcome['value']!r} (right)")
    return passed, lines


def _same(value, expected) -> bool:
    if isinstance(expected, list):
        same_length = isinstance(value, list) and len(value) == len(expected)
        return same_length and all(_same(v, e) for v, e in zip(value, expected))
    return isinstance(value, (int, float)) and abs(value - expected) < 1e-9


def hint(name: str) -> str:
    return LAB_CASES[name][1]


def first_cause(lines: list[str]) -> str:
    """The line closest to the cause: a rank that raised, then a mismatch, a wait, a wrong value, a lost peer."""
    order = ("raised", "mismatch", "never joined", "not done", "returned", "stuck")
    failing = [line for line in lines if not line.endswith("(right)")]
    return min(failing, key=lambda line: next((i for i, w in enumerate(order) if w in line), len(order)), default="")


# What a known mistake leaves in the record, case by case: the cause a failing check names (the notebook shows the
# ranks' lines only: finding the cause is the lab).
def _inputs_of(case: str, outcomes: list[dict]) -> list:
    """Each rank's (arguments, expected answer) of the lab case, as run_case gave them to the ranks."""
    return [_inputs(case, rank, len(outcomes)) for rank in range(len(outcomes))]


def _left_without_joining(outcomes: list[dict]) -> str | None:
    """A rank that returned while others waited in a collective: it skipped the collective they wait in."""
    waiting = any(o["error"] and ("never joined" in o["error"] or "stuck" in o["error"]) for o in outcomes)
    left = [rank for rank, o in enumerate(outcomes) if o["error"] is None]
    if waiting and left:
        return f"rank {left[0]} returned without calling the collective the other ranks wait in"
    return None


def _skip_cause(outcomes):
    everything = sum(len(args[0]) for args, _ in _inputs_of("skip", outcomes))
    if all(o["value"] == everything for o in outcomes):
        return f"{everything} counts the padding (-1) as tokens too"
    return _left_without_joining(outcomes)


def _raise_cause(outcomes):
    (values,), _ = _inputs_of("raise", outcomes)[0]
    per_rank = -(-len(values) // len(outcomes))  # the lab's slices: ceil(numel / n) values each
    raised = [r for r, o in enumerate(outcomes) if "raised" in (o["error"] or "")]
    if raised and all(r * per_rank >= len(values) for r in raised):
        return f"rank {raised[0]}'s slice of the values is empty"
    if all(o["value"] == 0.0 for o in outcomes):
        return "0 is what an empty slice brought, and it beats every value here (all are negative)"
    return None


def _shapes_cause(outcomes):
    args = [a[0][0].tolist() for a in _inputs_of("shapes", outcomes)]
    longest = max(map(len, args))
    padded = [v + [0.0] * (longest - len(v)) for v in args]
    if all(o["value"] == sum(padded, []) for o in outcomes):
        return "the padding is still in: each rank's row must be cut to that rank's length"
    if any(o["value"] == sum((row[: len(mine)] for row in padded), []) for o, mine in zip(outcomes, args)):
        return "each rank cut every row to its own length, not to the length of the rank the row came from"
    if any("mismatch" in (o["error"] or "") for o in outcomes):
        return "each rank all-gathered a tensor of its own length: the lengths must be the same on every rank"
    return None


def _swap_cause(outcomes):
    paired = outcomes[: len(outcomes) // 2 * 2]
    if paired and all(o["error"] and "stuck" in o["error"] for o in paired):
        return "both partners of a pair waited in the same direction (both in send, or both in recv)"
    return None


def _branch_cause(outcomes):
    left = _left_without_joining(outcomes)
    if left:
        return left + ": it stopped on its own loss"
    everyone = _inputs_of("branch", outcomes)
    (_, target), _ = everyone[0]
    sums = [sum(args[0][step] for args, _ in everyone) for step in range(len(everyone[0][0][0]))]
    summed = next((step + 1 for step, total in enumerate(sums) if total < target), len(sums))
    if all(o["value"] == summed for o in outcomes):
        return f"step {summed} is where the sum of the ranks' losses (not their mean) falls below the target"
    return None


def _uneven_cause(outcomes):
    stuck = [rank for rank, o in enumerate(outcomes) if o["error"]]
    done = [rank for rank, o in enumerate(outcomes) if o["error"] is None]
    if stuck and done:  # ranks that finished while another waits in DDP's all-reduce: that one ran more batches
        return f"rank {stuck[0]} ran a batch more than ranks {done}, which had returned and never joined its all-reduce"
    return None


_CAUSES = {"skip": _skip_cause, "raise": _raise_cause, "shapes": _shapes_cause, "swap": _swap_cause,
           "branch": _branch_cause, "uneven": _uneven_cause}  # fmt: skip


def likely_cause(name: str, outcomes: list[dict]) -> str | None:
    """The cause of a failed case when the ranks' outcomes are what a known mistake gives, else None."""
    return _CAUSES[name](outcomes)


def failure(name: str, outcomes: list[dict], todo: int) -> str | None:
    """None when the case passed; else the check's message: the TODO, the rank closest to the cause, the likely
    cause (else a hint), then what every rank did."""
    passed, lines = verdict(name, outcomes)
    if passed:
        return None
    cause = likely_cause(name, outcomes)
    explained = f": {cause}" if cause else f". Hint: {hint(name)}"
    return f"TODO {todo}: {first_cause(lines)}{explained}.\nEvery rank:\n" + "\n".join(lines)


@contextlib.contextmanager
def outermost_calls(record):
    """Run the code inside with `record(frame)` asked about each Python call it makes, as the call starts (before it
    can block), with its arguments in frame.f_locals however the code spells the call. A profile hook does it. When
    `record` returns True the call is noted, and the calls it makes in turn are not asked about until it returns
    (dist.send calls isend, all_gather_object calls all_gather, dcp.save its own machinery: not the learner's)."""
    inside = []  # the frame of the call being noted, while it runs

    def hook(frame, event, arg):
        if inside:
            if event == "return" and frame is inside[0]:
                inside.clear()
        elif event == "call" and record(frame):
            inside.append(frame)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


def describe_lab_error(error: BaseException, stuck: str, width: int = 120) -> str:
    """A live lab rank's error in one line: `stuck` for a wait that ended without its partner (which waiting rank
    gives up first, and which then loses its peer, varies from run to run), else the exception's first line."""
    text = str(error)
    if any(words in text for words in WAITED_IN_VAIN):
        return stuck
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"raised {type(error).__name__}{where_raised(error)}: {first[:width]}"


def where_raised(error: BaseException) -> str:
    """Which line of a lesson script raised `error`, as " at exercises/07_...py:460 (`k = k.item()`)": the innermost
    frame in a lesson script (an error raised inside torch is still the learner's call that made it), else ""."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if LESSON_SCRIPT.match(Path(f.filename).name)]
    if not frames:
        return ""
    path, code = Path(frames[-1].filename).resolve(), (frames[-1].line or "").split("  # ")[0].strip()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    code = code if len(code) <= 60 else code[:57] + "..."
    return f" at {shown}:{frames[-1].lineno}" + (f" (`{code}`)" if code else "")


def failure_message(lines: list[str], todo: int, hint: str) -> str:
    """A failed lab's check message from its verdict's lines (one per rank, then "why: <cause>" lines): the TODO, the
    causes (else the first rank not right), a hint, then every line."""
    causes = [line.removeprefix("why: ") for line in lines if line.startswith("why: ")]
    cause = "; ".join(causes) if causes else next(line for line in lines if not line.endswith("(right)"))
    return f"TODO {todo}: {cause}. Hint: {hint}.\nEvery rank:\n" + "\n".join(lines)


def write_outcomes(store, rank: int, world_size: int, outcome: dict, record: dict, path) -> None:
    """After a live lab run: once every rank is done, gather each rank's outcome in a fresh gloo group (the lab's
    own may be broken) and have rank 0 write {**record, "ranks": [every rank's outcome]} as JSON to `path`."""
    wait_for_everyone(store, "lab/end", world_size, timeout_s=60)
    dist.init_process_group("gloo", store=dist.PrefixStore("lab/results/", store), rank=rank, world_size=world_size)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    if rank == 0:
        path.write_text(json.dumps({**record, "ranks": everyone}))


def wait_for_everyone(store, key: str, world_size: int, timeout_s: float = 120):
    """A barrier outside the process group (which a failed lab case may have broken): count arrivals in the store."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {key} within {timeout_s} s")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# A live lab rank (utils/lesson_NN/lab.py, under torchrun): its start, the same in every lesson
# --------------------------------------------------------------------------------------------------


@dataclass
class LabRank:
    learner: ModuleType  # the learner's lesson script, loaded afresh
    store: dist.Store  # torchrun's store: it outlives a broken process group, so the ranks can still report
    rank: int
    world_size: int
    metrics_out: Path  # where rank 0 writes every rank's outcome (write_outcomes)
    timeout_s: float | None  # --timeout: the group's timeout made longer, to look at a hang (python -m utils.stacks)


def start_rank(lesson_number: str, function: str, timeout_option: bool = False, ranks: int | None = None) -> LabRank:
    """Parse the lab's command line (the lesson script whose `function` runs, --metrics-out, and --timeout where the
    lab's words follow it), refuse another world size than `ranks` where the lab needs that many, keep to CPU tensors
    even on a GPU node (CUDA is not started yet), connect to torchrun's store and load the learner's script."""
    parser = argparse.ArgumentParser(description=f"Lesson {lesson_number}'s debugging lab on live ranks")
    parser.add_argument("lesson", type=Path, help=f"the lesson script whose {function} is run")
    parser.add_argument("--metrics-out", type=Path, required=True, help="where rank 0 writes every rank's outcome")
    if timeout_option:
        parser.add_argument("--timeout", type=float, help="seconds a rank waits in vain (longer than the lab's own "
                            "to look at a hang with `python -m utils.stacks`)")  # fmt: skip
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if ranks is not None and world_size != ranks:
        raise SystemExit(f"the lab runs on {ranks} ranks (--nproc_per_node={ranks}), not {world_size}")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)
    learner = load_script(args.lesson.resolve(), "lab_lesson")
    return LabRank(learner, store, rank, world_size, args.metrics_out, getattr(args, "timeout", None))


def join_lab_group(store, rank: int, world_size: int, timeout_s: float = LAB_TIMEOUT_S):
    """The gloo group the lab's case runs in, with a short timeout: a rank left waiting raises in seconds."""
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("lab/run/", store), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The flight recorder: each rank's last collectives, kept by torch (gloo too), shown side by side
# --------------------------------------------------------------------------------------------------

RECORDED = 16  # collectives each rank keeps: a lab's last steps and where the ranks parted


def record_collectives(entries: int = RECORDED) -> None:
    """Have torch's flight recorder keep this process's last `entries` collectives. Call it before the first process
    group is made: torch reads TORCH_FR_BUFFER_SIZE once, when it makes the recorder (utils/stacks.py says more)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def recent_collectives(last: int = 8) -> list[dict]:
    """This rank's last `last` collectives in its latest group, oldest first: {"name", "seq", "sizes"}. On gloo the
    record stays in the process (no file is written on a timeout), so the lab reads it here and reports it."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:  # a torch build without the flight recorder's dump: nothing to report
        return []
    entries = pickle.loads(dump()).get("entries", [])
    group = entries[-1]["process_group"] if entries else None  # sequence numbers count within one group
    return [
        {"name": e["profiling_name"], "seq": e["collective_seq_id"], "sizes": e["input_sizes"]}
        for e in entries if e["process_group"] == group
    ][-last:]  # fmt: skip


def collectives_side_by_side(records: list[list[dict]], rows: int = 4) -> list[str]:
    """Every rank's recent collectives (recent_collectives, one list a rank) as a table of the last `rows` sequence
    numbers (the n-th collective of the group, the same n on every rank that called it), a column per rank, "-" where
    a rank recorded none."""
    seqs = sorted({entry["seq"] for entries in records for entry in entries})[-rows:]
    cells = [{e["seq"]: f"{e['name']} {'+'.join(map(str, e['sizes']))}" for e in entries} for entries in records]
    table = [["seq"] + [f"rank {rank}" for rank in range(len(records))]]
    table += [[str(seq)] + [by_seq.get(seq, "-") for by_seq in cells] for seq in seqs]
    widths = [max(len(row[col]) for row in table) for col in range(len(table[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
