"""Notebook 03's launches, tables and plots: the formatting and drawing, so that each cell reads as what it shows
and the assertion that states its claim."""

import contextlib
import io
import statistics

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from utils.course.notebook import torchrun
from utils.lesson_03.metrics import wire_volume

KINDS_OF_COLLECTIVE = ("all_reduce", "all_gather", "reduce_scatter")
SHARDED = {"ddp": "", "zero1": "bucket", "zero2": "buckets", "zero3": "units", "fsdp": "parameters",
           "hsdp": "parameters"}  # fmt: skip


def launcher(script: str, common: list):
    """launch(nproc, *args): run `script` quietly with the `common` arguments first; return its metrics."""

    def launch(nproc, *args):
        with contextlib.redirect_stdout(io.StringIO()):
            return torchrun(script, nproc, [*common, *args])

    return launch


def padding(name: str, m: dict, rows: list) -> tuple[int, int, int]:
    """(buffers padded, buffers sharded, elements the padding adds): each buffer is padded to a multiple of the
    ranks it is sharded over; ZeRO's are flat (one element per row), FSDP2's are the parameters, padded by rows."""
    n = m["shard_ranks"]
    if name == "ddp":
        buffers = []
    elif name in ("fsdp", "hsdp"):
        buffers = rows
    else:
        buffers = [(b["numel"], 1) for b in m.get("buckets") or m["units"]]
    added = [(-count % n) * per_row for count, per_row in buffers]  # -count % n = ceil(count / n) * n - count
    return sum(a > 0 for a in added), len(buffers), sum(added)


def bytes_table(runs: dict, strategies: list, rows: list) -> dict:
    """Print each strategy's bytes per rank at each world size beside the estimator's and the padding; return
    {(strategy, ranks): padding(...)}. Checks that the padding the run reports is the one counted here."""
    print(f"Psi = {runs[1]['strategies']['ddp']['n_params']:,} parameters")
    header = f"{'strategy':<9}{'ranks':>6}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}"
    print(f"{header}   estimator  buffers padded, elements added")
    pads = {}
    for name in strategies:
        for n, run in runs.items():
            m = run["strategies"][name]
            held, estimate = m["bytes_per_rank"], m["estimated_bytes_per_rank"]
            cells = "".join(f"{held[k]:>{w},}" for k, w in (("params", 10), ("grads", 10), ("optimizer", 11)))
            same = "equal" if held == estimate else f"DIFFERS: {estimate}"
            padded, buffers, added = pads[name, n] = padding(name, m, rows)
            sharded = f"{padded} of {buffers} {SHARDED[name]}, {added:,}" if buffers else "nothing sharded"
            print(f"{name:<9}{n:>6}{cells}{sum(held.values()):>10,}   {same:<9}  {sharded}")
            assert added == m["padded_params"] - m["n_params"]
    return pads


def draw_bytes(runs: dict, strategies: list):
    """Left: what rank 0 holds at 4 ranks, by kind, beside the estimator; right: the total per rank vs ranks."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    kinds, colors = ["params", "grads", "optimizer"], ["#4c72b0", "#dd8452", "#55a868"]
    for i, name in enumerate(strategies):
        held, bottom = runs[4]["strategies"][name]["bytes_per_rank"], 0
        for kind, color in zip(kinds, colors):
            left.bar(i, held[kind] / 1e3, bottom=bottom / 1e3, color=color, label=kind if i == 0 else None)
            bottom += held[kind]
        estimate = sum(runs[4]["strategies"][name]["estimated_bytes_per_rank"].values())
        left.plot([i - 0.4, i + 0.4], [estimate / 1e3] * 2, color="black", lw=2, label="estimator" if i == 0 else None)
    left.set_xticks(range(len(strategies)), strategies)
    left.set_ylabel("model state per rank (kB)")
    left.set_title("4 ranks: what rank 0 holds")
    left.legend(fontsize=10)
    for name, marker in zip(strategies, "osD^vx"):
        totals = [sum(runs[n]["strategies"][name]["bytes_per_rank"].values()) / 1e3 for n in runs]
        right.plot(list(runs), totals, marker=marker, label=name)
    right.set_xticks(list(runs))
    right.set_ylim(bottom=0)
    right.set_xlabel("ranks")
    right.set_ylabel("model state per rank (kB)")
    right.set_title("model state per rank vs ranks (AdamW, fp32)")
    right.legend(fontsize=10)
    fig.suptitle(f"Measured bytes per rank (bars, lines) and utils.memory (black), {runs[1]['n_params']:,} parameters")
    plt.tight_layout()
    plt.show()


PREFETCH_KINDS = {  # each kind of bar: what it is, in words, and its colour
    "forward gather": ("all-gather for forward (issued to returned)", "#4c72b0"),
    "forward": ("forward compute", "#55a868"),
    "backward gather": ("all-gather for backward (issued to returned)", "#64b5cd"),
    "backward": ("backward compute", "#dd8452"),
    "reduce-scatter": ("gradient reduce-scatter", "#8172b2"),
}


def draw_prefetch(prefetch: dict, load_before: str, load_after: str, loaded: bool):
    """One panel per way of prefetching: rank 0's all-gathers, compute and reduce-scatters in one step, per unit."""
    units = ["root"] + [f"blocks.{i}" for i in range(prefetch["n_layers"])]
    fig, axes = plt.subplots(len(prefetch["modes"]), 1, figsize=(10, 8.5))
    for ax, (mode, title) in zip(axes, prefetch["modes"].items()):
        for unit, kind, start, end in prefetch["timelines"][mode][0]:  # rank 0
            ax.broken_barh([(start, end - start)], (units.index(unit) - 0.35, 0.7), color=PREFETCH_KINDS[kind][1])
        ax.set_yticks(range(len(units)), units)
        ax.invert_yaxis()
        ax.set_xlabel("time since the step started (ms)")
        ax.set_title(title, fontsize=11)
    legend = [Patch(color=c, label=w) for w, c in PREFETCH_KINDS.values()]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=10)
    fig.suptitle(
        "FSDP2: one training step on 2 ranks (rank 0 shown), CPU and gloo\n"
        f"load average {load_before} before the run, {load_after} after{' (under load)' if loaded else ''}: "
        "read the order, not the durations",
        fontsize=11,
    )
    plt.tight_layout(rect=(0, 0.07, 1, 1))
    plt.show()


