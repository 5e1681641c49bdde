"""The scaling report: tokens/s, speed-up and scaling efficiency against GPUs, from a folder of metrics files.

    python -m utils.report RUNS_DIR                # a table, and RUNS_DIR/scaling.png
    python -m utils.report RUNS_DIR --out fig.png --title "lesson 06 on 2 nodes x 4 GPUs"
    python -m utils.report RUNS_DIR --compare impl=scratch impl=builtin     # two curves, one table, one figure

Each metrics file is the JSON every lesson script writes with --metrics-out (utils/metrics.py): world_size,
tokens_per_s (all ranks together), hosts, and the layout that produced it, either as a "layout" object or as
top-level fields (tp, pp, impl, schedule, ...). Runs with the same layout fields form one curve; dp is left out
of the name, because it is what grows with the GPUs. Repeated runs of one layout and world size count by their
median. Speed-up and efficiency are against the smallest world size of the same layout, or with
--baseline smallest against the smallest run of all (one baseline for every curve, e.g. the 1-process run):
    speed-up(n) = tokens/s(n) / tokens/s(n0)        efficiency(n) = speed-up(n) / (n / n0)
The world size is counted in GPUs, or in processes where every run says it ran on a CPU ("device": "cpu"):
processes that share a CPU's cores and memory are not GPUs, and their curve is not a GPU cluster's.
--compare A B puts two curves side by side (two layouts, or two implementations of one): A and B each select the
one layout whose name holds all their key=value words ("impl=scratch", "tp=2 pp=2"); the table gives, at every
world size both ran, each one's tokens/s and efficiency and B's throughput over A's.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

SINGULAR = {"GPUs": "GPU", "processes": "process"}
LAYOUT_KEYS = ("impl", "schedule", "tp", "pp", "microbatches", "ddp", "zero")


def read_runs(folder) -> list[dict]:
    """Every metrics file under `folder` (any depth) that has a world size and a throughput."""
    runs = []
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # not a metrics file
        if isinstance(record, dict) and "world_size" in record and "tokens_per_s" in record:
            runs.append(record)
    return runs


def layout_name(record: dict) -> str:
    """The record's layout fields, from its "layout" object and its top level (lesson 06 keeps the grid in "layout"
    and the implementation, schedule and micro-batches beside it)."""
    fields = {**record, **record["layout"]} if isinstance(record.get("layout"), dict) else record
    return " ".join(f"{key}={fields[key]}" for key in LAYOUT_KEYS if key in fields) or "all runs"


def scaling_rows(runs: list[dict], baseline: str = "own") -> list[dict]:
    """One row per (layout, world size): median tokens/s, runs, nodes, speed-up and efficiency.

    baseline "own": each layout against its own smallest world size; "smallest": every layout against the smallest
    run of all (ValueError when several layouts ran at that size: which one would be the baseline?)."""
    groups = {}
    for record in runs:
        groups.setdefault(layout_name(record), {}).setdefault(int(record["world_size"]), []).append(record)
    common = None
    if baseline == "smallest":
        size = min(n for by_size in groups.values() for n in by_size)
        names = sorted(name for name, by_size in groups.items() if size in by_size)
        if len(names) > 1:
            raise ValueError(f"{len(names)} layouts ran at the smallest world size {size} ({'; '.join(names)})")
        common = size, statistics.median(r["tokens_per_s"] for r in groups[names[0]][size])
    elif baseline != "own":
        raise ValueError(f"baseline {baseline!r}: 'own' or 'smallest'")
    rows = []
    for name in sorted(groups):
        by_size = groups[name]
        base_gpus = min(by_size)
        base_speed = statistics.median(r["tokens_per_s"] for r in by_size[base_gpus])
        base_gpus, base_speed = common or (base_gpus, base_speed)
        for gpus in sorted(by_size):
            speed = statistics.median(r["tokens_per_s"] for r in by_size[gpus])
            speedup = speed / base_speed
            nodes = max(len(set(r.get("hosts") or ["?"])) for r in by_size[gpus])
            rows.append(
                {
                    "layout": name,
                    "gpus": gpus,
                    "nodes": nodes,
                    "runs": len(by_size[gpus]),
                    "tokens_per_s": speed,
                    "speedup": speedup,
                    "efficiency": speedup / (gpus / base_gpus),
                    "base_gpus": base_gpus,
                    "base_tokens_per_s": base_speed,
                }
            )
    return rows


def world_unit(runs: list[dict]) -> str:
    """What the world size counts: "processes" where every run says it ran on a CPU, else "GPUs"."""
    return "processes" if runs and all(record.get("device") == "cpu" for record in runs) else "GPUs"


def table(rows: list[dict], unit: str = "GPUs") -> str:
    width = max([len("layout")] + [len(row["layout"]) for row in rows])
    header = f"{unit:>5} {'nodes':>5} {'runs':>4} {'tokens/s':>12} {'speed-up':>8} {'efficiency':>10}"
    lines = [f"{'layout':<{width}} {header}"]
    for row in rows:
        counts = f"{row['gpus']:>{max(5, len(unit))}} {row['nodes']:>5} {row['runs']:>4}"
        speeds = f"{row['tokens_per_s']:>12,.0f} {row['speedup']:>7.2f}x {row['efficiency']:>10.0%}"
        lines.append(f"{row['layout']:<{width}} {counts} {speeds}")
    return "\n".join(lines)


def select(rows: list[dict], words: str) -> list[dict]:
    """The rows of the one layout whose name holds every key=value word of `words`; ValueError naming the layouts
    when none or several do."""
    wanted = words.split()
    names = sorted({row["layout"] for row in rows if all(word in row["layout"].split() for word in wanted)})
    if len(names) != 1:
        found = "no layout" if not names else f"{len(names)} layouts ({'; '.join(names)})"
        every = "; ".join(sorted({row["layout"] for row in rows}))
        raise ValueError(f"{words!r} selects {found}: pick one of: {every}")
    return [row for row in rows if row["layout"] == names[0]]


def comparison_rows(first: list[dict], second: list[dict]) -> list[dict]:
    """At every world size both curves have: each one's tokens/s and efficiency, and the second's throughput over
    the first's."""
    by_gpus = {row["gpus"]: row for row in second}
    return [
        {
            "gpus": row["gpus"],
            "first": row["tokens_per_s"],
            "second": by_gpus[row["gpus"]]["tokens_per_s"],
            "ratio": by_gpus[row["gpus"]]["tokens_per_s"] / row["tokens_per_s"],
            "first_efficiency": row["efficiency"],
            "second_efficiency": by_gpus[row["gpus"]]["efficiency"],
        }
        for row in first
        if row["gpus"] in by_gpus
    ]


