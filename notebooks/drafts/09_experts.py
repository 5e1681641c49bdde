# ruff: noqa: E402  (a notebook's draft: each cell imports what it needs, as the notebook's cells will)
# %% [markdown]
# ## Part 2: expert parallelism, a mixture of experts split across ranks (TODOs 6-10)
#
# A **mixture of experts** (MoE) replaces each block's MLP by E experts (E MLPs of the same shape) and a **router**,
# a linear layer that scores every expert for every token. Each token goes to its k best experts only, so the model
# holds E times the MLP parameters while a token costs about k MLPs. **Expert parallelism** (EP) splits the experts
# over the ranks: with N ranks, rank r holds experts r E/N to (r+1) E/N - 1 and a copy of everything else (attention,
# norms, embeddings, routers, head), which trains data-parallel on the rank's own batch as in lesson 02. Tokens live
# where their sequence is; experts live where their weights are; so in every MoE layer the tokens travel to their
# experts and the results travel back, each time in one **all-to-all**.
#
# `solutions/09_context_and_experts.py --parallel ep` writes it in five steps:
#
# - **TODO 6, the router.** Softmax over all E logits, each token's top k experts, and their **gates**: the k
#   probabilities divided by their sum, so a token's output is a weighted mean of its experts' outputs. The
#   router also returns the **load-balancing loss** of the Switch Transformer, E x sum_e f_e x P_e, where f_e is the
#   fraction of the T x k choices that picked expert e (a count, without gradient) and P_e the mean probability of
#   e; it is 1 when the choices spread evenly and grows when they pile onto few experts. Weighted by
#   `--aux-loss-weight`, it pushes the router towards even loads through P_e.
# - **TODO 7, the capacity.** An expert takes at most capacity = ceil(C x T x k / E) rows from each rank
#   (`--capacity-factor C`, T the rank's tokens): a fixed size, so buffers and time per step are bounded. Choices
#   are served every token's first choice before any token's second; a choice over capacity is **dropped**: it adds
#   nothing, and the token keeps its residual stream. Each rank decides for its own tokens, before any
#   communication; one process that cuts the batch into the same groups makes the same decisions.
# - **TODO 8, the dispatch.** The kept choices are sorted by expert, so the rows for each rank are contiguous. A rank
#   does not know how many rows it will receive: the ranks first exchange their **counts** per expert (an
#   all-to-all of E numbers), then the rows, with `all_to_all_single` and **uneven splits** (input splits: rows for
#   each rank; output splits: rows from each rank, from the counts).
# - **TODO 9, the combine.** Each rank runs its experts on what it received and sends the results back with the
#   reverse all-to-all (the same splits, swapped); they come back in the order the rows were sent, and each is
#   multiplied by its gate and added to its token.
# - **TODO 10, the gradients.** The replicated parameters have one gradient per rank: average them (lesson 02). An
#   expert lives on one rank, and its gradient there already adds up what came back from every rank's tokens, each
#   rank's loss a mean over its own tokens: N times the gradient of the global mean. Divide it by N; never all-reduce
#   it (the other ranks hold other experts).
#
# The all-to-all is written from scratch as a small autograd function (`AllToAll`: forward one all-to-all, backward
# the same with the splits swapped); `--impl builtin` uses torch's own autograd form,
# `torch.distributed.nn.functional.all_to_all_single`. There is no built-in MoE layer in torch to compare with.

# %%
import sys

sys.path.insert(0, "..")  # the course folder: `import utils` works from notebooks/

import torch

from utils.lessons import lesson

moe_lesson = lesson("09")  # the lesson script as a module: its functions, without running its main()

# %% [markdown]
# ### The router and the capacity on 12 tokens
#
# One rank's 12 tokens, 4 experts, k = 2, capacity factor 1: capacity = ceil(1 x 12 x 2 / 4) = 6 rows per expert.
# The router's logits lean towards expert 0, as a router does before the balancing loss has taught it better. The
# table shows each token's two experts, their gates, and which choices were kept (`x` marks a dropped one).

