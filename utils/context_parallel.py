"""Lesson 09's plumbing for context parallelism, kept out of the lesson script: the ring's point-to-point exchange
with its counters, and the measurements.

    ring = Ring(rank, world_size)
    pending = ring.start(kv, send_to=..., receive_from=...)   # posts the transfer, returns at once
    ...compute...
    kv = pending.wait()                                        # the block from receive_from
    measured = ring_measurements(ring, steps, n_layers)                       # work, bytes, time per rank
    measured |= attention_memory(RingAttention.apply, chunk_positions, ...)  # saved bytes against --seq-len

The measurement functions are called on every rank (they gather one value per rank with all_gather_object).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.metrics import SavedActivations


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

    def start(self, tensor: torch.Tensor, send_to: int, receive_from: int) -> "Pending":
        tensor = tensor.contiguous()
        if send_to == receive_from == self.rank:  # a ring of one passes the block to itself
            return Pending(self, [], tensor)
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, send_to), dist.P2POp(dist.irecv, received, receive_from)]
        self.sent[self.phase] += tensor.numel() * tensor.element_size()
        return Pending(self, dist.batch_isend_irecv(ops), received)

    def count(self, queries: int, keys: int):
        """Record one computed block of `queries` x `keys`: the work per rank."""
        self.pairs[self.phase] += 1
        self.scores[self.phase] += queries * keys


class Pending:
    """A posted exchange: wait() returns the received tensor once both transfers are done."""

    def __init__(self, ring: Ring, works, received: torch.Tensor):
        self.ring, self.works, self.received = ring, works, received

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        for work in self.works:
            work.wait()
        self.ring.waited_s += time.perf_counter() - started
        return self.received


def gather(value) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def ring_measurements(ring, steps: int, n_layers: int) -> dict:
    """What the ring did per rank, per training step (bytes, seconds) and per layer's forward (the work)."""
    compute_s = (ring.busy_s - ring.waited_s) / steps
    return {
        "attention_pairs_per_rank": gather(ring.pairs["forward"] // (steps * n_layers)),
        "attention_scores_per_rank": gather(ring.scores["forward"] // (steps * n_layers)),
        "ring_bytes_per_step": {phase: gather(ring.sent[phase] // steps) for phase in ("forward", "backward")},
        "attention_compute_s_per_rank": gather(compute_s),
        "attention_wait_s_per_rank": gather(ring.waited_s / steps),
    }


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
