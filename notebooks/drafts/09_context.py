# ruff: noqa: E402  (a notebook in percent format: each cell imports what it uses)
# %% [markdown]
# ## Part 1: context parallelism, one sequence cut over the ranks (TODOs 1-5)
#
# Data parallelism splits the batch; tensor and pipeline parallelism split the model. None of them splits a
# **sequence**: every rank still holds the activations of all T tokens of the sequences it trains on, and attention's
# cost grows with T x T. When one sequence's activations do not fit, **context parallelism** (CP) cuts every sequence
# of the batch over N ranks. Each rank embeds, projects and predicts its own T/N tokens (norms, MLP and head work token
# by token); attention is the one place where a token needs the others, and there the keys and values travel around
# a **ring** of ranks (ring attention) while each rank folds every block it receives into its queries' softmax.
#
# - **The split (TODO 1).** `chunk_positions(seq_len, rank, N, split)` gives the places of the sequence a rank holds.
#   `contiguous`: chunk r of N. `zigzag`: chunks r and 2N-1-r of 2N, one from the start and its mirror from the end.
#   Each rank keeps those tokens and targets of every sequence, and passes the places to the model
#   (`TransformerLM.forward(tokens, positions)`) so that the position embedding and the causal mask see where each
#   token sits in the whole sequence.
# - **One block (TODO 2).** `block_attention` is causal attention of a rank's queries on one block of keys: the
#   scores q k^T / sqrt(d), with every key that comes later in the sequence hidden (compare **global** positions),
#   give the block's output and its **log-sum-exp** (lse), the log of what the softmax divided by.
# - **The online softmax (TODO 3).** `merge` folds a block's (output, lse) into the running ones: over both parts the
#   normaliser is exp(lse) + exp(block_lse), so new_lse = logaddexp(lse, block_lse) (computed around the running
#   maximum, so nothing overflows) and each part is re-weighted by its share, exp(lse - new_lse). After every block,
#   the running output is exactly softmax(all scores) v.
# - **The ring forward (TODO 4).** N steps; at step s a rank holds the block of rank r - s. It first posts the next
#   exchange (`isend` to r + 1, `irecv` from r - 1), then computes on the block it holds, then waits: the transfer runs
#   during the computation (the overlap). A block of keys entirely in the future of a piece of queries is skipped:
#   that skipping is where the causal **imbalance** comes from, and what zigzag evens out.
# - **The ring backward (TODO 5).** An autograd Function (`RingAttention`) that saves only the rank's own q, k, v,
#   output and lse (no score matrix, no other rank's block) and runs the ring again: each block travels with the
#   gradient it has collected (dK, dV), one more hop than the keys, so that the gradient comes home to the block's owner
#   summed over every rank's queries. Every rank holds the whole model, so the parameters' gradients are then
#   averaged over the ranks, as in lesson 02.

# %%
import sys

sys.path.insert(0, "..")  # the course folder: `import utils` works from notebooks/

import torch
import torch.nn.functional as F

from utils.lessons import lesson

cp = lesson("09")  # solutions/09_context_and_experts.py as a module: its functions, without running its main()

# %% [markdown]
# ### The split (TODO 1)
#
# The places each of 4 ranks holds in a sequence of 32 tokens, in both splits, from the lesson's `chunk_positions`:

# %%
import matplotlib.pyplot as plt

N, T = 4, 32
splits = {split: [cp.chunk_positions(T, r, N, split) for r in range(N)] for split in ("contiguous", "zigzag")}
for split, held in splits.items():
    print(f"{split:10s} " + " | ".join(f"rank {r}: {cp.context_summary(p)}" for r, p in enumerate(held)))
    assert sorted(torch.cat(held).tolist()) == list(range(T))  # every place on exactly one rank