# %%
generator = torch.Generator().manual_seed(0)
logits = torch.randn(12, 4, generator=generator) + torch.tensor([1.5, 0.5, 0.0, -0.5])
routing = moe_lesson.route(logits, k=2)
kept, capacity = moe_lesson.keep_within_capacity(routing.experts, n_experts=4, capacity_factor=1.0)
print(f"capacity {capacity} rows per expert; load-balancing loss {routing.aux_loss:.3f} (1 = perfectly even)")
print("token  experts  gates          kept")
for t in range(12):
    marks = " ".join("kept" if k else "x" for k in kept[t].tolist())
    gates = " ".join(f"{g:.2f}" for g in routing.gates[t].tolist())
    print(f"{t:5d}  {str(routing.experts[t].tolist()):8s} {gates:14s} {marks}")
chosen = torch.bincount(routing.experts.flatten(), minlength=4)
taken = torch.bincount(routing.experts[kept], minlength=4)
print(f"choices per expert {chosen.tolist()}, kept {taken.tolist()}, dropped {int((~kept).sum())}")
assert torch.allclose(routing.gates.sum(dim=1), torch.ones(12))  # each token's gates sum to 1
assert int(taken.max()) <= capacity and int((~kept).sum()) == int(chosen.sum() - taken.sum())
assert routing.aux_loss > 1  # the choices lean towards expert 0: the loss is above its balanced value

# %% [markdown]
# ### The data moving: a training run at 4 ranks
#
# Four ranks, 8 experts (2 per rank), k = 2: each rank's batch of 4 sequences of 32 tokens is 128 tokens, 256
# choices. The run records, for its first step, how many rows each rank sent to each rank in the first layer's
# dispatch. The combine sends the same numbers back (the matrix transposed), and backward does both again.

# %%
import contextlib
import io
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from utils.notebook import torchrun

SCRIPT = "solutions/09_context_and_experts.py"
COMMON = [
    "--parallel", "ep", "--dim", 32, "--n-layers", 2, "--n-heads", 2, "--seq-len", 32, "--batch-size", 4,
    "--log-dir", "runs/09_notebook",
]  # fmt: skip
saved = Path(tempfile.mkdtemp())


def launch(nproc, *args, name, show=False):
    # Run the lesson script; print rank 0's output without the lines that carry a timing.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = torchrun(SCRIPT, nproc, [*COMMON, *args, "--checkpoint", saved / f"{name}.pt"])
    if show:
        print("\n".join(line for line in out.getvalue().splitlines() if "tokens/s" not in line and "saved" not in line))
    return metrics


four = launch(4, "--experts", 8, "--steps", 3, "--optimizer", "sgd", "--log-every", 1, name="four", show=True)
matrix = torch.tensor([rank["send_splits"][0] for rank in four["all_to_all"]])  # [source, destination]
fig, ax = plt.subplots(figsize=(5, 4))
image = ax.imshow(matrix, cmap="Blues")
for s in range(4):
    for d in range(4):
        ax.text(d, s, int(matrix[s, d]), ha="center", va="center", fontsize=11)
ax.set_xticks(range(4), [f"rank {d}\n(experts {2 * d}, {2 * d + 1})" for d in range(4)], fontsize=9)
ax.set_yticks(range(4), [f"rank {s}" for s in range(4)], fontsize=10)
ax.set_xlabel("to (the experts' rank)", fontsize=11)
ax.set_ylabel("from (the tokens' rank)", fontsize=11)
ax.set_title("Rows sent in layer 0's dispatch, step 1\n(4 ranks, 8 experts, top-2, capacity factor 1.25)", fontsize=11)
fig.colorbar(image, ax=ax, label="rows (tokens)")
plt.tight_layout()
plt.show()
tokens = 4 * 32
assert all(sum(row) <= tokens * 2 for row in matrix.tolist())  # at most T x k rows leave a rank
assert int(matrix.sum()) == sum(four["expert_load"][0][0])  # every kept choice travels once

