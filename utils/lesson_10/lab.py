"""Lesson 10's debugging lab (TODO 6): padded buffers that do not match.

The lesson's training gives every rank as many tokens; in production the ranks often hold different numbers (batches
packed to a token budget, an epoch's last batch, padding removed). The lesson's `shared_capacity(n_tokens, k,
n_experts, capacity_factor, group, device)` is the capacity a rank uses. Here three ranks call the learner's
`shared_capacity` twice in one launch (CALLS: each call's token counts and capacity factor; the second has its most
tokens on another rank, and another factor), in a gloo group with a 5 s timeout (a collective that some rank never
joins ends in seconds). After each call the ranks compare, through torchrun's store, the capacity each will use. Only
if they all agree do they run the rows' all-to-all: the solution's padded dispatch, experts and combine
(lesson("10"), not the learner's TODOs) with the learner's capacity; each rank compares its output with one
process's. Why compare first: with splits that disagree gloo aborts the process of a rank that receives more bytes
than it expects (`terminate called after throwing an instance of 'gloo::EnforceNotMet'`, "Received data size doesn't
match expected size"), with no Python exception; utils/lesson_10/unguarded.py runs the first call without the check,
to show that. Rank 0 writes every rank's outcome. The notebook and `make check` run the
same file:

    torchrun --nproc_per_node=3 utils/lesson_10/lab.py exercises/10_mixture_of_experts.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause
"""

import json
import math
import operator
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

# Each call: (every rank's tokens, the capacity factor), different counts as after packing to a token budget. The
# first call's answer is the capacity of rank 1's 16 tokens at factor 1. The second's busiest rank is rank 0, its
# factor 2: its answer differs from its own floor and from the capacity without the factor, from those of the sum,
# the mean, the smallest count and rank 1's count, from the first call's answer and from the capacity of the first
# call's largest count (tests/test_10 checks it), so a number fitted to the first call fails the second.
CALLS = (((10, 16, 7), 1.0), ((14, 11, 5), 2.0))
RANKS = len(CALLS[0][0])
EXPERTS, TOP_K = 6, 2  # two experts per rank, top-2
CONFIG = ModelConfig(seq_len=16, dim=8, n_heads=2, n_layers=1)  # the router's and experts' shapes (hidden 32)
TIMEOUT_S = 5.0  # how long a rank waits in a collective before gloo gives up
TOLERANCE = 1e-5  # the output against one process's (fp32: batched matmuls against one expert at a time)
STUCK = f"waited until gloo's {TIMEOUT_S:.0f} s timeout (or until a peer gave up)"
C10D = dist.distributed_c10d.__file__  # where torch.distributed's collectives are defined
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "all_to_all",
               "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "barrier"}  # fmt: skip
BROADCASTS = {"broadcast", "broadcast_object_list", "scatter"}  # one rank's value to every rank
HINT = "take a pair of ranks: how many rows the first sends the second, how many the second expects, and from what"


def capacity_for(n_tokens, factor: float) -> int:
    """The lesson's capacity (TODO 2) for a group of n_tokens tokens: C x T x k / E, rounded up."""
    return math.ceil(factor * n_tokens * TOP_K / EXPERTS)


# The capacity every rank must use: the one the rank with the most tokens needs, which is the capacity factor's
# promise (each expert takes C times its even share of a rank's choices) kept on every rank. Taken from the sum of the
# counts, every rank would agree too, but with buffers that grow with the number of ranks (and fewer drops); from the
# mean or the smallest count, the busier ranks would drop choices the factor keeps. All are graded as wrong.
def expected(call: int) -> int:
    tokens, factor = CALLS[call]
    return capacity_for(max(tokens), factor)


def routing_of(engine, rank: int, call: int):
    """Rank `rank`'s tokens [T, D] in call `call` and the solution's routing of them (TODO 1's, not the learner's)."""
    generator = torch.Generator().manual_seed(100 + 10 * call + rank)
    tokens = torch.randn(CALLS[call][0][rank], CONFIG.dim, generator=generator)
    router = build_router(CONFIG, EXPERTS, seed=0, layer=0)
    return tokens, engine.route(router(tokens), TOP_K)


