"""Lesson 09's debugging lab (TODO 9): a ring attention step whose sends and receives do not pair up.

Ring.start (utils/lesson_09/ring.py) posts a hop's send and receive together, as one batch_isend_irecv. Written with
torch.distributed's send, recv, isend and irecv, a hop goes wrong in two ways: each rank waits in a call whose partner
waits in another (the step hangs until the timeout), or the calls pair up but the blocks go round the ring another
way than the forward folds them (attention against the wrong keys and values, without an error). The lesson's
`pass_block(block, rank, world_size)` is that hop. Here each rank runs the solution's ring attention forward
(lesson("09"): its TODOs 1-4, not the learner's) on its zigzag share of one sequence, with `pass_block` as the ring's
exchange, in a gloo group with a 5 s timeout (a hang ends in seconds). Each rank notes the point-to-point calls the
hop makes, before they block, and whose block arrives; then it compares its attention with one process's. Rank 0
writes every rank's outcome. The notebook and `make check` run the same file:

    torchrun --nproc_per_node=3 utils/lesson_09/lab.py exercises/09_context_parallelism.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause

Why gloo even on a GPU node: a receive that never comes makes gloo raise after the timeout, which the lab reports;
NCCL's watchdog kills the process instead (utils/course/lab.py says more).
"""

import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from utils.course.lab import (  # noqa: E402
    describe_lab_error,
    failure_message,
    join_lab_group,
    outermost_calls,
    start_rank,
    write_outcomes,
)
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402
from utils.lesson_09.ring import Pending, Ring  # noqa: E402

SEQ_LEN, HEADS, HEAD_DIM = 12, 2, 8  # the live run: one sequence of 12 tokens over 3 ranks, zigzag (4 tokens each)
TIMEOUT_S = 5.0  # how long a rank waits for its partner before gloo gives up (--timeout: longer, to look at a hang)
TOLERANCE = 1e-5  # attention against one process's (fp32: the same scores, merged block by block)
HINTS = {  # a question that leads to the cause, not the fix: the lab is the finding
    "hang": "take the call each rank waits in: which rank must act for it to complete, and what is it doing then",
    "blocks": "follow one block round the ring: to which rank does each rank send, and from which does it receive",
}
PEER = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}  # each point-to-point call's peer argument
SENDS, BLOCKING = {"send", "isend"}, {"send", "recv"}
C10D = dist.distributed_c10d.__file__  # where torch.distributed's point-to-point functions are defined
STUCK = "waited until gloo's timeout"  # a rank's error when it waited in vain (the record says how long)


@contextlib.contextmanager
def recording(calls: list):
    """Append [name, peer] to `calls` for each point-to-point call the code inside makes, as it makes it (before it
    can block; peer None: any rank). A profile hook sees every Python call with its arguments, however the hop spells
    it (dist.send, or P2POps in a batch_isend_irecv). Only the outermost call counts: send itself calls isend."""

    def record(frame) -> bool:
        if frame.f_code.co_filename != C10D:
            return False
        name, arguments = frame.f_code.co_name, frame.f_locals
        if name == "batch_isend_irecv":
            calls.extend([op.op.__name__, op.peer] for op in arguments["p2p_op_list"])
        elif name in PEER:
            peer = arguments[PEER[name]]
            calls.append([name, arguments["group_" + PEER[name]] if peer is None else peer])
        else:
            return False
        return True

    with outermost_calls(record):
        yield calls


def whose(received, blocks: list) -> int:
    """The rank whose block `received` is, bit for bit (a transfer copies it exactly); -1 for no rank's."""
    if not isinstance(received, torch.Tensor) or received.shape != blocks[0].shape:
        return -1
    return next((rank for rank, block in enumerate(blocks) if torch.equal(received, block)), -1)


class HandRing(Ring):
    """The lesson's Ring with the learner's hop as its exchange: start() runs pass_block at once (its calls complete
    before it returns), notes the hop's calls and whose block came back, and hands that block over as received. The
    neighbours the forward names are left to the hop: choosing them is half of getting it right."""

    def __init__(self, pass_block, rank: int, size: int, every_block: list):
        super().__init__(rank, size)
        self.pass_block, self.every_block, self.hops = pass_block, every_block, []  # (Ring's blocks: its counts)

    def start(self, tensor, send_to, receive_from):
        hop = {"calls": [], "from": None}
        self.hops.append(hop)
        with recording(hop["calls"]):
            received = self.pass_block(tensor.contiguous(), self.rank, self.size)
        hop["from"] = whose(received, self.every_block)
        return Pending(self, [], received)