# %% [markdown]
# ### All-to-all bytes per step against the formula
#
# Per MoE layer and step, a rank's all-to-alls take as input: the counts (E int64 numbers), the S rows it
# dispatches (D fp32 numbers each), the R result rows it sends back, and in backward the gradients of both
# (S and R rows again): **2 (S + R) D x 4 + 8E bytes**. When the choices spread evenly and nothing is dropped,
# S = R = T k, which gives 4 T k D x 4 + 8E per layer; with drops and uneven loads S and R differ from rank to rank.
# (These are the tensors the collectives take; the 1/N of each that a rank keeps for itself does not cross the
# wire.) The cell compares the bytes counted on the collectives (`utils/collective_counter.py`) with the formula.

# %%
D, E, k, L = 32, 8, 2, 2
print(f"{'rank':>4s} {'rows sent':>10s} {'received':>9s} {'measured B':>11s} {'formula B':>10s} {'even, no drop':>14s}")
for rank, sent in enumerate(four["all_to_all"]):
    formula = sum(2 * (s + r) * D * 4 + 8 * E for s, r in sent["rows"])
    even = L * (4 * tokens * k * D * 4 + 8 * E)
    rows_sent, rows_received = (sum(layer[i] for layer in sent["rows"]) for i in (0, 1))
    print(f"{rank:4d} {rows_sent:10d} {rows_received:9d} {sent['bytes']:11,d} {formula:10,d} {even:14,d}")
    assert sent["bytes"] == formula
    assert rows_sent <= L * tokens * k  # drops only lower what a rank sends

# %% [markdown]
# ### The load per expert, without and with the balancing loss
#
# Two runs of 60 AdamW steps at 2 ranks, 4 experts, top-2, capacity factor 1.25, identical but for
# `--aux-loss-weight`: 0 (no balancing) and 0.1. The plots show, for the first MoE layer, the share of the choices
# each expert gets at every step (before the capacity: what the router asks for) and the choices dropped. Without
# the loss nothing stops the router from favouring a few experts: they overflow and drop choices while others idle.

# %%
runs = {}
for weight in (0.0, 0.1):
    runs[weight] = launch(2, "--experts", 4, "--steps", 60, "--log-every", 60, "--aux-loss-weight", weight,
                          name=f"balance{weight}")  # fmt: skip


def imbalance(metrics, last=20):
    # The busiest expert's share of the choices over the even share 1/E, layer 0, mean over the last steps
    shares = [max(step[0]) / sum(step[0]) * metrics["experts"] for step in metrics["expert_choices"][-last:]]
    return sum(shares) / len(shares)


fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
for ax, weight in zip(axes, runs):
    choices = torch.tensor([step[0] for step in runs[weight]["expert_choices"]], dtype=torch.float)
    shares = choices / choices.sum(dim=1, keepdim=True)
    for e in range(4):
        ax.plot(range(1, len(shares) + 1), shares[:, e], label=f"expert {e}")
    ax.axhline(0.25, color="grey", linestyle=":", label="even share")
    ax.set_title(f"aux-loss weight {weight}: layer 0", fontsize=11)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("share of the choices", fontsize=11)
    ax.legend(fontsize=9)
for weight, metrics in runs.items():
    axes[2].plot([sum(step) for step in metrics["dropped"]], label=f"aux-loss weight {weight}")
axes[2].set_title("choices dropped per step (both layers)", fontsize=11)
axes[2].set_xlabel("step", fontsize=11)
axes[2].set_ylabel("choices", fontsize=11)
axes[2].legend(fontsize=9)
plt.tight_layout()
plt.show()
for weight, metrics in runs.items():
    dropped = sum(map(sum, metrics["dropped"][-20:]))
    print(
        f"aux-loss weight {weight}: busiest expert at {imbalance(metrics):.2f} x the even share, {dropped} choices "
        f"dropped in the last 20 steps, final cross-entropy {metrics['final_loss']:.3f}"
    )