def experts_of(engine, experts: range):
    """The solution's Experts module holding `experts` (each built from its own seed, as the lesson's are)."""
    return engine.Experts(build_experts(CONFIG, seed=0, layer=0, experts=experts))


def one_process(engine, rank: int, call: int) -> torch.Tensor:
    """Rank `rank`'s output in call `call` on one process, one choice at a time: each expert keeps the first
    expected(call) choices of its queue (every token's first choice, then every second), and each kept choice's expert
    output, times its gate, is added to its token."""
    tokens, routing = routing_of(engine, rank, call)
    kept = keep_first(routing.experts, expected(call), queue_order(len(tokens), TOP_K))
    output = torch.zeros_like(tokens)
    for t, i in kept.nonzero().tolist():
        expert = experts_of(engine, range(int(routing.experts[t, i]), int(routing.experts[t, i]) + 1))
        output[t] += expert(tokens[t][None, None])[0, 0] * routing.gates[t, i]
    return output


def padded_step(engine, capacity: int, rank: int, call: int, group) -> tuple[torch.Tensor, int, int]:
    """The solution's padded dispatch, this rank's experts and the solution's combine, with `capacity` on this rank:
    (its output [T, D], the choices it kept, the choices the right capacity keeps)."""
    tokens, routing = routing_of(engine, rank, call)
    _, slots, _ = engine.keep_within_capacity(routing.experts, EXPERTS, 1.0)  # the slots; the capacity is ours
    kept = slots < capacity
    per_rank = EXPERTS // dist.get_world_size(group)
    mine = experts_of(engine, range(rank * per_rank, (rank + 1) * per_rank))
    received = engine.dispatch_padded(tokens, routing, kept, slots, capacity, EXPERTS, engine.exchange_scratch, group)
    results = mine(received)
    output = engine.combine_padded(results, routing, kept, slots, capacity, EXPERTS, engine.exchange_scratch, group)
    return output, int(kept.sum()), int((slots < expected(call)).sum())


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
    """The learner's answer as a whole number of slots (an int, or any integer such as NumPy's), or what is wrong with
    it. A tensor is refused, even one that holds an integer: the splits are Python ints, and `int(t)` on a GPU waits
    for the device."""
    if not isinstance(value, (bool, torch.Tensor)):
        try:
            return operator.index(value)  # an int, or a NumPy integer
        except TypeError:
            pass
    kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
    shown = value.tolist() if isinstance(value, torch.Tensor) else value
    return f"returned {shown!r} ({kind}), not an int: a buffer's slots and the all-to-all's splits are counts"


def everyone(store, key: str, value, rank: int, world_size: int) -> list:
    """Every rank's `value` (JSON), exchanged through the store: the group may be broken."""
    store.set(f"{key}/{rank}", json.dumps(value))
    course_lab.wait_for_everyone(store, key, world_size, timeout_s=60)
    return [json.loads(store.get(f"{key}/{r}")) for r in range(world_size)]


def run_call(shared_capacity, store, rank: int, world_size: int, group, call: int) -> dict:
    """This rank's part of call `call`: the learner's capacity, the check of every rank's through the store, then (if
    they all agree) the rows' all-to-all."""
    tokens, factor = CALLS[call]
    outcome = {"tokens": tokens[rank], "capacity": None, "error": None, "collectives": [], "agreed": False,
               "difference": None, "kept": None, "kept_right": None}  # fmt: skip
    try:
        with course_lab.outermost_calls(collectives(outcome["collectives"], group)):
            answer = shared_capacity(tokens[rank], TOP_K, EXPERTS, factor, group=group, device=torch.device("cpu"))
        answer = as_capacity(answer)
        outcome["capacity" if isinstance(answer, int) else "error"] = answer
    except NotImplementedError as error:
        outcome["error"] = f"not done: {error}"
    except Exception as error:  # noqa: BLE001 - a timeout, a peer that gave up, or the learner's code raising
        outcome["error"] = course_lab.describe_lab_error(error, STUCK)
    capacities = everyone(store, f"lab/{call}/capacity", outcome["capacity"], rank, world_size)
    outcome["agreed"] = capacities[0] is not None and len(set(capacities)) == 1  # the same decision on every rank
    if outcome["agreed"]:
        engine = lesson("10")
        try:
            with torch.no_grad():  # forward only: the lab is about the splits
                output, outcome["kept"], outcome["kept_right"] = padded_step(engine, capacities[0], rank, call, group)
                outcome["difference"] = float((output - one_process(engine, rank, call)).abs().max())
        except Exception as error:  # noqa: BLE001 - reported, not raised: the other ranks must still report
            outcome["error"] = course_lab.describe_lab_error(error, STUCK)
    return outcome


def run_rank(shared_capacity, store, rank: int, world_size: int, group) -> dict:
    """This rank's part: each call in turn, until one leaves a rank with an error (the group may be broken then)."""
    outcome = {"calls": []}
    for call in range(len(CALLS)):
        outcome["calls"].append(run_call(shared_capacity, store, rank, world_size, group, call))
        if not all(everyone(store, f"lab/{call}/clean", outcome["calls"][-1]["error"] is None, rank, world_size)):
            break
    return outcome


def expert_parallel_group(lab):
    """The lab's gloo group (5 s timeout), then the expert-parallel group: the same ranks as the world here, but its
    own group, as in a job where EP is one dimension of several (lesson 06's grid): a collective must name it."""
    course_lab.join_lab_group(lab.store, lab.rank, lab.world_size, TIMEOUT_S)
    return dist.new_group(list(range(lab.world_size)), timeout=timedelta(seconds=TIMEOUT_S))


def main():
    lab = course_lab.start_rank("10", "shared_capacity", ranks=RANKS)
    store, rank, world_size = lab.store, lab.rank, lab.world_size
    started = time.perf_counter()
    group = expert_parallel_group(lab)
    outcome = run_rank(lab.learner.shared_capacity, store, rank, world_size, group)
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"per_rank": EXPERTS // world_size, "tolerance": TOLERANCE, "k": TOP_K, "experts": EXPERTS,
              "calls": [{"tokens": list(tokens), "capacity_factor": factor, "expected": expected(call)}
                        for call, (tokens, factor) in enumerate(CALLS)]}  # fmt: skip
    course_lab.write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


def describe(record: dict) -> str:
    """The lab's set-up, from its record: the ranks, experts and k, then each call's token counts and factor."""
    ranks, experts = len(record["ranks"]), record["experts"]
    lines = [f"{ranks} ranks, {experts} experts ({record['per_rank']} per rank), top-{record['k']}; each rank calls "
             f"shared_capacity {len(record['calls'])} times:"]  # fmt: skip
    for call, setup in enumerate(record["calls"]):
        first, *others = setup["tokens"]
        held = ", ".join([f"rank 0 holds {first} tokens", *(f"rank {r} {n}" for r, n in enumerate(others, 1))])
        lines.append(f"  call {call + 1}: {held}; capacity factor {setup['capacity_factor']:g}")
    return "\n".join(lines)


def alternatives(record: dict) -> list[dict]:
    """For each call: the capacity of the largest count (the right one) beside those of the sum, the mean and the
    smallest count."""
    rows = []
    for call in record["calls"]:
        tokens, factor = call["tokens"], call["capacity_factor"]
        rows.append({"largest": call["expected"], "sum": capacity_for(sum(tokens), factor),
                     "mean": capacity_for(sum(tokens) / len(tokens), factor),
                     "smallest": capacity_for(min(tokens), factor)})  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def outcomes_of(record: dict, call: int) -> list[dict] | None:
    """Every rank's outcome of call `call`, or None when it did not run (an earlier call left a rank with an error)."""
    outcomes = [rank["calls"][call] for rank in record["ranks"] if len(rank["calls"]) > call]
    return outcomes if len(outcomes) == len(record["ranks"]) else None