OVERLAPS = {
    "ddp": "yes: all-reduces during backward",
    "zero1": "no",
    "zero2": "no: blocking, during backward",
    "zero3": "no",
    "fsdp": "yes: gathers prefetched, on own stream",
    "hsdp": "yes: gathers prefetched, on own stream",
}


def wire_in_psi(m: dict) -> float:
    """Bytes on the wire per step over Psi: the lesson's counters, or FSDP2's collectives counted by mesh dimension."""
    volume = m["wire_volume_per_step"]
    if volume is None:
        counted = [kinds for dim, kinds in m["library_wire_bytes"].items() if dim != "other"]
        volume = wire_volume({kind: sum(k.get(kind, 0) for k in counted) for kind in KINDS_OF_COLLECTIVE})
    return volume / (4 * m["padded_params"])


def time_table(runs: dict, strategies: list):
    """Each strategy's bytes on the wire (4 ranks), whether it overlaps compute, and its time per step at 2 and 4
    ranks (median, min, max of the steps after the first)."""
    columns = "".join(f"{n} ranks: median [min, max] ms".rjust(31) for n in (2, 4))
    print(f"\n{'strategy':<9}{'wire/Psi':>9}  {'overlaps compute':<40}{columns}")
    for name in strategies:
        cells = []
        for n in (2, 4):
            record = runs[n]["strategies"][name]
            times = [1e3 * t for t in record["step_times_s"][1:]]  # the steps after the first
            assert len(times) == record["steps"] - 1 and min(times) > 0
            cells.append(f"{statistics.median(times):.1f} [{min(times):.1f}, {max(times):.1f}]")
        wire = wire_in_psi(runs[4]["strategies"][name])
        print(f"{name:<9}{wire:>9.2f}  {OVERLAPS[name]:<40}{cells[0]:>31}{cells[1]:>31}")


def describe_hsdp(mesh):
    """The replicas x shards mesh, its shard groups (rows) and replicate groups (columns), and what each sends."""
    print("mesh (replicate x shard):", mesh.tolist())
    for row in mesh.tolist():
        print(f"  shard group {row}: all-gather parameters and reduce-scatter gradients every block (inside a node)")
    for column in mesh.t().tolist():
        print(f"  replicate group {column}: all-reduce each unit's gradient shard (across nodes)")


def draw_hsdp(mesh):
    """The replicas x shards mesh as nodes of ranks: shard groups inside a node, replicate groups across."""
    replicas, shards = mesh.shape
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for r in range(replicas):
        ax.add_patch(plt.Rectangle((r * 3 - 0.3, -0.6), 2.6, 1.8, fill=False, ls="--", color="gray"))
        ax.text(r * 3 + 1, 1.35, f"node {r}", ha="center", fontsize=11)
        for s in range(shards):
            ax.add_patch(plt.Circle((r * 3 + s * 2, 0.3), 0.35, color="#4c72b0"))
            ax.text(r * 3 + s * 2, 0.3, f"rank {mesh[r, s].item()}", ha="center", va="center", color="white",
                    fontsize=10)  # fmt: skip
        arrow = dict(arrowstyle="<->", color="#55a868", lw=2)
        ax.annotate("", (r * 3 + 1.65, 0.3), (r * 3 + 0.35, 0.3), arrowprops=arrow)
        ax.text(r * 3 + 1, 0.55, "shard group", ha="center", fontsize=10, color="#55a868")
    for s in range(shards):
        arrow = dict(arrowstyle="<->", color="#c44e52", lw=2, connectionstyle="arc3,rad=0.25")
        ax.annotate("", (3 + s * 2, -0.2), (s * 2, -0.2), arrowprops=arrow)
    ax.text(2.5, -1.05, "replicate groups (across the network)", ha="center", fontsize=10, color="#c44e52")
    ax.set_xlim(-1, 6)
    ax.set_ylim(-1.3, 1.7)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"HSDP on {replicas * shards} processes: a {replicas} x {shards} mesh")
    plt.show()


def draw_resume(continuous: list, saved: list, resumed: list):
    """The uninterrupted loss curve beside the saving run's steps and the resumed run's."""
    cut, end = len(saved), len(continuous)
    fig, ax = plt.subplots(figsize=(9, 4))
    uninterrupted = f"2 ranks, {end} steps without stopping"
    ax.plot(range(1, end + 1), continuous, color="gray", lw=4, alpha=0.5, label=uninterrupted)
    ax.plot(range(1, cut + 1), saved, label=f"4 ranks, steps 1-{cut}, then DCP save")
    ax.plot(range(cut + 1, end + 1), resumed, "--", label="2 ranks, resumed from the 4-rank checkpoint")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("Resharding: the loss curve continues across a 4 -> 2 rank restart")
    ax.legend(fontsize=10)
    plt.show()
