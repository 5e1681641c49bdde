"""Lesson 10's notebook tables and plots, from the lesson's own functions and the runs' metrics files, and the
one timing the notebook takes in its own process."""

import time

import matplotlib.pyplot as plt
import torch

from utils import planner
from utils.memory import human


def routing_table(routing, kept=None, slots=None):
    """One line per token: its experts, their gates, and (with kept and slots) each choice's slot or `x` if dropped."""
    k = routing.experts.shape[1]
    print(f"{'token':>5s}  {'experts':8s} {'gates':{5 * k}s}" + ("  slots (x: dropped)" if kept is not None else ""))
    for t in range(routing.experts.shape[0]):
        gates = " ".join(f"{g:.2f}" for g in routing.gates[t].tolist())
        line = f"{t:5d}  {str(routing.experts[t].tolist()):8s} {gates:{5 * k}s}"
        if kept is not None:
            line += "  " + " ".join(str(s) if ok else "x" for s, ok in zip(slots[t].tolist(), kept[t].tolist()))
        print(line)


def rank_rows(metrics: dict, step: int, layer: int) -> list[int]:
    """The rows each EP rank's experts processed (not counting padding) in one step and layer."""
    load, per_rank = metrics["expert_load"][step][layer], metrics["experts_per_rank"]
    return [sum(load[r * per_rank : (r + 1) * per_rank]) for r in range(metrics["world_size"])]


def plot_dispatch(dropless: dict, padded: dict, layer: int = 0):
    """Left: the rows each rank sent each rank in the dropless run's first dispatch. Right: the rows each expert
    processed in that step, dropless against padded (kept, dropped, and the fixed buffer every expert computes)."""
    n = dropless["world_size"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [1.1, 1.4]})
    matrix = torch.tensor([rank["send_splits"][layer] for rank in dropless["per_rank"]])  # [source, destination]
    image = left.imshow(matrix, cmap="Blues")
    for s in range(n):
        for d in range(n):
            left.text(d, s, int(matrix[s, d]), ha="center", va="center", fontsize=11)
    per_rank = dropless["experts_per_rank"]
    left.set_xticks(range(n), [f"rank {d}\nexperts\n{per_rank * d}-{per_rank * d + per_rank - 1}" for d in range(n)],
                    fontsize=10)  # fmt: skip
    left.set_yticks(range(n), [f"rank {s}" for s in range(n)], fontsize=10)
    left.set_xlabel("to (the experts' rank)", fontsize=11)
    left.set_ylabel("from (the tokens' rank)", fontsize=11)
    left.set_title(f"dropless: rows sent in layer {layer}'s dispatch, step 1", fontsize=11)
    fig.colorbar(image, ax=left, label="rows (tokens)")

    experts = range(dropless["experts"])
    width = 0.4
    right.bar([e - width / 2 for e in experts], dropless["expert_load"][0][layer], width, label="dropless: rows")
    kept, chosen = padded["expert_load"][0][layer], padded["expert_choices"][0][layer]
    right.bar([e + width / 2 for e in experts], kept, width, label="padded: rows kept")
    right.bar([e + width / 2 for e in experts], [c - k for c, k in zip(chosen, kept)], width, bottom=kept,
              color="white", edgecolor="tab:red", hatch="//", label="padded: dropped")  # fmt: skip
    buffer = padded["world_size"] * padded["capacity"]
    right.axhline(
        buffer, color="black", linestyle="--", label=f"padded: buffer computed per expert (N x capacity = {buffer})"
    )
    right.set_xticks(list(experts), [f"expert {e}" for e in experts], fontsize=10)
    right.set_ylabel("rows (token choices)", fontsize=11)
    right.set_title(f"rows per expert, layer {layer}, step 1 ({n} ranks, top-{dropless['top_k']})", fontsize=11)
    right.legend(fontsize=10, loc="upper right")
    fig.tight_layout()
    return fig


