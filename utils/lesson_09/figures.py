"""Lesson 09's notebook: its tables and plots, and the runs on threads behind its live figures. The lesson's own
functions come in as arguments (ring_attention_forward, ulysses_attention, ...): nothing here imports the script."""

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from utils import planner
from utils.lesson_09.ring import context_summary
from utils.lesson_09.threads import run_on_threads

COLOURS = plt.get_cmap("tab10")
KINDS = {  # a timeline's kinds of event: what it is, in words; its colour; its bar's height
    "compute": ("blocks computed (the number: which computation of the call)", "tab:blue", 0.6),
    "wait": ("waiting for an exchange to complete", "tab:red", 0.6),
    "post": ("exchange posted (isend + irecv)", "black", 0.9),
}


def rank_legend(fig, n: int, bottom: float = 0.0):
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS(r)) for r in range(n)]
    fig.legend(handles, [f"rank {r}" for r in range(n)], ncol=n, fontsize=10, loc="lower center", frameon=False,
               bbox_to_anchor=(0.5, bottom))  # fmt: skip


def draw_split(splits: dict, seq_len: int):
    """splits[name] = [places of rank 0, of rank 1, ...]: which rank holds each token, one row per split."""
    n = len(next(iter(splits.values())))
    fig, axes = plt.subplots(len(splits), 1, figsize=(10, 1.8 * len(splits)), sharex=True)
    for ax, (split, held) in zip(axes, splits.items()):
        for rank, places in enumerate(held):
            ax.bar(places.tolist(), 1, width=1.0, color=COLOURS(rank), edgecolor="white")
        ax.set_yticks([])
        ax.set_title(f"--cp-split {split}: which rank holds each token", fontsize=11)
    axes[-1].set_xlabel("place in the sequence (token)", fontsize=11)
    rank_legend(fig, n)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    plt.show()


def _raise_first(errors):
    for rank, error in enumerate(errors):
        if error is not None:
            raise RuntimeError(f"rank {rank}: {type(error).__name__}: {error}") from error


def _put_back(pieces: list, all_positions: list, like: torch.Tensor) -> torch.Tensor:
    whole = torch.zeros_like(like)
    for piece, places in zip(pieces, all_positions):
        whole[..., places, :] = piece
    return whole


def ring_forward_on_threads(forward, q, k, v, all_positions):
    """`forward` (the lesson's ring_attention_forward) on one thread per rank: (the output, at its places in the
    sequence; [(rank, ring step, query places, key places)] of every block the ranks computed)."""

    def work(rank, ring, _):
        mine = all_positions[rank]
        return forward(*(t[..., mine, :].contiguous() for t in (q, k, v)), mine, all_positions, ring)[0]

    results, rings, errors = run_on_threads(len(all_positions), work)
    _raise_first(errors)
    blocks = [(rank, step, qp, kp) for rank, ring in enumerate(rings) for _, qp, kp, _, step in ring.events("block")]
    return _put_back(results, all_positions, q), blocks


