"""The ring's point-to-point exchange, with its counters and timeline: what lesson 09's ring attention calls.

    ring = Ring(rank, world_size)
    with ring.timed("forward"):                                  # one layer's ring attention (RingAttention)
        pending = ring.start(kv, send_to=..., receive_from=...)  # posts the transfer, returns at once
        ring.count(q_positions, k_positions)                     # before computing each block
        kv = pending.wait()                                      # the tensor from receive_from

The timeline: every call of ring attention (a layer's forward or backward) keeps its events, in milliseconds from
the moment this rank entered it: ("post", t, t') an exchange posted (start() called and returned), ("compute", t,
t') the blocks computed between two exchange calls (from the first count() to the next start() or wait(), or the
call's end), ("wait", t, t') waiting for a posted exchange to complete. The last calls are kept (a training step's),
so a long run keeps no more than one step's worth.
"""

import collections
import contextlib
import time

import torch
import torch.distributed as dist

KEPT_CALLS = 64  # the timelines of the last calls of ring attention a Ring keeps (2 per layer and step)
PHASES = ("forward", "backward")


class Ring:
    """This rank's place in the ring (rank, size: the world's) and its point-to-point exchange, counting what it
    does: bytes sent, blocks computed (the lesson's code calls count()), seconds spent waiting for a neighbour.

    start(tensor, send_to, receive_from) posts the send of `tensor` and the receive of a tensor like it as one
    batch_isend_irecv (NCCL needs the pair posted together, or every rank's send waits for a receive not yet
    posted), and returns at once; .wait() on what it returns gives the received tensor. Exchanges complete in the
    order they were posted (every rank posts them in the same order). utils/lesson_09/threads.py has a stand-in
    with the same methods, to run N ranks as threads of one process."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.sent = dict.fromkeys(PHASES, 0)  # bytes this rank sent, by pass
        self.blocks = dict.fromkeys(PHASES, 0)  # blocks of (queries, keys) computed
        self.scores = dict.fromkeys(PHASES, 0)  # query-key scores computed in those blocks, per sequence and head
        self.visible = dict.fromkeys(PHASES, 0)  # of which the causal mask shows (a tensor: no wait for the device)
        self.busy_s = self.waited_s = 0.0  # seconds in ring attention, of which waiting for a neighbour
        self.phase = "forward"  # which pass the counts go to (RingAttention's forward or backward sets it)
        self.calls = collections.deque(maxlen=KEPT_CALLS)  # the last calls' timelines: {"phase", "events"}
        self._events, self._origin, self._computing = None, 0.0, None

    @contextlib.contextmanager
    def timed(self, phase: str):
        """One call of ring attention (a layer's forward or backward pass): what it counts goes to `phase`, its
        seconds to busy_s, its events to a timeline of their own."""
        self.phase, self._events, self._origin = phase, [], time.perf_counter()
        try:
            yield self
        finally:
            self._event("end")
            self.busy_s += time.perf_counter() - self._origin
            self.calls.append({"phase": phase, "events": self._events})
            self._events = None

    def _event(self, kind: str, started: float | None = None):
        """Close the computation running since the first count() (an exchange call or the end stops it), and note
        `kind` ("post" or "wait") from `started` to now."""
        if self._events is None:  # outside timed(): nothing is recorded
            return
        now = time.perf_counter()
        if self._computing is not None:
            end = started if started is not None else now
            self._events.append(("compute", *self._ms(self._computing, end)))
            self._computing = None
        if kind != "end":
            self._events.append((kind, *self._ms(started, now)))

    def _ms(self, start: float, end: float) -> tuple[float, float]:
        return 1e3 * (start - self._origin), 1e3 * (end - self._origin)

    def start(self, tensor: torch.Tensor, send_to: int, receive_from: int) -> "Pending":
        started = time.perf_counter()
        tensor = tensor.contiguous()
        if send_to == receive_from == self.rank:  # a ring of one passes the block to itself
            pending = Pending(self, [], tensor)
        else:
            received = torch.empty_like(tensor)
            ops = [dist.P2POp(dist.isend, tensor, send_to), dist.P2POp(dist.irecv, received, receive_from)]
            self.sent[self.phase] += tensor.numel() * tensor.element_size()
            pending = Pending(self, dist.batch_isend_irecv(ops), received)
        self._event("post", started)
        return pending

    def count(self, q_positions: torch.Tensor, k_positions: torch.Tensor):
        """Record one computed block: the places of its queries and of its keys (the work per rank, and, in the
        timeline, that the computation has begun, if it had not)."""
        self.blocks[self.phase] += 1
        self.scores[self.phase] += len(q_positions) * len(k_positions)
        self.visible[self.phase] = self.visible[self.phase] + (k_positions[None, :] <= q_positions[:, None]).sum()
        if self._computing is None and self._events is not None:
            self._computing = time.perf_counter()


class Pending:
    """A posted exchange: wait() returns the received tensor once both transfers are done."""

    def __init__(self, ring: Ring, works, received: torch.Tensor):
        self.ring, self.works, self.received = ring, works, received

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        for work in self.works:
            work.wait()
        self.ring.waited_s += time.perf_counter() - started
        self.ring._event("wait", started)
        return self.received


def in_flight(events: list) -> list[int]:
    """For each computation of one call's timeline, how many exchanges were posted and not yet waited for when it
    began: above 0, a transfer ran while this rank computed (the overlap)."""
    posted = waited = 0
    found = []
    for kind, _, _ in events:
        posted += kind == "post"
        waited += kind == "wait"
        if kind == "compute":
            found.append(posted - waited)
    return found


def context_summary(positions) -> str:
    """ "0-7, 56-63": the stretches of the sequence a rank holds, for the log."""
    places = positions.tolist() if torch.is_tensor(positions) else list(positions)
    starts = [i for i in range(len(places)) if i == 0 or places[i] != places[i - 1] + 1]
    return ", ".join(f"{places[s]}-{places[e - 1]}" for s, e in zip(starts, [*starts[1:], len(places)]))