assert all(len(p) == T // N for p in splits["zigzag"])
assert splits["zigzag"][0].tolist()[-1] == T - 1  # rank 0 holds the first chunk and the last

fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
colours = plt.get_cmap("tab10")
for ax, (split, held) in zip(axes, splits.items()):
    for rank, places in enumerate(held):
        ax.bar(places.tolist(), 1, width=1.0, color=colours(rank), edgecolor="white")
    ax.set_yticks([])
    ax.set_title(f"--cp-split {split}: which rank holds each token", fontsize=11)
axes[-1].set_xlabel("place in the sequence (token)", fontsize=11)
handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(N)]
fig.legend(handles, [f"rank {r}" for r in range(N)], ncol=N, fontsize=10, loc="lower center", frameon=False)
fig.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# %% [markdown]
# ### One block, and the online softmax (TODOs 2 and 3)
#
# The queries of one chunk against the keys of the whole sequence, cut into blocks: each block's output and lse
# from `block_attention`, folded one after another with `merge`, starting from out = 0, lse = -inf. The result is
# PyTorch's own causal attention on the whole sequence, to float32 rounding:

# %%
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, T, 8, generator=generator) for _ in range(3))
places = torch.arange(T)
queries = places[16:24]  # one chunk of queries
out = torch.zeros(1, 2, len(queries), 8)
lse = torch.full((1, 2, len(queries)), float("-inf"))
for block in places.chunk(4):  # four blocks of keys, in the order a ring would bring them
    if block[0] > queries[-1]:
        continue  # entirely in the future of every query: skipped, as the ring does
    block_out, block_lse = cp.block_attention(q[..., queries, :], k[..., block, :], v[..., block, :], queries, block)
    out, lse = cp.merge(out, lse, block_out, block_lse)
reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., queries, :]
difference = (out - reference).abs().max().item()
print(f"blocks merged with the online softmax vs F.scaled_dot_product_attention: max |difference| = {difference:.1e}")
assert difference < 1e-5

# %% [markdown]
# ### The ring, live (TODO 4)
#
# The cell runs the lesson's `ring_attention_forward` on 4 ranks simulated by 4 threads of this notebook, which pass
# their blocks through queues in place of `isend`/`irecv` (the lesson's tests do the same). It records which block of
# queries against which block of keys each rank computes, and at which step of the ring, then draws it: a square per
# (query piece, key piece) of the sequence, coloured by the rank that computes it, the ring step written inside.
# Above the diagonal (keys after queries) nothing is computed: the causal mask, skipped a block at a time.

# %%
import queue
import threading


class LocalRing:
    """The lesson's Ring for one simulated rank: a queue per (sender, receiver) instead of isend/irecv."""

    def __init__(self, rank, size, mailbox, record):
        self.rank, self.size, self.mailbox, self.record, self.step = rank, size, mailbox, record, 0

    def start(self, tensor, send_to, receive_from):
        self.mailbox[(self.rank, send_to)].put(tensor.clone())
        ring = self

        class Pending:
            def wait(self):
                ring.step += 1  # the next block arrives: the next step of the ring
                return ring.mailbox[(receive_from, ring.rank)].get(timeout=10)

        return Pending()

    def count(self, queries, keys):
        pass


def ring_on_threads(split, n=N, seq_len=T):
    """Run the lesson's ring forward on n threads; return the output and [(rank, step, query place, key place)]."""
    all_positions = [cp.chunk_positions(seq_len, r, n, split) for r in range(n)]
    mailbox = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    computed, outputs, rings = [], [None] * n, []
    original = cp.block_attention

    def recording(q, k, v, q_positions, k_positions):  # the lesson's block_attention, noting what it is given
        ring = rings[threading.current_thread().rank]
        computed.append((ring.rank, ring.step, int(q_positions[0]), int(k_positions[0])))
        return original(q, k, v, q_positions, k_positions)

    def work(rank):
        threading.current_thread().rank = rank
        mine = all_positions[rank]
        pieces = [t[..., mine, :].contiguous() for t in (q, k, v)]
        outputs[rank] = cp.ring_attention_forward(*pieces, mine, all_positions, rings[rank])[0]

    rings.extend(LocalRing(r, n, mailbox, computed) for r in range(n))
    cp.block_attention = recording
    try:
        threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
        [t.start() for t in threads]
        [t.join(timeout=30) for t in threads]
    finally:
        cp.block_attention = original
    out = torch.zeros_like(q)
    for rank, places_of_rank in enumerate(all_positions):
        out[..., places_of_rank, :] = outputs[rank]
    return out, computed


