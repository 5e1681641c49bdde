"""Lesson 10's debugging lab (TODO 6): padded buffers that do not match.

The padded dispatch (dispatch_padded) sends E/N x capacity rows to every rank and expects as many from each: the
all-to-all's splits are right only if every rank uses the same capacity. The lesson's training gives every rank as
many tokens; in production the ranks often hold different numbers (batches packed to a token budget, an epoch's last
batch, padding removed). The lesson's `shared_capacity(n_tokens, k, n_experts, capacity_factor, group)` is the
capacity a rank uses. Here three ranks hold 10, 16 and 7 tokens and call the learner's `shared_capacity` in a gloo
group with a 5 s timeout (a collective that some rank never joins ends in seconds). The ranks then compare, through
torchrun's store, the capacity each will use. Only if they all agree do they run the rows' all-to-all: the solution's
padded dispatch, experts and combine (lesson("10"), not the learner's TODOs) with the learner's capacity; each rank
compares its output with one process's. Why compare first: with splits that disagree gloo aborts the process of a
rank that receives more bytes than it expects (`terminate called after throwing an instance of 'gloo::EnforceNotMet'`,
"Received data size doesn't match expected size"), with no Python exception, while a rank that expects more than
arrives returns without an error, the rest of its buffer never written. Rank 0 writes every rank's outcome.
`unguarded(script)` runs the same ranks without the check, to show that. The notebook and `make check` run the same
file:

    torchrun --nproc_per_node=3 utils/lesson_10/lab.py exercises/10_mixture_of_experts.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause
"""

import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from utils.course import lab as course_lab  # noqa: E402
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402
from utils.lesson_10.reference import build_experts, build_router, keep_first, queue_order  # noqa: E402
from utils.model import ModelConfig  # noqa: E402

TOKENS = (10, 16, 7)  # each rank's tokens: different, as after packing to a token budget
EXPERTS, TOP_K, FACTOR = 6, 2, 1.0  # two experts per rank, top-2, capacity factor 1
CONFIG = ModelConfig(seq_len=16, dim=8, n_heads=2, n_layers=1)  # the router's and experts' shapes (hidden 32)
TIMEOUT_S = 5.0  # how long a rank waits in a collective before gloo gives up
TOLERANCE = 1e-5  # the output against one process's (fp32: batched matmuls against one expert at a time)
STUCK = f"waited until gloo's {TIMEOUT_S:.0f} s timeout (or until a peer gave up)"
C10D = dist.distributed_c10d.__file__  # where torch.distributed's collectives are defined
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "all_to_all",
               "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "barrier"}  # fmt: skip
HINT = "take a pair of ranks: how many rows the first sends the second, how many the second expects, and from what"


def capacity_for(n_tokens) -> int:
    """The lesson's capacity (TODO 2) for a group of n_tokens tokens: C x T x k / E, rounded up."""
    return math.ceil(FACTOR * n_tokens * TOP_K / EXPERTS)


# The capacity every rank must use: the one the rank with the most tokens needs, which is the capacity factor's
# promise (each expert takes C times its even share of a rank's choices) kept on every rank. Taken from the sum of the
# counts, every rank would agree too, but with N times the buffers and bytes the factor asks for (and fewer drops);
# from the smallest count, the busier ranks would drop choices the factor keeps. Both are graded as wrong.
EXPECTED = capacity_for(max(TOKENS))


def routing_of(engine, rank: int):
    """Rank `rank`'s tokens [T, D] and the solution's routing of them (TODO 1's, not the learner's)."""
    tokens = torch.randn(TOKENS[rank], CONFIG.dim, generator=torch.Generator().manual_seed(100 + rank))
    router = build_router(CONFIG, EXPERTS, seed=0, layer=0)
    return tokens, engine.route(router(tokens), TOP_K)


