"""The picture of a collective: each row a rank, each square an element with its value, before and after.

Colours say where an element's value came from (a rank's colour, or grey for a sum over ranks) and arrows show
which rank's data reached which rank."""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

RANK_COLOURS = ["#8ecae6", "#ffb703", "#90be6d", "#f4978e", "#cdb4db", "#a8dadc", "#ffd6a5", "#bde0fe"]
SUM_COLOUR, EMPTY_COLOUR = "#c8c8c8", "white"


def source(name: str, n: int, q: int, k: int, length: int):
    """Which rank element k of rank q's result came from, or "sum" (all ranks added), or None."""
    chunk = max(length // n, 1)
    if name in ("all_reduce", "reduce_scatter") or (name == "reduce" and q == 0):
        return "sum"
    return {"broadcast": 0, "all_gather": k // length, "all_to_all": k // chunk, "send_recv": (q - 1) % n}.get(name)


def draw_collective(name: str, title: str, before: list[list[float]], after: list):
    """Draw collective `name` from every rank's tensor before and after it (None: nothing defined on that rank)."""
    n, length = len(before), len(before[0])
    width = max(length, *(len(a) for a in after if a is not None))
    gap = 2.5  # room for the arrows between the two panels
    fig, ax = plt.subplots(figsize=(9, 0.55 * n + 1.3))
    flows = set()
    for q in range(n):
        y = n - 1 - q
        for k, value in enumerate(before[q]):
            ax.add_patch(Rectangle((k, y), 1, 0.8, facecolor=RANK_COLOURS[q % 8], edgecolor="black"))
            ax.text(k + 0.5, y + 0.4, f"{value:g}", ha="center", va="center", fontsize=10)
        row = after[q] if after[q] is not None else [None] * length
        for k, value in enumerate(row):
            origin = source(name, n, q, k, length) if value is not None else None
            colour = SUM_COLOUR if origin == "sum" else EMPTY_COLOUR if origin is None else RANK_COLOURS[origin % 8]
            x = length + gap + k
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=colour, edgecolor="black"))
            ax.text(x + 0.5, y + 0.4, "?" if value is None else f"{value:g}", ha="center", va="center", fontsize=10)
            senders = range(n) if origin == "sum" else [] if origin is None else [origin]
            flows.update((p, q) for p in senders if p != q)
        ax.text(-0.2, y + 0.4, f"rank {q}", ha="right", va="center", fontsize=10)
    for p, q in sorted(flows):
        start, end = (length + 0.1, n - 1 - p + 0.4), (length + gap - 0.1, n - 1 - q + 0.4)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="#333333", alpha=0.6))
    ax.text(length / 2, n + 0.1, "before", ha="center", fontsize=11, weight="bold")
    ax.text(length + gap + width / 2, n + 0.1, "after", ha="center", fontsize=11, weight="bold")
    ax.set_xlim(-1.6, length + gap + width + 0.2)
    ax.set_ylim(-0.3, n + 0.6)
    ax.axis("off")
    legend = [Patch(facecolor=RANK_COLOURS[r % 8], edgecolor="black", label=f"from rank {r}") for r in range(n)]
    legend.append(Patch(facecolor=SUM_COLOUR, edgecolor="black", label="sum over ranks"))
    if any(a is None for a in after):
        legend.append(Patch(facecolor=EMPTY_COLOUR, edgecolor="black", label="not defined"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=10, frameon=False)
    ax.set_title(f"{title} ({n} ranks)", fontsize=12)
    fig.tight_layout()
    plt.show()
