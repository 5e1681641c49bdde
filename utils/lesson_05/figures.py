"""Lesson 05's charts and tables for the notebook: schedules drawn as timelines (ideal or measured), the zero-bubble
table, the measured bubble against the formula, and the two partitions compared in FLOPs.

    draw_schedules([(title, timelines), ...], unit="ms", scale=1000, figsize=(9, 8))  # one chart per schedule
"""

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from utils.lesson_05.plumbing import cost_aware_partition, forward_flops_per_token, stage_costs
from utils.lesson_05.timing import SWEEP_MICROBATCHES, sweep_means

COLORS = {"F": "#4C9BE8", "B": "#F2A541", "W": "#8BC34A"}
NAMES = {"F": "forward", "B": "backward (zero bubble: input's gradient)", "W": "weights' gradient (zero bubble)"}


def legend_handles() -> list:
    return [Patch(color=color, label=f"{kind}: {NAMES[kind]}, micro-batch i") for kind, color in COLORS.items()]


def draw_timeline(ax, timelines, title: str, unit: str = "s", scale: float = 1.0):
    """One row per rank; a box per F, B or W from its start to its end (an I, the input's gradient, is drawn as B),
    labelled with the micro-batch where the label fits (boxes narrower than 3% of the chart stay unlabelled); a
    primed label marks a rank's second stage (interleaved, ZBV)."""
    span = max(float(end) for timeline in timelines for _, _, _, end, *_ in timeline) * scale
    for rank, timeline in enumerate(timelines):
        for kind, mb, start, end, *stage in timeline:
            start, end = float(start) * scale, float(end) * scale
            color = COLORS["B" if kind == "I" else kind]
            ax.barh(rank, end - start, left=start, color=color, edgecolor="black", linewidth=0.5)
            second = bool(stage) and stage[0] >= len(timelines)  # this rank's second stage
            label = f"{mb}'" if second else f"{mb}"
            if end - start >= 0.03 * span:
                ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=10)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=11)


def draw_schedules(panels, *, unit: str, scale=1.0, figsize, sharex=False, legend=None, title=None):
    """One chart per (title, every rank's timeline) in `panels`, stacked (a timeline of None: "timings not
    recorded"), one legend for all (`legend`: where, as fig.legend's keywords) and the figure's `title`."""
    fig, axes = plt.subplots(len(panels), 1, figsize=figsize, sharex=sharex)
    for ax, (name, timelines) in zip(axes, panels):
        if timelines is None:
            ax.set_title(f"{name}: timings not recorded")
            continue
        draw_timeline(ax, timelines, name, unit=unit, scale=scale)
    fig.legend(handles=legend_handles(), ncol=2, fontsize=10, **(legend or {}))
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    plt.tight_layout()
    plt.show()


def measured_title(name: str, metrics: dict) -> str:
    """A run's chart title: its layout, the measured idle fraction and the formula's (none for zero bubble)."""
    formula = metrics["bubble_predicted"]
    return (
        f"{name}, p={metrics['world_size']}, m={metrics['microbatches']}, measured idle "
        f"{metrics['bubble_measured']:.2f}" + (f" (formula {formula:.2f})" if formula is not None else " (no formula)")
    )


def print_ideal(ideal: dict, p: int, m: int, n_layers):
    """The zero-bubble table: each schedule's step and idle fraction on the ideal machine, and where its order is
    from (the course's step lists for 1F1B, torch's pipeline_order for the others)."""
    print(f"p = {p} ranks, m = {m} micro-batches, {n_layers} blocks; time in units of one block's forward")
    print(f"{'schedule':15s} {'order from':24s} {'step':>5s}  idle fraction")
    for name, (timelines, idle) in ideal.items():
        step = max(end for timeline in timelines for _, _, _, end, _ in timeline)
        source = "the course's step lists" if name == "1F1B" else "torch's pipeline_order"
        print(f"{name:15s} {source:24s} {str(step):>5s}  {str(idle):>5s} = {float(idle):.3f}")


def plot_bubble_sweep(sweep: dict):
    """The measured idle fraction of GPipe and 1F1B at each m (mean over the steps after the first, the range as
    error bars), beside the formula, one chart per world size of the sweep file."""
    fig, axes = plt.subplots(1, len(sweep), figsize=(9, 4), sharey=True, squeeze=False)
    for ax, (p, table) in zip(axes[0], sorted(sweep.items())):
        fine = [1 + i / 10 for i in range(71)]
        ax.plot(fine, [(int(p) - 1) / (m + int(p) - 1) for m in fine], "k--", label="formula (p-1)/(m+p-1)")
        for schedule, marker, shift in (("gpipe", "o", 0.94), ("1f1b", "s", 1.06)):  # side by side, not on top
            name = "GPipe" if schedule == "gpipe" else "1F1B"
            for index, point in enumerate(sweep_means(table, schedule)):
                ax.errorbar(point.m * shift, point.mean, yerr=[[point.mean - point.low], [point.high - point.mean]],
                            fmt=marker, capsize=3, color="C0" if schedule == "gpipe" else "C1",
                            label=f"{name} measured" if index == 0 else None)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP_MICROBATCHES, [str(m) for m in SWEEP_MICROBATCHES])
        ax.set_ylim(0, 1)
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"p = {p}, {table['device']}" + (": under load" if table.get("loaded", True) else ""), fontsize=11)
    axes[0][0].set_ylabel("idle fraction of the step")
    axes[0][0].legend(fontsize=10, loc="upper right")
    fig.suptitle("Measured bubble (the dashed line is the formula)", fontsize=11)
    plt.tight_layout()
    plt.show()


@dataclass
class Partitions:
    pieces: dict  # forward FLOPs per token of the embeddings, one block and the head
    sizes: dict  # partition name -> blocks per stage
    slowest: dict  # partition name -> the slowest stage's forward FLOPs per token


def compare_partitions(label: str, config, p: int, equal_blocks) -> Partitions:
    """Print, for `config` on p stages, each piece's forward FLOPs per token, then for the equal-blocks partition
    (TODO 1's, given) and the cost-aware one the blocks and FLOPs of each stage, and the slowest stages' ratio."""
    pieces = forward_flops_per_token(config)
    blocks = [pieces["block"]] * config.n_layers
    flops = ", ".join(f"{name} {value:,}" for name, value in pieces.items())
    print(f"{label}: {config.n_layers} blocks on {p} stages; forward FLOPs per token: {flops}")
    partitions = {
        "equal blocks (TODO 1)": equal_blocks,
        "cost-aware": cost_aware_partition(blocks, p, pieces["embedding"], pieces["head"]),
    }
    result = Partitions(pieces, {}, {})
    for name, ranges in partitions.items():
        costs = stage_costs(ranges, blocks, pieces["embedding"], pieces["head"])
        result.slowest[name] = max(costs)
        result.sizes[name] = [end - start for start, end in ranges]
        mflops = [f"{cost / 1e6:.3g}" for cost in costs]
        print(f"  {name:22s} blocks per stage {result.sizes[name]}, forward MFLOPs per token per stage {mflops}")
    ratio = result.slowest["cost-aware"] / result.slowest["equal blocks (TODO 1)"]
    print(f"  slowest stage, cost-aware / equal blocks: {ratio:.3f} (the step-time ratio, many micro-batches)")
    return result