def comparison_table(first: list[dict], second: list[dict], unit: str = "GPUs") -> str:
    names = first[0]["layout"], second[0]["layout"]
    lines = [f"A: {names[0]}", f"B: {names[1]}"]
    lines.append(f"{unit:>5} {'A tokens/s':>12} {'B tokens/s':>12} {'B / A':>6} {'A eff.':>7} {'B eff.':>7}")
    for row in comparison_rows(first, second):
        lines.append(
            f"{row['gpus']:>{max(5, len(unit))}} {row['first']:>12,.0f} {row['second']:>12,.0f} {row['ratio']:>5.2f}x "
            f"{row['first_efficiency']:>7.0%} {row['second_efficiency']:>7.0%}"
        )
    if len(lines) == 3:
        lines.append(f"(no number of {unit} that both A and B ran)")
    return "\n".join(lines)


def figure(rows: list[dict], title: str, unit: str = "GPUs"):
    """Tokens/s against the world size (with linear scaling from each baseline) beside the scaling efficiency.
    unit: what the world size counts ("GPUs", or "processes" for runs that share a CPU)."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # the command line: no display. A notebook keeps its inline backend
        matplotlib.use("Agg")  # (switching would close its figures and stop the next ones from showing)
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}):
        fig, (speed_ax, efficiency_ax) = plt.subplots(1, 2, figsize=(11, 5.5), constrained_layout=True)
        ideals = set()  # (baseline world size, tokens/s): one linear line per baseline
        for name in dict.fromkeys(row["layout"] for row in rows):
            mine = [row for row in rows if row["layout"] == name]
            gpus = [row["gpus"] for row in mine]
            (line,) = speed_ax.plot(gpus, [row["tokens_per_s"] for row in mine], "o-", label=name)
            base = (mine[0]["base_gpus"], mine[0]["base_tokens_per_s"])
            if base not in ideals:
                ideals.add(base)
                ideal = [base[1] * n / base[0] for n in sorted({base[0], *gpus})]
                counted = unit if base[0] > 1 else SINGULAR.get(unit, unit)
                speed_ax.plot(sorted({base[0], *gpus}), ideal, "--", color=line.get_color(), alpha=0.5,
                              label=f"linear scaling from {base[0]} {counted}")  # fmt: skip
            efficiency = [100 * row["efficiency"] for row in mine]
            efficiency_ax.plot(gpus, efficiency, "o-", color=line.get_color(), label=name)
        all_gpus = sorted({row["gpus"] for row in rows} | {base for base, _ in ideals})
        for ax in (speed_ax, efficiency_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_gpus, [str(n) for n in all_gpus])
            ax.set_xlabel(f"{unit} (world size)")
            ax.grid(alpha=0.3)
        speed_ax.set_ylabel(f"throughput (tokens/s, all {unit})")
        speed_ax.set_title("Throughput, and linear scaling from the baseline")
        efficiency_ax.axhline(100, color="gray", linewidth=1)
        efficiency_ax.set_ylim(0, max(110, 5 + max(100 * row["efficiency"] for row in rows)))
        efficiency_ax.set_ylabel("scaling efficiency (%)")
        efficiency_ax.set_title(f"Efficiency = speed-up / ({unit} / baseline's {unit})")
        for ax in (speed_ax, efficiency_ax):  # below the axes: long layout names would hide curves and labels
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
        fig.suptitle(title)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.report", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", help="folder of metrics JSON files (searched at any depth)")
    parser.add_argument("--out", help="where to save the figure (default RUNS_DIR/scaling.png)")
    parser.add_argument("--title", help="the figure's title: say which machine the runs come from")
    parser.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), help="two layouts to put side by side, e.g. impl=scratch impl=builtin"
    )
    parser.add_argument(
        "--baseline", choices=["own", "smallest"], default="own",
        help="efficiency against each layout's smallest run (own) or the smallest run of all (one baseline)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    folder = Path(args.runs_dir)
    if not folder.is_dir():
        sys.exit(f"{folder} is not a folder: pass the folder the sweep wrote its metrics files into")
    runs = read_runs(folder)
    if not runs:
        sys.exit(f"no metrics files in {folder}: run the scripts with --metrics-out {folder}/NAME.json first")
    try:
        rows = scaling_rows(runs, args.baseline)
    except ValueError as error:
        sys.exit(f"--baseline smallest: {error}; pass --baseline own, or keep one layout at that size")
    unit = world_unit(runs)
    if args.compare:
        try:
            first, second = (select(rows, words) for words in args.compare)
        except ValueError as error:
            sys.exit(f"--compare: {error}")
        rows = first + second
        print(comparison_table(first, second, unit))
    else:
        print(table(rows, unit))
    out = Path(args.out) if args.out else folder / ("comparison.png" if args.compare else "scaling.png")
    fig = figure(rows, args.title or f"Scaling of {len(runs)} runs in {folder.name}", unit)
    fig.savefig(out, dpi=120)
    print(f"figure: {out}")


if __name__ == "__main__":
    main()