def experts_of(engine, experts: range):
    """The solution's Experts module holding `experts` (each built from its own seed, as the lesson's are)."""
    return engine.Experts(build_experts(CONFIG, seed=0, layer=0, experts=experts))


def one_process(engine, rank: int) -> torch.Tensor:
    """Rank `rank`'s output on one process, one choice at a time: each expert keeps the first EXPECTED choices of its
    queue (every token's first choice, then every second), and each kept choice's expert output, times its gate, is
    added to its token."""
    tokens, routing = routing_of(engine, rank)
    kept = keep_first(routing.experts, EXPECTED, queue_order(len(tokens), TOP_K))
    output = torch.zeros_like(tokens)
    for t, i in kept.nonzero().tolist():
        expert = experts_of(engine, range(int(routing.experts[t, i]), int(routing.experts[t, i]) + 1))
        output[t] += expert(tokens[t][None, None])[0, 0] * routing.gates[t, i]
    return output


def padded_step(engine, capacity: int, rank: int, group) -> tuple[torch.Tensor, int]:
    """The solution's padded dispatch, this rank's experts and the solution's combine, with `capacity` on this rank:
    (its output [T, D], the choices it kept)."""
    tokens, routing = routing_of(engine, rank)
    _, slots, _ = engine.keep_within_capacity(routing.experts, EXPERTS, FACTOR)  # the slots; the capacity is ours
    kept = slots < capacity
    per_rank = EXPERTS // dist.get_world_size(group)
    mine = experts_of(engine, range(rank * per_rank, (rank + 1) * per_rank))
    received = engine.dispatch_padded(tokens, routing, kept, slots, capacity, EXPERTS, engine.exchange_scratch, group)
    results = mine(received)
    output = engine.combine_padded(results, routing, kept, slots, capacity, EXPERTS, engine.exchange_scratch, group)
    return output, int(kept.sum())


def collectives(calls: list, group):
    """For outermost_calls: append [name, whether it named `group`] for each torch.distributed collective called (the
    outermost only: all_gather_object calls all_gather itself)."""

    def record(frame) -> bool:
        if frame.f_code.co_filename != C10D or frame.f_code.co_name not in COLLECTIVES:
            return False
        calls.append([frame.f_code.co_name, frame.f_locals.get("group") is group])
        return True

    return record


def as_capacity(value) -> int | str:
    """The learner's answer as a whole number of slots, or what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        shown = value.tolist() if isinstance(value, torch.Tensor) else value
        return f"returned {shown!r} ({kind}), not an int: a buffer's slots and the all-to-all's splits are counts"
    return value


def run_rank(shared_capacity, store, rank: int, world_size: int, group) -> dict:
    """This rank's part: the learner's capacity, the check of every rank's through the store, then (if they all
    agree) the rows' all-to-all."""
    outcome = {"tokens": TOKENS[rank], "capacity": None, "error": None, "calls": [], "agreed": False,
               "difference": None, "kept": None}  # fmt: skip
    try:
        with course_lab.outermost_calls(collectives(outcome["calls"], group)):
            answer = as_capacity(shared_capacity(TOKENS[rank], TOP_K, EXPERTS, FACTOR, group=group))
        outcome["capacity" if isinstance(answer, int) else "error"] = answer
    except NotImplementedError as error:
        outcome["error"] = f"not done: {error}"
    except Exception as error:  # noqa: BLE001 - a timeout, a peer that gave up, or the learner's code raising
        outcome["error"] = course_lab.describe_lab_error(error, STUCK)
    store.set(f"lab/capacity/{rank}", json.dumps(outcome["capacity"]))  # the store: the group may be broken
    course_lab.wait_for_everyone(store, "lab/capacities", world_size, timeout_s=60)
    everyone = [json.loads(store.get(f"lab/capacity/{r}")) for r in range(world_size)]
    outcome["agreed"] = everyone[0] is not None and len(set(everyone)) == 1  # the same decision on every rank
    if outcome["agreed"]:
        engine = lesson("10")
        try:
            with torch.no_grad():  # forward only: the lab is about the splits
                output, outcome["kept"] = padded_step(engine, outcome["capacity"], rank, group)
                outcome["difference"] = float((output - one_process(engine, rank)).abs().max())
        except Exception as error:  # noqa: BLE001 - reported, not raised: the other ranks must still report
            outcome["error"] = course_lab.describe_lab_error(error, STUCK)
    return outcome