def plot_balance(runs: dict, layer: int = 0):
    """runs: {aux-loss weight: metrics}. The busiest expert's share of the choices against the even share, the
    choices dropped and the load-balancing loss of `layer`, step by step."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for weight, metrics in runs.items():
        steps = range(1, len(metrics["losses"]) + 1)
        busiest = [max(step[layer]) * metrics["experts"] / sum(step[layer]) for step in metrics["expert_choices"]]
        axes[0].plot(steps, busiest, label=f"aux-loss weight {weight}")
        axes[1].plot(steps, [sum(step) for step in metrics["dropped"]], label=f"aux-loss weight {weight}")
        axes[2].plot(steps, [step[layer] for step in metrics["aux_losses"]], label=f"aux-loss weight {weight}")
    axes[0].axhline(1, color="grey", linestyle=":", label="even")
    titles = (f"busiest expert, layer {layer}", "choices dropped (every layer)", f"load-balancing loss, layer {layer}")
    labels = ("its choices / the even share", "choices per step", "E x sum f_e P_e")
    for ax, title, label in zip(axes, titles, labels):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step", fontsize=11)
        ax.set_ylabel(label, fontsize=11)
        ax.legend(fontsize=10)
    fig.tight_layout()
    return fig


def busiest_expert(metrics: dict, layer: int = 0, last: int = 20) -> float:
    """The busiest expert's share of the choices over the even share 1/E, one layer, mean over the last steps."""
    shares = [max(step[layer]) / sum(step[layer]) * metrics["experts"] for step in metrics["expert_choices"][-last:]]
    return sum(shares) / len(shares)


def mean_ms(function, repeats: int = 20) -> float:
    """function()'s mean wall time in milliseconds, after one call that is not timed (allocations, first-call work)."""
    function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e3


def parity_header():
    print(f"{'run':13s} {'ranks':>5s} {'experts':>7s} {'top-k':>5s} {'dispatch':>9s} {'impl':>8s} {'dropped':>7s} "
          f"{'final loss':>10s} {'max |diff|':>10s}")  # fmt: skip


def parity_row(name: str, nproc: int, options, metrics: dict, difference: float, tolerance: float):
    """One run of the parity table: its options, the choices it dropped, its final loss, and its largest parameter
    difference from one process (shown as the bound it meets: rounding-level differences vary from run to run)."""
    within = f"<= {tolerance:.0e}" if difference <= tolerance else f"{difference:.1e}"
    print(f"{name:13s} {nproc:5d} {options.experts:7d} {options.top_k:5d} {options.dispatch:>9s} "
          f"{metrics['impl']:>8s} {sum(map(sum, metrics['dropped'])):7d} {metrics['final_loss']:10.5f} "
          f"{within:>10s}")  # fmt: skip


def ep_table(predictions: list, gpus_per_node: int):
    """The planner's predictions for one layout at several ep: where the EP group sits, the model state per GPU,
    the all-to-alls' seconds, the step's, tokens/s, and whether it fits."""
    print(f"{'ep':>3s} {'EP group':>10s} {'model state':>11s} {'all-to-all s':>12s} {'step s':>7s} {'tokens/s':>9s}"
          "  fits")  # fmt: skip
    for pred in predictions:
        layout = pred.layout
        inside = planner.inside_one_node(layout.tp, layout.ep, gpus_per_node)  # EP ranks are tp apart
        print(f"{layout.ep:3d} {'in a node' if inside else 'two nodes':>10s} "
              f"{human(sum(pred.model_state.values())):>11s} {pred.ep_s:12.2f} {pred.step_s:7.2f} "
              f"{pred.tokens_per_s:9,.0f}  {pred.reason or 'yes'}")  # fmt: skip


def plot_bias_balancing(runs: dict):
    """runs: {label: [step][layer] choices per expert}. The busiest expert's share over the even share, worst layer,
    step by step."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, loads in runs.items():
        shares = [max(max(layer) * len(layer) / sum(layer) for layer in step) for step in loads]
        ax.plot(range(1, len(shares) + 1), shares, label=label)
    ax.axhline(1, color="grey", linestyle=":", label="even")
    ax.set_title("sigmoid router, no load-balancing loss: busiest expert, worst layer", fontsize=11)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("its choices / the even share", fontsize=11)
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig
