"""Lesson 10's lab without its check: what the comparison of capacities before the rows' all-to-all prevents.

utils/lesson_10/lab.py compares the ranks' capacities through the store before any row travels. This script runs the
lab's first call with the learner's `shared_capacity` and no comparison: each rank sizes its buffers with its own
answer and runs the solution's padded dispatch. With splits that disagree, gloo aborts the process of a rank that
receives more bytes than it expects (`terminate called after throwing an instance of 'gloo::EnforceNotMet'`,
"Received data size doesn't match expected size"), with no Python exception. The rank with the largest capacity
receives fewer bytes than it expects, returns without an error, and reports what its receive buffer (filled with NaN
first) holds. The notebook runs it through `unguarded(script)`:

    torchrun --nproc_per_node=3 utils/lesson_10/unguarded.py exercises/10_mixture_of_experts.py --metrics-out /dev/null
"""

import json
import operator
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from utils.course import lab as course_lab  # noqa: E402
from utils.course.lessons import lesson  # noqa: E402
from utils.lesson_10.lab import (  # noqa: E402
    CALLS,
    CONFIG,
    EXPERTS,
    RANKS,
    TOP_K,
    everyone,
    expert_parallel_group,
    routing_of,
)

REPORT = "unguarded report: "  # the line the largest-capacity rank prints, then JSON


def padded_rows(engine, sender: int, capacity: int, receiver: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `sender` sends `receiver` in the first call's padded dispatch at `capacity` (the receiver's experts'
    slots, one expert after the other: [E/N x capacity, D], zeros where no token came), and which hold a token."""
    tokens, routing = routing_of(engine, sender, 0)
    _, slots, _ = engine.keep_within_capacity(routing.experts, EXPERTS, 1.0)
    kept = slots < capacity
    token = torch.arange(len(tokens))[:, None].expand_as(routing.experts)
    buffer = tokens.new_zeros(EXPERTS, capacity, CONFIG.dim).index_put((routing.experts[kept], slots[kept]),
                                                                       tokens[token[kept]])  # fmt: skip
    filled = torch.zeros(EXPERTS, capacity, dtype=torch.bool).index_put((routing.experts[kept], slots[kept]),
                                                                         torch.tensor(True))  # fmt: skip
    mine = slice(receiver * EXPERTS // RANKS, (receiver + 1) * EXPERTS // RANKS)
    return buffer[mine].flatten(0, 1), filled[mine].flatten()


def unguarded_rank(lab, group):
    """The first call's capacities without the check: each rank sizes its buffers with its own answer and runs the
    padded dispatch's all-to-all into a buffer filled with NaN. Gloo aborts the ranks that receive more than they
    expect. The rank with the largest capacity receives less from every other rank, and says what it finds."""
    tokens, factor = CALLS[0]
    rank, world_size, engine = lab.rank, lab.world_size, lesson("10")
    answer = lab.learner.shared_capacity(tokens[rank], TOP_K, EXPERTS, factor, group=group, device=torch.device("cpu"))
    capacities = everyone(lab.store, "unguarded/capacity", operator.index(answer), rank, world_size)
    largest = capacities.index(max(capacities))
    # What each rank sends this one, made before the all-to-all: once a peer aborts, torchrun stops this rank too.
    sent = [padded_rows(engine, sender, capacities[sender], rank) for sender in range(world_size)]
    mine, routing = routing_of(engine, rank, 0)
    _, slots, _ = engine.keep_within_capacity(routing.experts, EXPERTS, 1.0)
    received = []

    def into_nan(rows, output_splits, input_splits, group):
        received.append(rows.new_full((sum(output_splits), rows.shape[1]), float("nan")))
        dist.all_to_all_single(received[0], rows.contiguous(), output_splits, input_splits, group=group)
        return received[0]

    others = dist.new_group([r for r in range(world_size) if r != largest])  # every rank creates it, in one order
    everyone(lab.store, "unguarded/ready", True, rank, world_size)
    if rank != largest:
        # Gloo sends a rank's rows once the receiver has said that it waits for them. The largest enters first, so
        # its word reaches the others before they enter, and they enter together (their barrier): each sends it its
        # rows as it enters, before gloo aborts a rank on the rows the largest sends it.
        time.sleep(0.5)
        dist.barrier(group=others)
    with torch.no_grad():
        kept = slots < capacities[rank]
        engine.dispatch_padded(mine, routing, kept, slots, capacities[rank], EXPERTS, into_nan, group)
    if rank != largest:
        return  # only a rank whose splits matched every sender's gets here
    room = EXPERTS // world_size * capacities[rank]  # rows this rank expects from each sender
    report = {"rank": rank, "capacities": capacities, "rows": len(received[0]), "unwritten": 0, "misplaced": 0,
              "as_sent": True}  # fmt: skip
    for sender, (rows, holds_token) in enumerate(sent):
        chunk = received[0][sender * room : (sender + 1) * room]
        report["unwritten"] += int(chunk.isnan().all(dim=1).sum())
        report["as_sent"] &= bool(torch.equal(chunk[: len(rows)], rows))  # the sender's rows, from the chunk's start
        # A row lands under the expert whose slots its place is in here (room / (E/N) slots each), not the sender's.
        place = torch.arange(len(rows))
        report["misplaced"] += int((holds_token & (place // capacities[sender] != place // capacities[rank])).sum())
    print(REPORT + json.dumps(report), flush=True)


def main():
    lab = course_lab.start_rank("10", "shared_capacity", ranks=RANKS)
    unguarded_rank(lab, expert_parallel_group(lab))  # a rank may abort here, or report what it received


def unguarded(script, attempts: int = 3) -> tuple[int, list[str], dict | None]:
    """What the check before the rows' all-to-all prevents: the lab's first call run with `script` (relative to the
    course root) and no check, each rank with its own answer. (torchrun's exit code, gloo's distinct complaints:
    received bytes vs expected, and its message; what the rank with the largest capacity found in its receive buffer,
    or None if it did not report: {"rank", "capacities", "rows", "unwritten" rows still NaN, "misplaced" rows holding
    a token under another expert's slots, "as_sent": whether each sender's rows arrived at its chunk's start}. The
    lab arranges for that rank to receive before any peer aborts, which holds in nearly every run: up to `attempts`
    runs until one reports.)"""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               __file__, str(script), "--metrics-out", os.devnull]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(attempts):  # the report needs the largest rank's all-to-all to return before torchrun stops it
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        reports = [json.loads(line.partition(REPORT)[2]) for line in done.stdout.splitlines() if REPORT in line]
        if reports:
            break
    said = {line.partition("op.nbytes. ")[2] for line in done.stderr.splitlines() if "doesn't match expected" in line}
    return done.returncode, sorted(said), (reports[0] if reports else None)


def report_line(report: dict) -> str:
    """What the largest-capacity rank of an unguarded run found in its receive buffer, in one line."""
    rank, capacities, per_rank = report["rank"], report["capacities"], EXPERTS // len(report["capacities"])
    others = ", ".join(f"{per_rank} x {c} from rank {s}" for s, c in enumerate(capacities) if s != rank)
    return (f"rank {rank} (capacity {capacities[rank]}: room for {per_rank} x {capacities[rank]} rows from each rank) "
            f"received {others}, and its all-to-all returned without an error: {report['unwritten']} of its "
            f"{report['rows']} rows never written (still NaN), {report['misplaced']} rows holding a token under "
            "another expert's slots")  # fmt: skip


if __name__ == "__main__":
    main()