def rank_line(call: int, rank: int, outcome: dict, record: dict) -> str:
    factor, per_rank = record["calls"][call]["capacity_factor"], record["per_rank"]
    head = f"call {call + 1}, rank {rank} ({outcome['tokens']} tokens, capacity factor {factor:g}): "
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
    if capacity != record["calls"][call]["expected"]:
        return head + f"; it {kept}, its output equals one process's, but its buffers are not the capacity factor's"
    if not outcome["collectives"]:
        return head + f"; it {kept}, its output equals one process's, but shared_capacity called no collective"
    if not all(named for _, named in outcome["collectives"]):
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


def _drops(outcomes: list[dict], busiest: int, expected: int, k: int) -> str:
    """What the busiest rank keeps at the capacity the ranks used, against the right one (when the all-to-all ran)."""
    outcome, right = outcomes[busiest], f"capacity {expected} (that of its {outcomes[busiest]['tokens']} tokens)"
    if outcome["kept"] is None or outcome["kept_right"] is None:
        return f"rank {busiest} needs {right}"
    return (f"rank {busiest} keeps {outcome['kept']} of its {outcome['tokens'] * k} choices, where {right} keeps "
            f"{outcome['kept_right']}")  # fmt: skip


def call_causes(record: dict, call: int, outcomes: list[dict]) -> list[tuple[str, str]]:
    """(kind, cause) for one call whose ranks all returned a capacity: what a known mistake gives."""
    per_rank, k = record["per_rank"], record["k"]
    tokens, factor = record["calls"][call]["tokens"], record["calls"][call]["capacity_factor"]
    expected, capacities = record["calls"][call]["expected"], [outcome["capacity"] for outcome in outcomes]
    if len(set(capacities)) > 1:
        own = [capacity_for(count, factor) for count in tokens]
        found = []
        if capacities == own:
            counts, theirs = ", ".join(map(str, tokens)), ", ".join(map(str, own))
            found.append(("own", f"each rank's capacity comes from its own token count ({counts} tokens -> {theirs}), "
                                 "but the splits must be the same on every rank of the group"))  # fmt: skip
        return found + [("mismatch", line) for line in mismatches(outcomes, per_rank)]
    capacity = capacities[0]
    if capacity == expected:
        return []
    busiest = tokens.index(max(tokens))
    uses = f"in call {call + 1} every rank uses capacity {capacity}"
    largest = (f"C x {max(tokens)} tokens (the most any rank holds, rank {busiest}'s) x k / E rounded up is "
               f"{expected}")  # fmt: skip
    named = {name for outcome in outcomes for name, _ in outcome["collectives"]}
    sources = [rank for rank, count in enumerate(tokens) if capacity_for(count, factor) == capacity]
    if named & BROADCASTS and sources and busiest not in sources:
        source = sources[0]
        return [("broadcast", f"{uses}, that of rank {source}'s {tokens[source]} tokens (a broadcast from rank "
                 f"{source}?), but {largest}: which rank holds the most changes from call to call (from batch to batch "
                 "in training), so no one rank's count will do; the largest over the whole group will")]  # fmt: skip
    if capacity == capacity_for(sum(tokens), factor):
        return [("sum", f"{uses}, that of {sum(tokens)} tokens, the sum of the ranks' counts: nothing crashes, but "
                 f"{largest}; each buffer is {capacity / expected:.1f} times the factor's, and grows with the number "
                 "of ranks")]  # fmt: skip
    drops = _drops(outcomes, busiest, expected, k)
    mean = sum(tokens) / len(tokens)
    if capacity in (capacity_for(mean, factor), capacity_for(sum(tokens) // len(tokens), factor)):
        return [("mean", f"{uses}, that of the mean count ({sum(tokens)} tokens / {len(tokens)} ranks): one number "
                 "everywhere, but a rank holding more than the mean gets fewer slots than the capacity factor promises "
                 f"its own tokens: {drops}")]  # fmt: skip
    if capacity == capacity_for(min(tokens), factor):
        return [("min", f"{uses}, that of {min(tokens)} tokens, the fewest any rank holds: the busier ranks drop "
                 f"choices the capacity factor keeps: {drops}")]  # fmt: skip
    if capacity == math.floor(factor * max(tokens) * k / record["experts"]):
        return [("floor", f"{uses}: the largest count's capacity rounded down, where {largest}")]
    if factor != 1 and capacity == capacity_for(max(tokens), 1.0):
        return [("factor", f"{uses}: that of the largest count without the capacity factor ({factor:g} here), where "
                 f"{largest}")]  # fmt: skip
    for other in (other for other in range(len(record["calls"])) if other != call):
        theirs = record["calls"][other]
        if capacity == theirs["expected"]:
            return [("typed", f"{uses}, call {other + 1}'s answer: a number that fits one call's counts and factor "
                     f"fails another's ({largest})")]  # fmt: skip
        if capacity == capacity_for(max(theirs["tokens"]), factor):
            return [("typed", f"{uses}, that of {max(theirs['tokens'])} tokens, the largest count of call "
                     f"{other + 1}, which no rank holds in call {call + 1}: the count must come from this call's ranks "
                     f"({largest})")]  # fmt: skip
    if sources and busiest not in sources:
        return [("one", f"{uses}, that of rank {sources[0]}'s {tokens[sources[0]]} tokens, where {largest}")]
    return [("other", f"{uses}, where {largest}")]


def causes(record: dict) -> list[str]:
    """Why the lab failed, in the learner's terms, when the ranks' outcomes are what a known mistake gives (each kind
    of mistake once, from the first call that shows it)."""
    found, kinds, ran, failed = [], set(), [], False
    for call in range(len(record["calls"])):
        outcomes = outcomes_of(record, call)
        if outcomes is None:
            break
        ran.append(outcomes)
        if any(outcome["capacity"] is None for outcome in outcomes):
            failed = True  # a rank raised or waited: its own line says so, and what it recorded may be cut short
            stuck = [rank for rank, outcome in enumerate(outcomes) if outcome["error"] == STUCK]
            if stuck and len(stuck) < len(outcomes):
                found.append(f"ranks {stuck} waited in a collective that rank "
                             f"{next(r for r in range(len(outcomes)) if r not in stuck)} never called: every rank must "
                             "call the same collectives")  # fmt: skip
            break
        this_call = call_causes(record, call, outcomes)
        found += [cause for kind, cause in this_call if kind not in kinds]
        kinds |= {kind for kind, _ in this_call}
    recorded = [c for outcomes in ran for outcome in outcomes for c in outcome["collectives"]]
    if ran and not recorded and not failed and not kinds & {"own", "mismatch"}:
        found.append("shared_capacity called no collective: a rank knows only its own count, and the capacity every "
                     "rank uses must come from every rank's count, through a collective over `group`")  # fmt: skip
    unnamed = [name for name, named in recorded if not named]
    if unnamed:
        found.append(f"shared_capacity's {unnamed[0]} did not name `group`: it ran over every rank of the job (the "
                     "same three here); with several expert-parallel groups it would mix in the other groups' ranks, "
                     "or wait for ranks busy elsewhere")  # fmt: skip
    return found


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per call and rank, then "why:" lines): each rank's capacity, its splits, and its output."""
    lines = []
    for call in range(len(record["calls"])):
        outcomes = outcomes_of(record, call)
        if outcomes is None:
            lines.append(f"call {call + 1}: did not run (a rank ended call {call} with an error: the group may be "
                         "broken)")  # fmt: skip
            continue
        lines += [rank_line(call, rank, outcome, record) for rank, outcome in enumerate(outcomes)]
    passed = all(line.endswith("(right)") for line in lines)
    return passed, lines + ([] if passed else [f"why: {cause}" for cause in causes(record)])


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    return None if passed else course_lab.failure_message(lines, todo, HINT)


if __name__ == "__main__":
    main()
