"""Lesson 06's pictures and tables, and the bookkeeping behind the notebook's checks.

communication_per_step(model, cluster, tp, pp, dp, micro_batch, gbs)  # messages, bytes, seconds a dimension a step
show_communication(per_step, seconds, compute)                         # section 1's table
every_rank_builds_its_grid(build_grid, layout)                         # each rank's new_group calls, and its grid
nodes_apart(groups, per_node)                                          # how far a dimension's groups reach
draw_rank_groups({title: {dim: groups}}, 4, t)                         # which groups leave a node, drawn
model_state_rows(runs, model, dims) / show_model_state(rows)           # section 4's bytes held against the planner
"""

import math

from utils import planner
from utils.memory import human


def communication_per_step(
    model: planner.Model, cluster: planner.Cluster, tp: int, pp: int, dp: int, mb: int, gbs: int
):
    """A middle stage's rank of a tp x pp x dp layout in bf16 training (fp32 gradients, ZeRO-1 over dp), one step of
    gbs sequences in micro-batches of mb: {dimension: (collectives or sends it runs, ring steps in each, bytes it
    sends, what waits for them)}, their seconds {dimension: (inside a node, across nodes)} by the alpha-beta model,
    and the step's compute seconds."""
    m, layers = gbs // (dp * mb), model.layers // pp  # micro-batches a replica, layers a stage
    activation, params = 2 * mb * model.seq_len * model.hidden, model.params / (tp * pp)  # bf16 activations
    buckets = math.ceil(4 * params / 25e6)  # 25 MB buckets of fp32 gradients
    per_step = {
        "TP": (4 * layers * m, 2 * (tp - 1), 4 * layers * m * 2 * (tp - 1) / tp * activation,
               "the next matmul, every time"),
        "PP": (2 * m, 1, 2 * m * activation / tp, "nothing: the next micro-batch computes"),  # SP: 1/tp of the tokens
        # ZeRO-1: each bucket's fp32 gradients reduce-scattered, then the updated bf16 parameters all-gathered
        "DP": (2 * buckets, dp - 1, (dp - 1) / dp * (4 + 2) * params, "the last 25 MB bucket"),
    }  # fmt: skip
    compute = 6 * model.params * gbs * model.seq_len / (cluster.gpus * cluster.peak_flops * cluster.matmul_efficiency)
    seconds = {dim: (n * steps * cluster.intra_latency + sent / cluster.intra_bandwidth, n * steps *
                     cluster.inter_latency + sent / cluster.inter_bandwidth)
               for dim, (n, steps, sent, _) in per_step.items()}  # fmt: skip
    return per_step, seconds, compute


def show_communication(per_step: dict, seconds: dict, compute: float):
    print(f"compute: {compute:.1f} s a step")
    print(f"{'':3s} {'messages':>9s} {'sent':>9s} {'in a node':>10s} {'across':>9s}  waits")
    for dim, (n, _, sent, waits) in per_step.items():
        print(f"{dim:3s} {n:9,d} {human(sent):>9s} {seconds[dim][0]:9.2f}s {seconds[dim][1]:8.2f}s  {waits}")


def every_rank_builds_its_grid(build_grid, layout) -> tuple[list, list]:
    """Every rank's build_grid(rank, layout, new_group) with a stand-in for dist.new_group that records its calls
    and returns the ranks as the "group": ([each rank's calls, in order], [each rank's grid])."""
    calls, grids = [], []
    for rank in range(layout.world_size):
        asked = []
        grids.append(
            build_grid(rank, layout, new_group=lambda ranks, asked=asked: asked.append(list(ranks)) or tuple(ranks))
        )
        calls.append(asked)
    return calls, grids