piece = T // (2 * N)  # the unit of work: half a rank's tokens
fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
for ax, split in zip(axes, ("contiguous", "zigzag")):
    out, computed = ring_on_threads(split)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    cells = {(qp // piece, kp // piece) for _, _, qp, kp in computed}
    assert len(cells) == len(computed)  # each block computed once, by one rank
    assert cells == {(i, j) for i in range(T // piece) for j in range(i + 1)}  # exactly the causal triangle
    for rank, step, qp, kp in computed:
        row, col = qp // piece, kp // piece
        ax.add_patch(plt.Rectangle((col, row), 1, 1, color=colours(rank), alpha=0.85))
        ax.text(col + 0.5, row + 0.5, str(step), ha="center", va="center", fontsize=10, color="white")
    ax.set_xlim(0, T // piece)
    ax.set_ylim(T // piece, 0)
    ax.set_aspect("equal")
    ax.set_xticks(range(0, T // piece + 1, 2), [str(i * piece) for i in range(0, T // piece + 1, 2)])
    ax.set_yticks(range(0, T // piece + 1, 2), [str(i * piece) for i in range(0, T // piece + 1, 2)])
    ax.set_xlabel("keys: place in the sequence (token)", fontsize=11)
    ax.set_ylabel("queries: place in the sequence (token)", fontsize=11)
    work = [sum(1 for r, *_ in computed if r == rank) for rank in range(N)]
    ax.set_title(f"--cp-split {split}: blocks per rank {work}", fontsize=11)
handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(N)]
fig.legend(handles, [f"rank {r}" for r in range(N)], ncol=N, fontsize=10, loc="lower center", frameon=False)
fig.suptitle(f"Ring attention on {N} ranks, {T} tokens: who computes each block (number: ring step)", fontsize=12)
fig.tight_layout(rect=(0, 0.06, 1, 1))
plt.show()

# %% [markdown]
# Both splits compute the same causal triangle, each block once, and give PyTorch's attention. With contiguous
# chunks the last rank's queries see every earlier key: it computes the most blocks, at every step, while rank 0
# computes at step 0 only and then waits for the others. With zigzag every rank holds one early and one late chunk
# and computes as many blocks as every other.
#
# ### Training: the same model as one process (TODO 5)
#
# The script at 2 and 4 ranks, both splits, against lesson 00's solution on one process with the same global batch
# (every rank reads the same 4 sequences and keeps its places of them), the same seed and SGD:

# %%
import contextlib
import io
import tempfile
from pathlib import Path

from utils.notebook import torchrun

COMMON = [
    "--dim", 32, "--n-layers", 2, "--n-heads", 2, "--seq-len", T, "--steps", 3, "--batch-size", 4,
    "--optimizer", "sgd", "--log-every", 3, "--log-dir", "runs/09_notebook",
]  # fmt: skip
saved = Path(tempfile.mkdtemp())


def launch(nproc, *args, name, script="solutions/09_context_and_experts.py"):
    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's log carries timings: not shown here
        return torchrun(script, nproc, [*COMMON, *args, "--checkpoint", saved / f"{name}.pt"])


runs = {"lesson 00, 1 process": launch(1, name="lesson 00", script="solutions/00_setup_and_baseline.py")}
for n, split in ((2, "zigzag"), (4, "contiguous"), (4, "zigzag")):
    runs[f"cp {split}, {n} ranks"] = launch(n, "--parallel", "cp", "--cp-split", split, name=f"{n}{split}")

# %%
TOLERANCE = 1e-6  # fp32 with SGD: ring attention adds the same terms in another order (the lesson's tests' bound)
names = dict(zip(runs, ("lesson 00", "2zigzag", "4contiguous", "4zigzag")))
weights = {name: torch.load(saved / f"{names[name]}.pt", weights_only=True)["model"] for name in runs}
reference, reference_weights = runs["lesson 00, 1 process"], weights["lesson 00, 1 process"]
print(f"{'run':24s} {'final loss':>10s} {'checksum':>14s} {'max |difference|':>17s}")
for name, metrics in runs.items():
    difference = max(float((weights[name][p] - reference_weights[p]).abs().max()) for p in reference_weights)
    print(f"{name:24s} {metrics['final_loss']:10.6f} {metrics['param_checksum']:14.6f} {difference:17.1e}")
    assert difference <= TOLERANCE and weights[name].keys() == reference_weights.keys()
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(metrics["losses"], reference["losses"]))

# %% [markdown]
# Every run ends with lesson 00's parameters, to float32 rounding: the ring changes where attention is computed and
# in which order its terms are added, not what it computes.
#
# ### What each rank does: work, bytes, time
#
# **Work.** The blocks of (query piece, key piece) each rank computes in one layer's forward, from the runs' metrics
# (each piece is T/2N tokens, so a block is the same work on every rank and in both splits):

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
width = 0.38
for offset, split in ((-width / 2, "contiguous"), (width / 2, "zigzag")):
    pairs = runs[f"cp {split}, 4 ranks"]["attention_pairs_per_rank"]
    ax.bar([r + offset for r in range(4)], pairs, width=width, label=f"--cp-split {split}")
ax.set_xticks(range(4), [f"rank {r}" for r in range(4)], fontsize=10)
ax.set_ylabel("blocks computed per layer (forward)", fontsize=10)
ax.set_title("The causal work per rank, 4 ranks", fontsize=11)
ax.legend(fontsize=10)
fig.tight_layout()
plt.show()
contiguous, zigzag = (runs[f"cp {s}, 4 ranks"]["attention_pairs_per_rank"] for s in ("contiguous", "zigzag"))
print(f"contiguous: {contiguous} (sum {sum(contiguous)}), zigzag: {zigzag} (sum {sum(zigzag)})")
assert contiguous == sorted(contiguous) and len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous)
assert max(zigzag) < max(contiguous)

# %% [markdown]
# The same total either way; contiguous gives the last rank the most, and every step of the ring waits for the
# slowest rank, so the step takes as long as the last rank's share. Zigzag gives every rank the same.
#
# **Time.** Seconds per training step each rank spent computing in ring attention (forward and backward, waiting
# excluded) and waiting for a neighbour. These are timings on a shared CPU machine, printed with its load: they say
# how the work was spread, not how fast anything is.

# %%
# NBVAL_IGNORE_OUTPUT
from utils.measured import load_average

print(f"load average now: {load_average()}")
for split in ("contiguous", "zigzag"):
    metrics = runs[f"cp {split}, 4 ranks"]
    compute = " ".join(f"{1e3 * s:6.1f}" for s in metrics["attention_compute_s_per_rank"])
    wait = " ".join(f"{1e3 * s:6.1f}" for s in metrics["attention_wait_s_per_rank"])
    print(f"{split:10s} compute ms/step by rank: {compute}   waiting: {wait}")

# %% [markdown]
# **Bytes.** Per layer, the forward sends each rank's keys and values N - 1 times (2 x (N-1) x the bytes of one
# rank's keys, B x T/N x d x 4 in fp32); the backward sends them N - 1 times again, plus their gradients N times (the
# last hop brings each rank's own home): (2(N-1) + 2N) x that. The formula against what each run's ranks counted:

# %%
args = dict(zip(COMMON[::2], COMMON[1::2]))
layers, batch, dim = args["--n-layers"], args["--batch-size"], args["--dim"]
print(f"{'run':24s} {'forward B/step':>15s} {'formula':>9s} {'backward B/step':>16s} {'formula':>9s}")
for name, metrics in runs.items():
    if "ring_bytes_per_step" not in metrics:
        continue
    n = metrics["world_size"]
    chunk = batch * T // n * dim * 4
    forward, backward = layers * 2 * (n - 1) * chunk, layers * (2 * (n - 1) + 2 * n) * chunk
    sent = metrics["ring_bytes_per_step"]
    print(f"{name:24s} {sent['forward'][0]:15,d} {forward:9,d} {sent['backward'][0]:16,d} {backward:9,d}")
    assert sent["forward"] == [forward] * n and sent["backward"] == [backward] * n

# %% [markdown]
# **Memory.** What one attention layer keeps for backward on each rank, for one sequence, measured with
# `torch.autograd.graph.saved_tensors_hooks` (utils/context_parallel.py) at 1, 2 and 4 times the sequence length:
# the ring keeps its own q, k, v, output and lse, T/N tokens each; PyTorch's fused attention on one process keeps the
# same tensors for all T tokens. Both grow linearly with T (no T x T score matrix is kept), and CP divides them by N:

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
one = runs["cp zigzag, 4 ranks"]
seq_lens = one["attention_seq_lens"]
ax.plot(seq_lens, one["attention_saved_bytes_one_process"], "o-", label="1 process (F.scaled_dot_product_attention)")
for name in ("cp zigzag, 2 ranks", "cp zigzag, 4 ranks"):
    metrics = runs[name]
    per_rank = metrics["attention_saved_bytes_per_rank"][0]
    ax.plot(seq_lens, per_rank, "s--", label=f"ring attention, per rank, {metrics['world_size']} ranks")
    for at, one_process in enumerate(metrics["attention_saved_bytes_one_process"]):
        assert all(r[at] * metrics["world_size"] == one_process for r in metrics["attention_saved_bytes_per_rank"])
ax.set_xlabel("sequence length (tokens)", fontsize=11)
ax.set_ylabel("bytes saved for backward (one sequence)", fontsize=11)
ax.set_title("One attention layer's saved activations", fontsize=11)
ax.legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ### The built-in: `torch.distributed.tensor.experimental.context_parallel`
#
# Inside `with context_parallel(mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 0],
# no_restore_buffers={...})`, PyTorch cuts the buffers along their sequence dimension in place (head-tail "load
# balancing", its zigzag) and replaces every `F.scaled_dot_product_attention` with ring attention over the mesh
# (`set_rotate_method("alltoall")` passes the blocks around; `"allgather"` gathers them all at once). It dispatches
# only the fused attention kernels (flash, efficient, cuDNN), which exist on GPUs only: on this machine the script
# refuses `--impl builtin` in one line; where a GPU is visible it runs, and the cell compares it with lesson 00.

# %%
import os
import subprocess

command = [sys.executable, "../solutions/09_context_and_experts.py", "--parallel", "cp", "--impl", "builtin"]
command += [str(a) for a in COMMON]
if torch.cuda.is_available():
    builtin = launch(1, "--parallel", "cp", "--impl", "builtin", name="builtin")
    difference = abs(builtin["param_checksum"] - reference["param_checksum"]) / reference["param_checksum"]
    print(f"built-in context_parallel on {torch.cuda.get_device_name()}: checksum differs by {difference:.1e}")
else:
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    refusal = [line for line in result.stderr.splitlines() if "ERROR:" in line]
    print(refusal[0])
    assert result.returncode == 2 and len(refusal) == 1 and "--impl scratch" in refusal[0]
