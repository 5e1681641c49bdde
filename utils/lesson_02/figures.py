"""Notebook 02's tables and plots: the drawing and the formatting, so that each cell shows what it runs and what it
asserts."""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch


def show_buckets(model):
    """One line per bucket of a DataParallel: how many tensors, how many bytes, and its first and last parameter."""
    names = {id(p): name for name, p in model.module.named_parameters()}
    for bucket in model.buckets:
        first, last = names[id(bucket.params[0])], names[id(bucket.params[-1])]
        print(f"bucket {bucket.index}: {len(bucket.params):2d} tensors, {bucket.nbytes:7,} bytes  ({first} ... {last})")


def show_throughput(bench: dict):
    """The throughput benchmark's record (notebooks/data/02_throughput.json): where it was measured, a table of
    tokens/s per world size, and every run against the ideal N x one rank."""
    sizes = bench["world_sizes"]
    machine = f"{bench['machine']['cpu']}, {bench['machine']['cores']} cores, torch {bench['versions']['torch']}"
    load = bench["load_average_1min"]
    print(f"{bench['what']}\n{bench['command']}\n{machine}; {bench['runs']} runs each, {bench['date']}")
    print(
        f"load average before/after: {load['before']:.1f}/{load['after']:.1f}"
        + ("  ** LOADED: other jobs shared the cores, not the machine's speed **" if bench["loaded"] else "")
    )
    print(f"{'ranks':>5} {'median tokens/s':>16} {'slowest':>9} {'fastest':>9} {'spread':>7}")
    for n in sizes:
        n = str(n)
        spread = bench["max"][n] / bench["min"][n]
        print(f"{n:>5} {bench['median'][n]:>16,.0f} {bench['min'][n]:>9,.0f} {bench['max'][n]:>9,.0f} {spread:>6.1f}x")

    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    for n in sizes:
        runs_n = bench["tokens_per_s"][str(n)]
        ax.scatter([n] * len(runs_n), runs_n, color="tab:blue", alpha=0.5, s=25, label="one run" if n == 1 else None)
        ax.vlines(n, bench["min"][str(n)], bench["max"][str(n)], color="tab:blue", alpha=0.4, linewidth=6)
    ax.plot(sizes, [bench["median"][str(n)] for n in sizes], "o-", color="tab:blue", label="median")
    ideal = [n * bench["median"]["1"] for n in sizes]
    ax.plot(sizes, ideal, "--", color="gray", label="ideal: N x one rank (one device per rank)")
    ax.axvline(bench["machine"]["cores"], color="tab:red", linestyle=":", label="number of CPU cores")
    ax.set(
        xticks=sizes,
        xlabel="ranks (processes)",
        ylabel="tokens per second (whole job)",
        title=f"Lesson 02 throughput, weak scaling, gloo on CPU\n{machine}",
    )
    ax.legend(fontsize=10)
    ax.grid(alpha=0.3)
    plt.show()


def _is_backward(event) -> bool:
    return event["name"].startswith("autograd::engine")


