"""The notebook's plot of the checkpoint interval trade-off."""

import matplotlib.pyplot as plt


def plot_interval_tradeoff(k, overhead, lost, best: int, mtbf_s: float):
    """Time lost per unit of training time against the checkpoint interval k: saving, failures, and their sum."""
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.loglog(k, overhead, label="saving checkpoints (C / k t)")
    ax.loglog(k, lost, label="work lost to failures (restart + (k+1)/2 steps redone, per MTBF)")
    ax.loglog(k, overhead + lost, "k", lw=2, label="total")
    ax.axvline(best, color="gray", ls="--", label=f"best: every {best} steps")
    ax.set(
        xlabel="checkpoint interval k (steps)",
        ylabel="time lost per unit of training time",
        title=f"The checkpoint interval trade-off (measured on 2 CPU ranks, MTBF assumed {mtbf_s:.0f} s)",
    )
    ax.legend(fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return fig
