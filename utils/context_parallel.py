"""Lesson 09's plumbing for context parallelism, kept out of the lesson script: the ring's point-to-point exchange
with its counters, and the measurements.

    ring = Ring(rank, world_size)
    with ring.timed("forward"):                                # one layer's ring attention (RingAttention)
        pending = ring.start(kv, send_to=..., receive_from=...)   # posts the transfer, returns at once
        ...compute...                                              # ring.count() before each block
        kv = pending.wait()                                        # the block from receive_from
    measured = ring_metrics(ring, RingAttention.apply, chunk_positions, args, device)
    # ring_measurements (work, bytes, time, timeline per rank) | attention_memory (saved bytes against --seq-len)

The measurement functions are called on every rank (they gather one value per rank with all_gather_object).

The timeline: every call of ring attention (a layer's forward or backward) keeps its events, in milliseconds
from the moment this rank entered it: ("post", t, t') an exchange posted (start() called and returned),
("compute", t, t') the blocks computed between two exchange calls (from the first ring.count() to the next
start() or wait(), or the call's end), ("wait", t, t') waiting for a posted exchange. The last calls are kept
(a training step's: ring_measurements returns them), so a long run keeps no more than one step's worth.
"""

import collections
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.metrics import SavedActivations

KEPT_CALLS = 64  # the timelines of the last calls of ring attention a Ring keeps (2 per layer and step)


class Ring:
    """This rank's place in the ring (rank, size: the world's) and its point-to-point exchange, counting what it
    does: bytes sent, blocks computed (the lesson's code calls count()), seconds spent waiting for a neighbour.

    start(tensor, send_to, receive_from) posts the send of `tensor` and the receive of a tensor like it as one
    batch_isend_irecv (NCCL needs the pair posted together, or every rank's send waits for a receive not yet
    posted), and returns at once; .wait() on what it returns gives the received tensor. The tests put a stand-in
    with the same methods in its place, to run N ranks as threads of one process."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.sent = {"forward": 0, "backward": 0}  # bytes this rank sent, by pass
        self.pairs = {"forward": 0, "backward": 0}  # (query piece, key piece) blocks computed
        self.scores = {"forward": 0, "backward": 0}  # query-key scores computed in those blocks, per sequence and head
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

    def count(self, queries: int, keys: int):
        """Record one computed block of `queries` x `keys`: the work per rank (and, in the timeline, that the
        computation has begun, if it had not)."""
        self.pairs[self.phase] += 1
        self.scores[self.phase] += queries * keys
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


def context_summary(positions: torch.Tensor) -> str:
    """ "0-7, 56-63": the stretches of the sequence a rank holds, for the log."""
    places = positions.tolist()
    starts = [i for i in range(len(places)) if i == 0 or places[i] != places[i - 1] + 1]
    return ", ".join(f"{places[s]}-{places[e - 1]}" for s, e in zip(starts, [*starts[1:], len(places)]))


def ring_metrics(ring: Ring, ring_attention, chunk_positions, args, device: torch.device) -> dict:
    """The metrics of a training run's ring: work, bytes, time and the last step's timeline per rank
    (ring_measurements), then the bytes one attention layer saves for backward for one sequence of 1, 2 and 4 times
    --seq-len (attention_memory: a fresh ring, the same split). ring_attention and chunk_positions: the lesson's."""
    measured = ring_measurements(ring, args.steps, args.n_layers)
    shape = (1, args.n_heads, args.dim // args.n_heads)  # one sequence: the bytes grow with the batch
    seq_lens = [args.seq_len * m for m in (1, 2, 4)]
    fresh = Ring(ring.rank, ring.size)
    return measured | attention_memory(ring_attention, chunk_positions, fresh, args.cp_split, seq_lens, shape, device)


def gather(value) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def ring_measurements(ring, steps: int, n_layers: int) -> dict:
    """What the ring did per rank, per training step (bytes, seconds) and per layer's forward (the work), and the
    last step's timelines: [rank][call] {"phase", "events"}, the calls in order (every layer's forward, then
    every layer's backward)."""
    compute_s = (ring.busy_s - ring.waited_s) / steps
    return {
        "attention_pairs_per_rank": gather(ring.pairs["forward"] // (steps * n_layers)),
        "attention_scores_per_rank": gather(ring.scores["forward"] // (steps * n_layers)),
        "ring_bytes_per_step": {phase: gather(ring.sent[phase] // steps) for phase in ("forward", "backward")},
        "attention_compute_s_per_rank": gather(compute_s),
        "attention_wait_s_per_rank": gather(ring.waited_s / steps),
        "ring_timeline_per_rank": gather(list(ring.calls)[-2 * n_layers :]),
    }


def in_flight(events: list) -> list[int]:
    """For each computation of one call's timeline, how many exchanges were posted and not yet waited for when it
    began: above 0, the transfer ran while this rank computed (the overlap)."""
    posted = waited = 0
    found = []
    for kind, _, _ in events:
        posted += kind == "post"
        waited += kind == "wait"
        if kind == "compute":
            found.append(posted - waited)
    return found


def saved_bytes(function, *inputs) -> int:
    """The bytes autograd keeps for backward from one call of `function` (its inputs included, once each)."""
    with SavedActivations() as saved:
        output = function(*inputs)
    held = saved.current_bytes
    del output
    return held


def attention_memory(ring_attention, chunk_positions, ring, split: str, seq_lens, shape, device) -> dict:
    """The bytes one attention layer saves for backward on each rank, at each sequence length: the ring's on its
    chunk (every rank runs it, a real ring), and F.scaled_dot_product_attention's on one process's whole sequence.
    shape: (sequences, heads, head_dim); the bytes grow in proportion to the sequences."""
    batch, heads, head_dim = shape
    per_rank, one_process = [], []
    for seq_len in seq_lens:
        all_positions = [chunk_positions(seq_len, r, ring.size, split).to(device) for r in range(ring.size)]
        mine = all_positions[ring.rank]

        def inputs(tokens):
            return [torch.randn(batch, heads, tokens, head_dim, device=device, requires_grad=True) for _ in range(3)]

        per_rank.append(saved_bytes(ring_attention, *inputs(len(mine)), mine, all_positions, ring))
        causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        one_process.append(saved_bytes(causal, *inputs(seq_len)))
    return {
        "attention_seq_lens": list(seq_lens),
        "attention_shape": list(shape),
        "attention_saved_bytes_per_rank": gather(per_rank),
        "attention_saved_bytes_one_process": one_process,
    }
