"""Lesson 04's pictures: the f/g pair around a split MLP, and the per-rank memory of the runs against the formulas."""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch


def _box(ax, x, y, w, h, text, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="black"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=10)


def _arrow(ax, x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", lw=1.2))


def draw_f_and_g():
    """A tensor-parallel MLP on 2 ranks: f before the column-parallel up, g after the row-parallel down."""
    fig, ax = plt.subplots(figsize=(11, 4.4))
    _box(ax, 0.0, 1.6, 1.0, 0.8, "x [B, T, D]\nwhole on\nevery rank", "#eeeeee")
    _box(ax, 1.4, 1.6, 0.8, 0.8, "f", "#9ecae1")
    for r, y in enumerate((2.7, 0.5)):
        _box(ax, 2.7, y, 2.3, 0.8, f"rank {r}: gelu(x @ up{r}.T)\n= h{r}, [B, T, 4D / N]", "#fdd0a2")
        _box(ax, 5.5, y, 2.3, 0.8, f"rank {r}: h{r} @ down{r}.T\npartial sum [B, T, D]", "#fdd0a2")
        _arrow(ax, 2.2, 2.0, 2.7, y + 0.4)
        _arrow(ax, 5.0, y + 0.4, 5.5, y + 0.4)
        _arrow(ax, 7.8, y + 0.4, 8.3, 2.0)
    _box(ax, 8.3, 1.6, 0.8, 0.8, "g", "#a1d99b")
    _box(ax, 9.5, 1.6, 1.0, 0.8, "y [B, T, D]\nwhole on\nevery rank", "#eeeeee")
    _arrow(ax, 1.0, 2.0, 1.4, 2.0)
    _arrow(ax, 9.1, 2.0, 9.5, 2.0)
    ax.text(1.8, 1.45, "forward: identity\nbackward:\nall-reduce", ha="center", va="top", fontsize=10, color="#08519c")
    ax.text(8.7, 1.45, "forward:\nall-reduce\nbackward: identity", ha="center", va="top", fontsize=10, color="#006d2c")
    ax.text(3.85, 3.7, "column-parallel (up; also q, k, v):\nrows of the weight split", ha="center", fontsize=10)
    ax.text(6.65, 3.7, "row-parallel (down; also o):\ncolumns of the weight split", ha="center", fontsize=10)
    ax.set_xlim(-0.1, 10.6)
    ax.set_ylim(0.2, 4.5)
    ax.axis("off")
    ax.set_title("A tensor-parallel MLP on N = 2 ranks: f enters the parallel region, g leaves it", fontsize=12)
    return fig


def plot_memory(runs, param_bytes, activation_estimate, sizes, model: str):
    """Parameters and saved activations per rank against TP size: the formulas as lines, the DTensor runs as
    points. `model` names the model's sizes in the right panel's title."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [param_bytes(n) / 1e3 for n in sizes], "-", color="tab:blue", label="formula")
    measured = [(m["tp_size"], m["bytes_per_rank"]["params"] / 1e3) for k, m in runs.items() if "dtensor" in k]
    left.plot(*zip(*measured), "o", color="tab:blue", label="measured (metrics file)")
    left.set(title="Parameters per rank", xlabel="TP size (ranks)", ylabel="kB (fp32)", xticks=sizes)
    for sp, color in ((False, "tab:orange"), (True, "tab:green")):
        label = "TP + sequence parallel" if sp else "TP"
        estimates = [activation_estimate(n, sp) / 1e3 for n in sizes]
        right.plot(sizes, estimates, "-", color=color, label=f"{label}: estimate")
        points = [
            (m["tp_size"], m["activation_bytes"] / 1e3)
            for m in runs.values()
            if "tp_size" in m and m["sequence_parallel"] == sp and m["tp_impl"] == "dtensor"
        ]
        right.plot(*zip(*points), "o", color=color, label=f"{label}: measured")
    right.set(
        title=f"Activations saved for backward, per rank\n({model})",
        xlabel="TP size (ranks)",
        ylabel="kB (fp32)",
        xticks=sizes,
    )
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=10)
    fig.suptitle("Per-rank memory of the course model under tensor parallelism (CPU, gloo)", fontsize=12)
    fig.tight_layout()
    return fig