def main():
    unguarded = "--unguarded" in sys.argv  # unguarded(): the rows' all-to-all without the check, to see it fail
    if unguarded:
        sys.argv.remove("--unguarded")
    lab = course_lab.start_rank("10", "shared_capacity")
    store, rank, world_size = lab.store, lab.rank, lab.world_size
    if world_size != len(TOKENS):
        raise SystemExit(f"the lab runs on {len(TOKENS)} ranks (--nproc_per_node={len(TOKENS)}), not {world_size}")
    started = time.perf_counter()
    course_lab.join_lab_group(store, rank, world_size, TIMEOUT_S)
    # The expert-parallel group: the same ranks as the world here, but its own group, as in a job where EP is one
    # dimension of several (lesson 06's grid): a collective must name it.
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=TIMEOUT_S))
    if unguarded:
        capacity = lab.learner.shared_capacity(TOKENS[rank], TOP_K, EXPERTS, FACTOR, group=group)
        with torch.no_grad():
            padded_step(lesson("10"), capacity, rank, group)  # a rank may abort here, another raise, or none
        return
    outcome = run_rank(lab.learner.shared_capacity, store, rank, world_size, group)
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"expected": EXPECTED, "per_rank": EXPERTS // world_size, "tolerance": TOLERANCE, "k": TOP_K,
              "experts": EXPERTS, "capacity_factor": FACTOR}  # fmt: skip
    course_lab.write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


def unguarded(script) -> tuple[int, list[str]]:
    """What the check before the rows' all-to-all prevents: the lab run with `script` (relative to the course root)
    and no check, each rank with its own answer. (torchrun's exit code, gloo's distinct complaints: received bytes vs
    expected, and its message.)"""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(TOKENS)}",
               __file__, str(script), "--unguarded", "--metrics-out", os.devnull]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = {line.partition("op.nbytes. ")[2] for line in done.stderr.splitlines() if "doesn't match expected" in line}
    return done.returncode, sorted(said)


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def rank_line(rank: int, outcome: dict, record: dict) -> str:
    head, per_rank = f"rank {rank} ({outcome['tokens']} tokens): ", record["per_rank"]
    if outcome["capacity"] is None:
        return head + f"shared_capacity {outcome['error']}"
    capacity = outcome["capacity"]
    head += f"capacity {capacity}, so it sends {per_rank} x {capacity} rows to every rank and expects as many"
    if not outcome["agreed"]:
        return head + "; the ranks' capacities differ, so the rows' all-to-all did not run"
    if outcome["error"]:
        return head + f"; the rows' all-to-all {outcome['error']}"
    kept = f"keeps {outcome['kept']} of its {outcome['tokens'] * record['k']} choices"
    if outcome["difference"] > record["tolerance"]:
        return head + f"; it {kept}, and its output differs from one process's by {outcome['difference']:.1e}"
    if capacity != record["expected"]:
        return head + f"; it {kept}, its output equals one process's, but its buffers are not the capacity factor's"
    if not all(named for _, named in outcome["calls"]):
        return head + f"; it {kept}, its output equals one process's, but a collective ran outside `group`"
    return head + f"; it {kept}, and its output equals one process's (right)"


def mismatches(ranks: list, per_rank: int) -> list[str]:
    """What the rows' all-to-all would do with these capacities, for each receiving rank: gloo aborts a rank that
    receives more than it expects (named with the largest sender); one that receives less goes on with slots never
    written (named with the smallest)."""
    said = []
    for receiver, receiving in enumerate(ranks):
        expected = receiving["capacity"]
        sizes = {sender: sending["capacity"] for sender, sending in enumerate(ranks)}
        sender = max(sizes, key=sizes.get) if max(sizes.values()) > expected else min(sizes, key=sizes.get)
        sent = sizes[sender]
        if sent == expected:
            continue
        what = (f"gloo would abort rank {receiver}" if sent > expected else
                f"rank {receiver} would go on with {per_rank} x {expected - sent} slots never written")  # fmt: skip
        said.append(f"rank {sender} would send {per_rank} x {sent} rows to rank {receiver}, which expects "
                    f"{per_rank} x {expected}: {what}")  # fmt: skip
    return sorted(said, key=lambda line: "abort" not in line)  # the crashes first


def causes(record: dict) -> list[str]:
    """Why the lab failed, in the learner's terms, when the ranks' outcomes are what a known mistake gives."""
    ranks, expected, per_rank = record["ranks"], record["expected"], record["per_rank"]
    tokens = [outcome["tokens"] for outcome in ranks]
    capacities = [outcome["capacity"] for outcome in ranks]
    if None in capacities:
        stuck = [rank for rank, outcome in enumerate(ranks) if outcome["error"] == STUCK]
        if stuck and len(stuck) < len(ranks):
            return [f"ranks {stuck} waited in a collective that rank "
                    f"{next(r for r in range(len(ranks)) if r not in stuck)} never called: every rank must call "
                    "the same collectives"]  # fmt: skip
        return []
    found = []
    if len(set(capacities)) > 1:
        own = [capacity_for(count) for count in tokens]
        if capacities == own:
            counts, theirs = ", ".join(map(str, tokens)), ", ".join(map(str, own))
            found.append(f"each rank's capacity comes from its own token count ({counts} tokens -> {theirs}), but the "
                         "splits must be the same on every rank of the group")  # fmt: skip
        return found + mismatches(ranks, per_rank)
    capacity = capacities[0]
    largest = f"C x {max(tokens)} tokens (the most any rank holds) x k / E rounded up is {expected}"
    if capacity == capacity_for(sum(tokens)):
        found.append(f"every rank uses capacity {capacity}, that of {sum(tokens)} tokens, the sum of the ranks' "
                     f"counts: nothing crashes, but {largest}; each buffer is {capacity / expected:.1f} times the "
                     "factor's, and grows with the number of ranks")  # fmt: skip
    elif capacity == capacity_for(min(tokens)):
        found.append(f"every rank uses capacity {capacity}, that of {min(tokens)} tokens, the fewest any rank holds: "
                     f"the busier ranks drop choices the capacity factor keeps ({largest})")  # fmt: skip
    elif capacity == math.floor(record["capacity_factor"] * max(tokens) * record["k"] / record["experts"]):
        found.append(f"every rank uses capacity {capacity}: the largest count's capacity rounded down, where {largest}")
    elif capacity != expected:
        found.append(f"every rank uses capacity {capacity}, where {largest}")
    if any(not named for outcome in ranks for _, named in outcome["calls"]):
        name = next(name for outcome in ranks for name, named in outcome["calls"] if not named)
        found.append(f"shared_capacity's {name} did not name `group`: it ran over every rank of the job (the same "
                     "three here); with several expert-parallel groups it would mix in the other groups' ranks, or "
                     "wait for ranks busy elsewhere")  # fmt: skip
    return found


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rank, then "why:" lines): each rank's capacity, its splits, and its output."""
    lines = [rank_line(rank, outcome, record) for rank, outcome in enumerate(record["ranks"])]
    passed = all(line.endswith("(right)") for line in lines)
    return passed, lines + ([] if passed else [f"why: {cause}" for cause in causes(record)])


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    return None if passed else course_lab.failure_message(lines, todo, HINT)


if __name__ == "__main__":
    main()
