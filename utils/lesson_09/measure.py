"""What lesson 09's runs measure, kept out of the lesson script: called on every rank after training (each gathers
one value per rank with all_gather_object), the results go to the metrics file.

    measured = run_measurements(args, ring, counter, RingAttention.apply, chunk_positions, device)

- ring (--impl ring): blocks and scores computed per rank and layer (and how many of the scores the causal mask
  shows), bytes sent per step by pass, seconds per step computing and waiting in ring attention, the seconds one hop
  takes with nothing to overlap it (measured after training, every rank exchanging the same message at once), the
  last step's timelines; and the bytes one attention layer keeps (saved for backward, and at its peak) for one
  sequence of 16 N tokens and 4 doublings of it (the T x T scores of the longest fit any laptop), on each rank and,
  for comparison, on one process with PyTorch's fused attention and with attention written out (which keeps the
  T x T scores).
- ulysses: the all-to-alls of one training step (calls, the bytes of their inputs, and the part sent to other ranks).
"""

import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from utils.lesson_09.ring import Ring
from utils.metrics import SavedActivations

MEMORY_DOUBLINGS = 5  # the memory is measured at 16 x N tokens and 4 doublings of it (whatever --seq-len is)
HOP_REPEATS = 7  # timed hops for the hop's time (the median)


def per_rank(value) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run_measurements(args, ring: Ring, counter, ring_attention, chunk_positions, device) -> dict:
    """The metrics of a run beyond the shared ones. ring_attention and chunk_positions: the lesson's."""
    if args.impl == "ring":
        shape = (args.batch_size, args.n_heads, args.seq_len // ring.size, args.dim // args.n_heads)
        seq_lens = [16 * ring.size * 2**i for i in range(MEMORY_DOUBLINGS)]  # 64 to 1024 tokens on 4 ranks
        memory_shape = (1, args.n_heads, args.dim // args.n_heads)  # one sequence: the bytes grow with the batch
        return (ring_measurements(ring, args.steps, args.n_layers)
                | {"ring_hop_s_per_rank": per_rank(hop_seconds(ring.rank, ring.size, (2, *shape), device))}
                | attention_memory(ring_attention, chunk_positions, ring.rank, ring.size, args.cp_split, seq_lens,
                                   memory_shape, device))  # fmt: skip
    if args.impl == "ulysses":
        calls, whole = counter.table().get("step", {}).get("all_to_all", [0, 0])
        world_size = dist.get_world_size()
        return {"all_to_all_calls_per_step": calls, "all_to_all_input_bytes_per_step": per_rank(whole),
                "all_to_all_sent_bytes_per_step": per_rank(whole * (world_size - 1) // world_size)}  # fmt: skip
    return {}


def ring_measurements(ring: Ring, steps: int, n_layers: int) -> dict:
    """What the ring did per rank: per layer's forward (the work), per training step (bytes, seconds) and the last
    step's timelines: [rank][call] {"phase", "events"}, every layer's forward then every layer's backward."""
    return {
        "attention_blocks_per_rank": per_rank(ring.blocks["forward"] // (steps * n_layers)),
        "attention_scores_per_rank": per_rank(ring.scores["forward"] // (steps * n_layers)),
        "attention_visible_per_rank": per_rank(int(ring.visible["forward"]) // (steps * n_layers)),
        "ring_bytes_per_step": {phase: per_rank(ring.sent[phase] // steps) for phase in ("forward", "backward")},
        "attention_compute_s_per_rank": per_rank((ring.busy_s - ring.waited_s) / steps),
        "attention_wait_s_per_rank": per_rank(ring.waited_s / steps),
        "ring_timeline_per_rank": per_rank(list(ring.calls)[-2 * n_layers :]),
    }


def hop_seconds(rank: int, size: int, shape, device) -> float:
    """The seconds one ring hop of a message of `shape` (fp32) takes when nothing else runs: every rank sends to the
    next and receives from the previous at once, as in a ring step, and waits at once (the median of a few)."""
    if size == 1:
        return 0.0
    ring, message = Ring(rank, size), torch.zeros(shape, device=device)
    times = []
    for _ in range(HOP_REPEATS):
        dist.barrier()  # every rank starts the hop together: the time is the transfer's, not a late neighbour's
        started = time.perf_counter()
        ring.start(message, send_to=(rank + 1) % size, receive_from=(rank - 1) % size).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors allocated inside it that are alive, now (current_bytes) and at most (peak_bytes).

    Every operation's outputs pass through here; an output whose storage is none of its inputs' is a new
    allocation, counted until its storage dies (a storage's Python object lives exactly as long as the storage,
    autograd's saved tensors included). Tensors that existed before (the inputs, the parameters) are not counted."""

    def __init__(self):
        super().__init__()
        self.current_bytes = self.peak_bytes = 0
        self._alive = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(outputs):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._alive or storage.nbytes() == 0:
                continue
            self._alive.add(key)
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return outputs

    def _free(self, key: int, nbytes: int):
        self._alive.discard(key)
        self.current_bytes -= nbytes


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def held_bytes(function, *inputs) -> tuple[int, int]:
    """(bytes autograd keeps for backward, the most bytes alive at once) of one call of `function`, its inputs
    included in both (a layer's q, k and v are activations too)."""
    with SavedActivations() as saved, LiveBytes() as live:
        output = function(*inputs)
    kept = saved.current_bytes
    del output
    return kept, sum(t.untyped_storage().nbytes() for t in inputs) + live.peak_bytes


def written_out_attention(q, k, v):
    """Causal attention as three operations: the T x T scores, their softmax (which autograd keeps), times v."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1) @ v


def attention_memory(ring_attention, chunk_positions, rank, size, split, seq_lens, shape, device) -> dict:
    """The bytes one attention layer keeps for backward and at its peak, at each sequence length: the ring's on each
    rank (every rank runs it: a real ring), and on one process PyTorch's fused attention and attention written out.
    shape: (sequences, heads, head_dim)."""
    batch, heads, head_dim = shape
    ring = Ring(rank, size)  # a fresh ring: the training run's counts stay as they were
    measured = {"ring": [], "fused": [], "written_out": []}

    def inputs(tokens):
        return [torch.randn(batch, heads, tokens, head_dim, device=device, requires_grad=True) for _ in range(3)]

    for seq_len in seq_lens:
        all_positions = [chunk_positions(seq_len, r, size, split).to(device) for r in range(size)]
        mine = all_positions[rank]
        layer = lambda q, k, v, mine=mine, everyone=all_positions: ring_attention(q, k, v, mine, everyone, ring)  # noqa: E731
        measured["ring"].append(held_bytes(layer, *inputs(len(mine))))
        fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        measured["fused"].append(held_bytes(fused, *inputs(seq_len)))
        measured["written_out"].append(held_bytes(written_out_attention, *inputs(seq_len)))
    return {
        "memory_seq_lens": list(seq_lens),
        "memory_shape": list(shape),
        "memory_ring_per_rank": per_rank(measured["ring"]),  # [rank][seq_len] (saved, peak)
        "memory_fused_one_process": measured["fused"],
        "memory_written_out_one_process": measured["written_out"],
    }