def nodes_apart(groups: dict, per_node: int) -> dict:
    """{dimension: how many nodes apart the farthest two ranks of one of its groups are}."""
    return {dim: max(max(g) // per_node - min(g) // per_node for g in members) for dim, members in groups.items()}


def model_state_rows(runs: dict, model: planner.Model, dims) -> list[dict]:
    """Every rank of every 3D run: its place, the parameters of its slice, the bytes it held, the planner's bytes for
    that slice, and the planner's even split of the run's layout."""
    rows = []
    for name, metrics in runs.items():
        shape, zero = metrics["layout"], 3 if name.startswith("built-in") else 0
        layout = planner.Layout(shape["dp"], shape["tp"], shape["pp"], metrics["micro_batch"], metrics["microbatches"],
                                zero=zero)  # fmt: skip
        even = planner.stage_model_state(model, layout, precision="fp32", optimizer="sgd")
        for rank, (place, held) in enumerate(zip(metrics["coordinates"], metrics["bytes_per_rank"])):
            own = planner.rank_parameter_shapes(model, shape["tp"], shape["pp"], place["pp"])  # this rank's tensors
            rows.append({
                "run": name, "rank": rank, "place": tuple(place[dim] for dim in dims), "held": held, "even": even,
                "params": sum(math.prod(tensor) for tensor in own),
                "predicted": planner.rank_model_state(model, layout, place["pp"], precision="fp32", optimizer="sgd"),
            })  # fmt: skip
    return rows


def show_model_state(rows: list[dict], kinds=("params", "grads", "optimizer")):
    print(f"{'run':24s} {'rank':>4s} {'(pp,dp,tp)':>10s} {'params of its slice (before dp)':>31s}  "
          f"{'bytes held (params, grads, optimizer)':>37s}  {'= predicted':>20s}  "
          f"{'planner, even split':>19s}")  # fmt: skip
    for row in rows:
        held, predicted = (str(tuple(row[which][k] for k in kinds)) for which in ("held", "predicted"))
        print(f"{row['run']:24s} {row['rank']:4d} {str(row['place']):>10s} {row['params']:31,d}  {held:>37s}  "
              f"{predicted:>20s}  {str(tuple(int(row['even'][k]) for k in kinds)):>19s}")  # fmt: skip


GROUP_COLOURS = {"tp": "#d62728", "dp": "#1f77b4", "pp": "#2ca02c", "dp_shard": "#17becf", "dp_replicate": "#9467bd"}


def draw_rank_groups(panels: dict[str, dict[str, list[list[int]]]], gpus_per_node: int, title: str):
    """One panel per entry {title: {dimension: its groups}}: the ranks on their nodes (each node's GPUs as a square
    grid, node 1 right of node 0), a line per pair of neighbours in a group, coloured by dimension; a link that
    leaves its node is bowed so that it passes no rank."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    side = math.isqrt(gpus_per_node)
    world = max(rank for groups in panels.values() for members in groups.values() for g in members for rank in g) + 1

    def where(rank):
        node, local = divmod(rank, gpus_per_node)
        return node * (1.2 * side + 1) + (local % side) * 1.2, -(local // side) * 1.2

    shown = {}
    with plt.rc_context({"font.size": 11, "axes.titlesize": 11, "legend.fontsize": 10}):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 3.4), constrained_layout=True)
        for ax, (name, groups) in zip(axes, panels.items()):
            for node in range(world // gpus_per_node):
                x0 = node * (1.2 * side + 1) - 0.5
                ax.add_patch(plt.Rectangle((x0, -1.2 * side + 0.7), 1.2 * side, 1.2 * side, fill=False, ls=":"))
                ax.text(x0 + 0.6 * side, 0.85, f"node {node}", ha="center")
            for dim, members in groups.items():
                for group in members:
                    for a, b in zip(group, group[1:]):
                        bow = 0.3 if a // gpus_per_node != b // gpus_per_node else 0.0
                        ax.annotate("", xy=where(b), xytext=where(a), arrowprops={
                            "arrowstyle": "-", "color": GROUP_COLOURS[dim], "linewidth": 2.5,
                            "connectionstyle": f"arc3,rad={bow}", "shrinkA": 9, "shrinkB": 9})  # fmt: skip
                shown[dim] = GROUP_COLOURS[dim]
            for rank in range(world):
                ax.text(*where(rank), str(rank), ha="center", va="center", bbox={"boxstyle": "circle", "fc": "white"})
            ax.set_xlim(-0.8, (world // gpus_per_node) * (1.2 * side + 1) - 0.6)
            ax.set_ylim(-1.2 * side - 0.2, 1.1)
            ax.set_aspect("equal")
            ax.axis("off")
            ax.set_title(name)
        words = {"tp": "TP group", "dp": "DP group", "pp": "PP group (a pipeline)", "dp_shard": "FSDP shard group",
                 "dp_replicate": "replica group (gradient all-reduce)"}  # fmt: skip
        handles = [Line2D([], [], color=colour, linewidth=2.5, label=words[dim]) for dim, colour in shown.items()]
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles))
        fig.suptitle(title, fontsize=12)
    return fig
