"""The notebook's per-rank timeline, drawn from a trace's own events, and its tables."""

import matplotlib.pyplot as plt

from utils.lesson_11.profiling import step_spans, training_thread

KINDS = ("computation", "communication", "waiting", "data")
COLOURS = {"computation": "#4c72b0", "communication": "#dd8452", "waiting": "#c44e52", "data": "#55a868"}


def step_intervals(events: list[dict], kind_of, union, without, step: int = -1) -> tuple[dict, float]:
    """{kind: its time within one recorded step, as intervals in ms from the step's start}, and the step's length.
    The training thread's kinds split as `breakdown` splits them: a wait inside an operator is waiting, not also
    computation (nor data)."""
    thread, (start, end) = training_thread(events), step_spans(events)[step]
    found = {kind: [] for kind in KINDS}
    for event in events:
        kind = kind_of(event, thread)
        if kind is not None and event["ts"] < end and event["ts"] + event["dur"] > start:
            found[kind].append((max(event["ts"], start), min(event["ts"] + event["dur"], end)))
    merged = {kind: union(found[kind]) for kind in KINDS}
    merged["data"] = without(merged["data"], merged["waiting"])
    merged["computation"] = without(merged["computation"], merged["waiting"] + merged["data"])
    ms = {kind: [((s - start) / 1e3, (e - start) / 1e3) for s, e in merged[kind]] for kind in KINDS}
    return ms, (end - start) / 1e3


def timeline(traces: list[list[dict]], kind_of, union, without, title: str):
    """One row per kind for every rank: the last recorded step, each kind's intervals as bars."""
    fig, ax = plt.subplots(figsize=(11, 0.9 + 1.3 * len(traces)))
    labels, longest = [], 0.0
    for rank, events in enumerate(traces):
        intervals, length = step_intervals(events, kind_of, union, without)
        longest = max(longest, length)
        for row, kind in enumerate(KINDS):
            y = (len(traces) - 1 - rank) * (len(KINDS) + 1) + (len(KINDS) - 1 - row)
            ax.broken_barh([(s, e - s) for s, e in intervals[kind]], (y - 0.4, 0.8), color=COLOURS[kind])
            labels.append((y, f"rank {rank}  {kind}"))
    ax.set_yticks([y for y, _ in labels], [label for _, label in labels], fontsize=10)
    ax.set_xlim(0, longest)
    ax.set_xlabel("time since the step began (ms)", fontsize=11)
    ax.set_title(title, fontsize=12)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def provenance(record: dict):
    """Where a data file's figures were measured: what, the command, the machine, the day, the load (and LOADED)."""
    machine, load = record["machine"], record["load_average_1min"]
    print(f"{record['what']}: `{record['command']}`")
    print(
        f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, Python {machine['python']}; "
        f"{record['date'][:10]}; load average {load['before']:.1f} before the runs, {load['after']:.1f} after"
    )
    if "bf16_instructions" in machine:  # what bf16 autocast costs on a CPU depends on them
        print(f"the CPU's bf16 instructions: {', '.join(machine['bf16_instructions']) or 'none'}")
    if record["loaded"]:
        print(
            "LOADED: other jobs shared the cores; these are not the machine's speed (ratios of the same round are "
            "the figures to read)"
        )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}"


def exposure_table(rows: list[dict]):
    """Per strategy and world size: the formula's bytes and what it says can be hidden, then the measured means over
    the ranks, per step: communication, its exposed part, waiting."""
    print(f"{'strategy':36s} {'N':>2s} {'formula: MB/rank':>16s} {'step ms':>8s} {'comm ms':>8s} {'exposed':>8s} "
          f"{'waiting':>8s}  formula: what can be hidden")  # fmt: skip
    for row in rows:
        bubble = f"; bubble {row['bubble']:.0%} of the step" if "bubble" in row else ""
        print(f"{row['strategy']:36s} {row['ranks']:2d} {row['bytes'] / 1e6:16.2f} {ms(row['step']):>8s} "
              f"{ms(row['communication']):>8s} {ms(row['exposed_communication']):>8s} {ms(row['waiting']):>8s}  "
              f"{row['hideable']}{bubble}")  # fmt: skip


def speedup_table(rows: list[dict]):
    """Each configuration: tokens/s, its ratio to the baseline of the same round (median, min-max), memory per rank."""
    print(f"{'configuration':26s} {'tokens/s':>9s} {'x baseline':>10s} {'(min - max)':>13s} {'MiB per rank':>12s}")
    for row in rows:
        print(
            f"{row['name']:26s} {row['tokens_per_s']:9,.0f} {row['ratio']:10.2f} "
            f"({row['ratio_min']:4.2f} - {row['ratio_max']:4.2f}) {row['memory_per_rank'] / 2**20:12.1f}"
        )


def published_table(published: list[dict]):
    for entry in published:
        base = entry["steps"][0][1]
        print(f"{entry['source']} ({entry['unit']}; {entry['where']})")
        for step, value in entry["steps"]:
            print(f"    {step:32s} {value:9,} {value / base:6.2f} x")