def draw_ring_blocks(results: dict, seq_len: int, piece: int):
    """results[split] = blocks from ring_forward_on_threads: a square per (query piece, key piece) of the sequence,
    coloured by the rank that computes it, the ring step written inside."""
    n = 1 + max(rank for blocks in results.values() for rank, *_ in blocks)
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 5.4))
    ticks = range(0, seq_len // piece + 1, 2)
    for ax, (split, blocks) in zip(axes, results.items()):
        for rank, step, qp, kp in blocks:
            row, col = int(qp[0]) // piece, int(kp[0]) // piece
            ax.add_patch(plt.Rectangle((col, row), 1, 1, color=COLOURS(rank), alpha=0.85))
            ax.text(col + 0.5, row + 0.5, str(step), ha="center", va="center", fontsize=10, color="white")
        ax.set_xlim(0, seq_len // piece)
        ax.set_ylim(seq_len // piece, 0)
        ax.set_aspect("equal")
        ax.set_xticks(ticks, [str(i * piece) for i in ticks])
        ax.set_yticks(ticks, [str(i * piece) for i in ticks])
        ax.set_xlabel("keys: place in the sequence (token)", fontsize=11)
        ax.set_ylabel("queries: place in the sequence (token)", fontsize=11)
        work = [sum(1 for r, *_ in blocks if r == rank) for rank in range(n)]
        ax.set_title(f"--cp-split {split}: blocks per rank {work}", fontsize=11)
    rank_legend(fig, n)
    fig.suptitle(f"Ring attention on {n} ranks, {seq_len} tokens: who computes each block (number: ring step)",
                 fontsize=12)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    plt.show()


def attention_on_threads(attention, q, k, v, d_out, all_positions):
    """attention(q, k, v, rank, ring, all_to_all) -> this rank's output, on one thread per rank, forward and
    backward (d_out: the gradient of the whole output): the output and the gradients of q, k, v, each put back at
    its places in the sequence."""

    def work(rank, ring, all_to_all):
        mine = all_positions[rank]
        leaves = [t[..., mine, :].detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, rank, ring, all_to_all)
        out.backward(d_out[..., mine, :])
        return out.detach(), *(leaf.grad for leaf in leaves)

    results, _, errors = run_on_threads(len(all_positions), work)
    _raise_first(errors)
    return [_put_back([r[i] for r in results], all_positions, q.detach()) for i in range(4)]


def draw_ulysses_layout(all_positions: list, heads: int):
    """Which rank holds each (head, token) before the first all-to-all (a sequence split: columns) and after it
    (a head split: rows), and the order the tokens arrive in."""
    n, seq_len = len(all_positions), sum(len(p) for p in all_positions)
    owner = torch.empty(seq_len, dtype=torch.long)
    for rank, places in enumerate(all_positions):
        owner[places] = rank
    before = owner[None, :].expand(heads, seq_len)
    after = (torch.arange(heads) // (heads // n))[:, None].expand(heads, seq_len)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
    per_rank = f"{heads // n} head" + ("s" if heads // n > 1 else "")
    titles = ("before: each rank holds its tokens of every head", f"after: each rank holds {per_rank} of every token")
    for ax, held, title in zip(axes, (before, after), titles):
        ax.imshow(held, cmap=plt.matplotlib.colors.ListedColormap([COLOURS(r) for r in range(n)]), aspect="auto",
                  vmin=-0.5, vmax=n - 0.5, interpolation="nearest")  # fmt: skip
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("place in the sequence (token)", fontsize=11)
        ax.set_ylabel("head", fontsize=11)
        ax.set_yticks(range(heads))
    arrived = ", ".join(context_summary(p) for p in all_positions)
    fig.suptitle(f"Ulysses on {n} ranks: one all-to-all turns the left into the right (tokens arrive rank by rank: "
                 f"{arrived})", fontsize=11)  # fmt: skip
    rank_legend(fig, n)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    plt.show()


def parity_table(runs: dict, weights: dict, reference: str, tolerance: float) -> dict:
    """Print each run's final loss, checksum and largest parameter difference from `reference`'s; return those
    differences by run."""
    differences = {}
    print(f"{'run':28s} {'final loss':>10s} {'checksum':>14s} {'max |difference|':>17s}")
    for name, metrics in runs.items():
        differences[name] = max(
            float((weights[name][p] - weights[reference][p]).abs().max()) for p in weights[reference]
        )
        shown = (
            f"<= {tolerance:.0e}" if differences[name] <= tolerance else f"{differences[name]:.1e}"
        )  # rounding varies
        print(f"{name:28s} {metrics['final_loss']:10.6f} {metrics['param_checksum']:14.6f} {shown:>17s}")
    return differences


def draw_work(runs: dict, key: str, ylabel: str):
    """Bars per rank of metrics[key], one colour per run."""
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    width = 0.8 / len(runs)
    for i, (name, metrics) in enumerate(runs.items()):
        values = metrics[key]
        ax.bar([r + (i - (len(runs) - 1) / 2) * width for r in range(len(values))], values, width=width, label=name)
    ax.set_xticks(range(len(values)), [f"rank {r}" for r in range(len(values))], fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.set_title("The causal work per rank, one layer's forward", fontsize=11)
    ax.legend(fontsize=10)
    fig.tight_layout()
    plt.show()


def overlap_table(timed: dict, layers: int) -> dict:
    """Per run and rank, milliseconds per training step: computing in ring attention, waiting for an exchange, and
    transferring (the ring's hops per step, each as long as one hop took after training with nothing to overlap
    it); and per ring step, the computation beside the one hop that runs during it. Returns {run: {"compute",
    "wait", "transfer", "step_compute", "hop"}: [per rank]}."""
    print(f"{'run':10s} {'rank':>4s} {'blocks':>6s} {'compute':>8s} {'waiting':>8s} {'transfer':>9s} "
          f"{'| a ring step computes':>22s} {'one hop':>8s}   (ms)")  # fmt: skip
    found = {}
    for name, metrics in timed.items():
        n = metrics["world_size"]
        hops = layers * ((n - 1) + (n - 1) + n)  # forward: N - 1; backward: N - 1, and the gradients' N
        compute = [1e3 * s for s in metrics["attention_compute_s_per_rank"]]
        found[name] = {
            "compute": compute,
            "wait": [1e3 * s for s in metrics["attention_wait_s_per_rank"]],
            "transfer": [1e3 * hops * s for s in metrics["ring_hop_s_per_rank"]],
            "step_compute": [c / (layers * 2 * n) for c in compute],  # N steps a pass, forward and backward
            "hop": [1e3 * s for s in metrics["ring_hop_s_per_rank"]],
        }
        for rank in range(n):
            row = [found[name][kind][rank] for kind in ("compute", "wait", "transfer", "step_compute", "hop")]
            print(f"{name:10s} {rank:4d} {metrics['attention_blocks_per_rank'][rank]:6d} {row[0]:8.1f} {row[1]:8.1f} "
                  f"{row[2]:9.1f} {row[3]:22.1f} {row[4]:8.2f}")  # fmt: skip
    return found


def draw_timeline(run: dict, layers: int, loaded: bool):
    """Layer 0's forward and backward of the last training step, one row per rank: posts, computations, waits."""
    n = run["world_size"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2))
    for ax, (pass_, call) in zip(axes, (("forward", 0), ("backward", -1))):  # backward runs the layers last to first
        for rank, calls in enumerate(run["ring_timeline_per_rank"]):
            computations = 0
            for kind, start, end in calls[call]["events"]:
                _, colour, height = KINDS[kind]
                width = max(end - start, 0.15)  # a post takes a fraction of a millisecond: drawn visible
                ax.broken_barh([(start, width)], (rank - height / 2, height), color=colour)
                if kind == "compute":
                    ax.text(start + width / 2, rank, str(computations), ha="center", va="center", color="white",
                            fontsize=10)  # fmt: skip
                    computations += 1
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=10)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlabel("time since the rank entered this layer's ring attention (ms)", fontsize=10)
        ax.set_title(f"layer 0, {pass_}", fontsize=11)
    fig.legend(handles=[Patch(color=c, label=w) for w, c, _ in KINDS.values()], loc="lower center", ncol=2,
               fontsize=10)  # fmt: skip
    fig.suptitle(
        f"Ring attention's events on {n} ranks, --cp-split zigzag, the last training step (CPU, gloo)"
        + ("\nmeasured under load: read the order, not the durations" if loaded else ""),
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    plt.show()


def draw_memory(metrics: dict):
    """One attention layer, one sequence: bytes kept for backward (and the ring's peak per rank) against the
    sequence length, on log-log axes."""
    lengths, n = metrics["memory_seq_lens"], metrics["world_size"]
    ring = metrics["memory_ring_per_rank"][0]
    written_out, fused = metrics["memory_written_out_one_process"], metrics["memory_fused_one_process"]
    curves = {
        "1 process, attention written out (keeps the T x T softmax)": [s for s, _ in written_out],
        "1 process, PyTorch's fused attention": [s for s, _ in fused],
        f"ring attention, per rank ({n} ranks), kept for backward": [s for s, _ in ring],
        f"ring attention, per rank ({n} ranks), at its peak": [p for _, p in ring],
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for (label, values), style in zip(curves.items(), ("o-", "s-", "^--", "v:")):
        ax.plot(lengths, values, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length T (tokens)", fontsize=11)
    ax.set_ylabel("bytes (one sequence, one layer)", fontsize=11)
    ax.set_title(f"One attention layer's activations, {metrics['memory_shape'][1]} heads of "
                 f"{metrics['memory_shape'][2]}, fp32", fontsize=11)  # fmt: skip
    ax.legend(fontsize=10)
    fig.tight_layout()
    plt.show()
    return curves


def overlap_report(timed: dict, layers: int) -> dict:
    """overlap_table's table, then for each run the balance of its busiest and least busy rank (in blocks, exact;
    in compute time, measured), and what zigzag's figures show: whether every hop is shorter than the ring step's
    computation it runs beside (zigzag: every rank computes at every step). Returns overlap_table's figures."""
    found = overlap_table(timed, layers)
    for split, times in found.items():
        blocks = timed[split]["attention_blocks_per_rank"]
        print(f"{split:10s} busiest / least busy rank: {max(blocks) / min(blocks):.2f} in blocks (exact), "
              f"{max(times['compute']) / min(times['compute']):.2f} in compute time")  # fmt: skip
    times = found["zigzag"]
    hidden = all(hop < step for hop, step in zip(times["hop"], times["step_compute"]))
    print(
        "zigzag: "
        + (
            "every hop is shorter than the ring step's computation it runs beside: posted first, it is "
            "hidden, and what a rank waits for is its neighbour, still computing (its share, or other jobs on its core)"
            if hidden
            else "a hop takes longer than a ring step's computation: part of every transfer is waited for"
        )
    )
    return found


def fastest_by_cp(model_of, cluster, seq_lens, cps, sequences: int = 16) -> dict:
    """Print, for each sequence length and CP degree, how many layouts fit and the fastest of them (lesson 06's
    planner, a fused attention kernel); return {(seq_len, cp): its prediction, or None when none fits}.
    model_of(seq_len) -> the planner's Model."""
    print(f"{'tokens':>9s} {'cp':>3s} {'fit':>4s} {'tokens/s':>9s}  the fastest layout that fits")
    fastest = {}
    for seq_len in seq_lens:
        predictions = planner.plan(model_of(seq_len), cluster, sequences, micro_batches=(1,), cps=cps,
                                   virtual_stages=(1, 2))  # fmt: skip
        for cp in cps:
            fits = [pred for pred in predictions if pred.fits and pred.layout.cp == cp]
            fastest[seq_len, cp] = fits[0] if fits else None
            speed, layout = (fits[0].tokens_per_s, fits[0].layout) if fits else (0, "none fits")
            print(f"{seq_len:9,d} {cp:3d} {len(fits):4d} {speed:9,.0f}  {layout}")
    return fastest