def describe(error: BaseException) -> str:
    return describe_lab_error(error, STUCK)


def run_rank(pass_block, engine, rank: int, world_size: int) -> dict:
    """This rank's part of the lab: its share of one sequence, the solution's ring forward with the learner's hop."""
    generator = torch.Generator().manual_seed(0)  # the same sequence on every rank
    q, k, v = (torch.randn(1, HEADS, SEQ_LEN, HEAD_DIM, generator=generator) for _ in "qkv")
    all_positions = [engine.chunk_positions(SEQ_LEN, r, world_size, "zigzag") for r in range(world_size)]
    blocks = [torch.stack([k[..., places, :], v[..., places, :]]) for places in all_positions]  # each rank's own
    mine = all_positions[rank]
    ring = HandRing(pass_block, rank, world_size, blocks)
    outcome = {"error": None, "hops": ring.hops, "difference": None}
    try:
        out, _ = engine.ring_attention_forward(q[..., mine, :], k[..., mine, :], v[..., mine, :], mine, all_positions,
                                               ring)  # fmt: skip
    except NotImplementedError as error:
        outcome["error"] = f"not done: {error}"
        return outcome
    except Exception as error:  # noqa: BLE001 - a timeout, a peer that gave up, or the learner's code raising
        outcome["error"] = describe(error)
        return outcome
    one_process = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., mine, :]
    outcome["difference"] = float((out - one_process).abs().max())
    return outcome


def main():
    lab = start_rank("09", "pass_block", timeout_option=True)
    learner, store, rank, world_size = lab.learner, lab.store, lab.rank, lab.world_size
    engine = lesson("09")  # the solution's ring: a mistake in TODOs 1-4 must not show up as the lab's
    started = time.perf_counter()
    timeout_s = lab.timeout_s or TIMEOUT_S
    join_lab_group(store, rank, world_size, timeout_s)
    outcome = run_rank(learner.pass_block, engine, rank, world_size)
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"seq_len": SEQ_LEN, "tolerance": TOLERANCE, "timeout_s": timeout_s}
    write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def in_words(calls: list) -> str:
    return ", ".join(f"{name} {'to' if name in SENDS else 'from'} " + ("any rank" if peer is None else f"rank {peer}")
                     for name, peer in calls)  # fmt: skip


def waits_on(calls: list) -> list:
    """What a rank stuck in this hop waits for: its last call if that one blocks, else every call it posted (isend,
    irecv) since its last blocking one, which it then waited for."""
    if calls and calls[-1][0] in BLOCKING:
        return [calls[-1]]
    posted = []
    for call in calls:
        posted = [] if call[0] in BLOCKING else [*posted, call]
    return posted


def due(rank: int, step: int, size: int) -> int:
    return (rank - step) % size  # the forward folds rank (rank - step)'s block at step `step`


def got(rank: int, hops: list, size: int) -> str:
    """Whose block each finished hop brought, and whose was due where they differ."""
    said = []
    for step, hop in enumerate(hops, 1):
        if hop["from"] is None:
            continue
        block = "no rank's block" if hop["from"] < 0 else ("its own block" if hop["from"] == rank else
                                                            f"rank {hop['from']}'s block")  # fmt: skip
        wrong = hop["from"] != due(rank, step, size)
        said.append(f"{block} at step {step}" + (f" where rank {due(rank, step, size)}'s was due" if wrong else ""))
    return "got " + ", ".join(said) if said else ""


def until(record: dict) -> str:
    return f"until gloo's {record['timeout_s']:.0f} s timeout (or until a peer gave up)"


def rank_line(rank: int, outcome: dict, record: dict, size: int) -> str:
    hops, head = outcome["hops"], f"rank {rank}: "
    if outcome["error"]:
        finished = got(rank, hops, size)
        if not hops or hops[-1]["from"] is not None:  # it failed outside a hop
            said = f"waited {until(record)}" if outcome["error"] == STUCK else outcome["error"]
            return head + (f"{finished}, then " if finished else "") + said
        calls = hops[-1]["calls"]  # the hop it failed in
        called = f"called {in_words(calls)}" if calls else "called no send or receive"
        if outcome["error"] == STUCK:
            ended = f"and waited {'in it' if calls and calls[-1][0] in BLOCKING else 'for them'} {until(record)}"
        else:
            ended = f"and {outcome['error']}"
        return head + (f"{finished}; " if finished else "") + f"at step {len(hops)} it {called} {ended}"
    right_blocks = all(hop["from"] == due(rank, step, size) for step, hop in enumerate(hops, 1))
    right_attention = outcome["difference"] <= record["tolerance"]
    blocks = head + got(rank, hops, size)
    if right_blocks and right_attention:
        return blocks + ", as the forward folds them; attention equals one process's (right)"
    if right_attention:
        return blocks + "; its attention equals one process's only by luck (the mask shows it the same keys either way)"
    return blocks + f"; its attention differs from one process's by {outcome['difference']:.1e}, without any error"