def draw_step_timeline(traces: dict):
    """One training step of rank 0 per --ddp (the script's --trace events): backward on the main thread, each
    bucket's all-reduce launch, and gloo's transfers on their threads, from the first backward operation on."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), dpi=100, sharex=False)
    titles = {"scratch": "from scratch (DataParallel, TODOs 1-4)", "builtin": "built-in DistributedDataParallel"}
    for ax, (ddp, events) in zip(axes, traces.items()):
        backward = [e for e in events if _is_backward(e)]
        start = min(e["start_us"] for e in backward)  # draw from the first backward op: forward is to the left

        def ms(t, start=start):  # microseconds since `start` -> milliseconds
            return (t - start) / 1000

        gloo_threads = sorted({e["thread"] for e in events if e["name"] == "gloo:all_reduce"})
        rows = {"backward\n(main thread)": 2 + len(gloo_threads), "all-reduce\nlaunched": 1 + len(gloo_threads)}
        rows.update({f"gloo thread {i + 1}\n(transfer)": len(gloo_threads) - i for i in range(len(gloo_threads))})
        for e in backward:  # an edge on every bar: back-to-back events stay separate bars
            ax.broken_barh(
                [(ms(e["start_us"]), max(ms(e["end_us"]) - ms(e["start_us"]), 0.01))],
                (rows["backward\n(main thread)"] - 0.35, 0.7),
                facecolor="tab:gray",
                edgecolor="black",
                linewidth=0.4,
            )
        for i, e in enumerate(e for e in events if e["name"] == "c10d::allreduce_"):
            ax.axvline(ms(e["start_us"]), color="tab:orange", alpha=0.5, linestyle=":")
            ax.plot(ms(e["start_us"]), rows["all-reduce\nlaunched"], "v", color="tab:orange", markersize=9)
            ax.annotate(f"b{i}", (ms(e["start_us"]), rows["all-reduce\nlaunched"] + 0.3), fontsize=9, ha="center")
        # gloo runs the buckets' all-reduces in launch order: the i-th transfer is bucket i's.
        transfers = sorted((e for e in events if e["name"] == "gloo:all_reduce"), key=lambda e: e["start_us"])
        for i, e in enumerate(transfers):
            row = rows[f"gloo thread {gloo_threads.index(e['thread']) + 1}\n(transfer)"]
            ax.broken_barh(
                [(ms(e["start_us"]), max(ms(e["end_us"]) - ms(e["start_us"]), 0.05))],
                (row - 0.35, 0.7),
                facecolor="tab:blue",
                edgecolor="black",
                linewidth=0.8,
            )
            # the bucket's label inside its bar, at the bar's start: one label per bar, never on a neighbour's row
            ax.text(ms(e["start_us"]), row, f" b{i}", fontsize=9, va="center", ha="left", color="white", weight="bold")
        drawn = ("gloo:all_reduce", "c10d::allreduce_")
        end = max(e["end_us"] for e in events if e["name"] in drawn or e in backward)
        ax.set_xlim(-0.02 * ms(end), 1.03 * ms(end))
        ax.set_yticks(list(rows.values()), list(rows.keys()), fontsize=10)
        ax.set_title(f"--ddp {ddp}: {titles[ddp]}", fontsize=11)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time since the first backward operation (ms), rank 0")
    handles = [
        Patch(color="tab:gray", label="autograd backward functions"),
        Patch(color="tab:orange", label="bucket all-reduce launched (b0, b1, ...)"),
        Patch(facecolor="tab:blue", edgecolor="black", label="gloo all-reduce of bucket b_i running"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=10, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(
        "One training step, 2 ranks on CPU (gloo), 0.1 MB buckets: communication overlaps backward", fontsize=12
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    plt.show()


def show_lr_runs(lr_runs: dict, final: dict):
    """The learning-rate runs: a table (lr, mean loss of the last steps, tokens seen) and their loss curves."""
    print(f"{'run':30s} {'lr':>6s} {'mean loss, last 5 steps':>24s} {'tokens seen':>12s}")
    for name, m in lr_runs.items():
        print(f"{name:30s} {m['lr']:>6.2f} {final[name]:>24.4f} {m['global_batch_size'] * 64 * m['steps']:>12,}")
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    for (name, m), style in zip(lr_runs.items(), ["-", "--", "-.", ":"]):
        ax.plot(range(1, m["steps"] + 1), m["losses"], style, linewidth=2, label=f"{name} (lr {m['lr']:.2f})")
    ax.set(
        title="Learning-rate scaling with the global batch (SGD, tiny model, CPU)",
        xlabel="optimizer step",
        ylabel="training loss (nats per token)",
    )
    ax.legend(fontsize=10)
    ax.grid(alpha=0.3)
    plt.show()


def show_memory(memory: dict, file_mb: int):
    """benchmarks.py --memory at each world size ({ranks: record}): a table of RSS and PSS per rank, and a bar chart
    of PSS per rank, copied vs memory-mapped, against the file's size / ranks."""
    print(f"{'ranks':>5} {'how':<20} {'RSS per rank MB':>16} {'PSS per rank MB':>16} {'file / ranks MB':>16}")
    for n, record in memory.items():
        for row in record["rows"]:
            rss, pss = max(row["rss_mb"]), max(row["pss_mb"])
            print(f"{n:>5} {row['how']:<20} {rss:>16.1f} {pss:>16.1f} {file_mb / n:>16.1f}")

    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    width = 0.35
    for i, (how, color) in enumerate([("a copy per process", "tab:red"), ("memory-mapped", "tab:blue")]):
        pss = [max(next(r for r in memory[n]["rows"] if r["how"] == how)["pss_mb"]) for n in memory]
        ax.bar([k + (i - 0.5) * width for k in range(len(memory))], pss, width, color=color, label=how)
    share = [file_mb / n for n in memory]
    ax.plot(range(len(memory)), share, "k_", markersize=30, markeredgewidth=2, label="file size / ranks")
    ax.set(
        xticks=range(len(memory)),
        xticklabels=[f"{n} rank(s)" for n in memory],
        ylabel="PSS per rank (MB)",
        title=f"Memory each rank holds for a {file_mb} MB token file (proportional share, CPU)",
    )
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over one
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    plt.show()
