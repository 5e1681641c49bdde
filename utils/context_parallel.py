"""Lesson 09's measurements of context parallelism, kept out of the lesson script.

    measured = ring_measurements(ring, steps, n_layers)                       # work, bytes, time per rank
    measured |= attention_memory(RingAttention.apply, chunk_positions, ...)  # saved bytes against --seq-len

Every function here is called on every rank (they gather one value per rank with all_gather_object).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.metrics import SavedActivations


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
    shape: (sequences, heads, head_dim)."""
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
    return {"attention_seq_lens": list(seq_lens), "attention_saved_bytes_per_rank": gather(per_rank),
            "attention_saved_bytes_one_process": one_process}  # fmt: skip