assert imbalance(runs[0.1]) < imbalance(runs[0.0])
assert sum(map(sum, runs[0.1]["dropped"][-20:])) < sum(map(sum, runs[0.0]["dropped"][-20:]))

# %% [markdown]
# ### Parity with one process
#
# The reference is the same MoE model on one process (`utils/experts.py`): every expert in one place, plain loops
# over tokens and experts, the global batch cut into the same N groups, each routed and capped on its own. After 3
# SGD steps, every parameter of the 4-rank run above, of a 2-rank run with the built-in all-to-all and of a 3-rank
# run must equal the reference's to float32 rounding. At 3 ranks the experts must split evenly: 6 experts run; 4
# are refused with one line.

# %%
import argparse

from utils.experts import train_reference

TOLERANCE = 1e-6
SGD = ["--steps", 3, "--optimizer", "sgd", "--log-every", 3]
parity = {  # name: (ranks, experts, capacity factor, extra arguments)
    "four": (4, 8, 1.25, []),
    "builtin_two": (2, 4, 1.0, ["--impl", "builtin"]),
    "three": (3, 6, 1.0, []),
}
print(f"{'run':12s} {'ranks':>5s} {'experts':>7s} {'impl':>8s} {'final loss':>10s} {'dropped':>7s} {'max |diff|':>10s}")
for name, (nproc, n_experts, factor, extra) in parity.items():
    if name == "four":
        metrics = four
    else:
        metrics = launch(nproc, "--experts", n_experts, "--capacity-factor", factor, *SGD, *extra, name=name)
    weights = torch.load(saved / f"{name}.pt", weights_only=True)["model"]
    options = argparse.Namespace(
        seed=0, dataset="synthetic", data_dir=None, seq_len=32, dim=32, n_layers=2, n_heads=2, batch_size=4, lr=0.2,
        steps=3, experts=n_experts, top_k=2, capacity_factor=factor, aux_loss_weight=0.01,
    )  # fmt: skip
    losses, _, reference = train_reference(options, groups=nproc)
    difference = max(float((weights[n] - reference[n]).abs().max()) for n in reference)
    dropped = sum(map(sum, metrics["dropped"]))
    print(
        f"{name:12s} {nproc:5d} {n_experts:7d} {metrics['impl']:>8s} {metrics['final_loss']:10.5f} {dropped:7d} "
        f"{difference:10.1e}"
    )
    assert weights.keys() == reference.keys() and difference <= TOLERANCE
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(metrics["losses"], losses))
import os
import subprocess

refused = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", f"../{SCRIPT}",
     *map(str, COMMON), "--experts", "4", *map(str, SGD)],
    capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
)  # fmt: skip
refusal = next(line for line in refused.stderr.splitlines() if "ERROR:" in line)
print(f"3 ranks, --experts 4: exit code {refused.returncode}, {refusal[refusal.index('ERROR:') :]}")
assert refused.returncode != 0 and "does not split evenly over 3 ranks" in refusal

# %% [markdown]
# ### EP with DP, and where EP sits in the rank grid
#
# This script makes every rank an expert rank: the EP group is the whole world, and the non-expert part is
# data-parallel over the same ranks. On a cluster, EP composes with DP the way lesson 06's dimensions compose: cut
# the world into EP groups of size `ep` (consecutive ranks, one node, since the all-to-all runs twice per layer
# forward and twice backward). Each EP group holds every expert once, so the ranks at the same place in different
# EP groups hold the same experts: a data-parallel group for them. Gradients then travel two ways: the non-expert
# part is averaged over **all** ranks; an expert's gradient, summed over its EP group's tokens by the all-to-all, is
# divided by `ep` and averaged over its expert-DP group (world / ep ranks). The all-to-all bytes depend on the
# tokens and on ep, not on the model's size; the expert parameters per rank fall as 1/ep. In lesson 06's grid, EP
# takes the place of (part of) the DP dimension for the MoE layers only: the attention layers still see
# pp x dp x tp, and the planner's layouts gain an `ep` that divides dp x cp (where Megatron-Core places it).