def hang_cause(ranks: list) -> str | None:
    """Who waited for whom, when ranks waited until the timeout: a receive whose sender sent elsewhere, else every
    rank waiting in the same blocking call as the rank it waits for."""
    waiting = {}  # rank -> (the calls of the hop it is stuck in, those it waits on)
    for rank, outcome in enumerate(ranks):
        hops = outcome["hops"]
        if outcome["error"] == STUCK and hops and hops[-1]["from"] is None:
            waiting[rank] = hops[-1]["calls"], waits_on(hops[-1]["calls"])
    for rank, (_, waits) in waiting.items():
        for name, peer in sorted(waits, key=lambda call: call[0] in SENDS):  # the receives first
            theirs = waiting.get(peer, ([], []))[0]  # what the peer called in the hop it is stuck in
            if name not in SENDS and peer is not None:  # this rank receives from peer: did peer send to it?
                targets = [p for n, p in theirs if n in SENDS]
                if targets and rank not in targets:
                    return f"rank {rank} waits for a block from rank {peer}, which sent its own to rank {targets[0]}"
            if name in SENDS:  # this rank sends to peer: does peer receive from it (or from any rank)?
                sources = [p for n, p in theirs if n not in SENDS]
                if sources and rank not in sources and None not in sources:
                    return f"rank {rank} sends to rank {peer}, which receives from rank {sources[0]}"
    blocked = {rank: waits[0] for rank, (_, waits) in waiting.items() if len(waits) == 1 and waits[0][0] in BLOCKING}
    if waiting and len(blocked) == len(ranks):
        for kind, other in (("recv", "sends"), ("send", "receives")):
            if all(call[0] == kind and blocked.get(call[1], [None])[0] == kind for call in blocked.values()):
                chain = ", ".join(f"rank {rank} for rank {call[1]}" for rank, call in blocked.items())
                return (f"every rank waits in {kind} for a rank that is itself waiting in {kind} ({chain}): no rank "
                        f"gets to the call that {other}")  # fmt: skip
    return None


def wrong_blocks_cause(ranks: list, size: int) -> str | None:
    """Whose blocks the ranks got, when the hops completed but brought others than the forward folds."""
    hops = [(rank, step, hop["from"]) for rank, outcome in enumerate(ranks) if not outcome["error"]
            for step, hop in enumerate(outcome["hops"], 1)]  # fmt: skip
    wrong = [(rank, step, came) for rank, step, came in hops if came != due(rank, step, size)]
    if not wrong:
        return None
    if len(wrong) == len(hops) and all(came == (rank + step) % size for rank, step, came in hops):
        return ("the blocks go round the ring the other way: at step s each rank r got rank r + s's block, where the "
                "forward folds rank r - s's")  # fmt: skip
    if all(came == rank for rank, _, came in wrong):
        return "the hop returned the block it was given: each rank folded its own keys and values again"
    rank, step, came = wrong[0]
    if came < 0:
        return (f"rank {rank}'s block at step {step} is no rank's: it was read before it arrived, or changed on the "
                "way")  # fmt: skip
    return f"rank {rank} got rank {came}'s block at step {step}, where the forward folds rank {due(rank, step, size)}'s"


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rank, then the cause): what each rank's hops called and brought, and its attention."""
    ranks, size = record["ranks"], len(record["ranks"])
    lines = [rank_line(rank, outcome, record, size) for rank, outcome in enumerate(ranks)]
    passed = all(line.endswith("(right)") for line in lines)
    causes = [cause for cause in (hang_cause(ranks), wrong_blocks_cause(ranks, size)) if cause]
    return passed, lines + [f"why: {cause}" for cause in causes]


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    hung = any(outcome["error"] == STUCK for outcome in record["ranks"])
    return None if passed else failure_message(lines, todo, HINTS["hang" if hung else "blocks"])


if __name__ == "__main__":
    main()
