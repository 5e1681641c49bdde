"""The stored ring-versus-library timings at 2, 4 and 8 ranks (notebooks/data/01_ring_vs_library.json, written by
`solutions/01_collectives.py --benchmark-out`): the table the notebook prints, and the figures its statements rest on.
"""

from dataclasses import dataclass


def _ms(timing: dict) -> str:
    """Median milliseconds, with the fastest and slowest round in brackets."""
    return f"{timing['seconds'] * 1e3:7.2f} ({timing['seconds_min'] * 1e3:.2f}-{timing['seconds_max'] * 1e3:.2f})"


def print_reference(runs: dict):
    """Where and how each world size was measured (LOADED runs marked), then a row per world size and size."""
    machine = next(iter(runs.values()))["machine"]
    print(
        f"machine: {machine['cpu']}, {machine['cpu_cores']} cores, {machine['memory_GiB']} GiB, "
        f"accelerator {machine['accelerator']}"
    )
    print(
        f"python {machine['python']}, torch {machine['torch']}, backend {machine['backend']}, "
        f"OMP_NUM_THREADS={machine['omp_num_threads']}"
    )
    for world_size, run in runs.items():
        loaded = " ** LOADED (its own ranks, more ranks than cores, or other jobs): not the machine's speed **"
        print(
            f"{world_size} ranks: {run['rounds']} rounds on {run['date']}, load average before/after "
            f"{run['load_average_1min']['before']:.1f}/{run['load_average_1min']['after']:.1f}"
            + (loaded if run["loaded"] else "")
            + f": {run['command']}"
        )
    print(
        f"\n{'ranks':>5} {'bytes':>9}  {'library ms':<22} {'ring ms (TODOs 1-2)':<22} {'rs+ag ms (TODO 3)':<22} "
        f"{'ring speed':>10} {'busbw library':>14}"
    )
    for world_size, run in runs.items():
        for row in run["rows"]:
            speed = row["library"]["seconds"] / row["ring"]["seconds"]
            print(
                f"{world_size:>5} {row['bytes']:>9}  {_ms(row['library']):<22} {_ms(row['ring']):<22} "
                f"{_ms(row['rs_ag']):<22} {speed:>9.2f}x {row['library']['busbw_GBps']:>9.3f} GB/s"
            )


@dataclass
class Claims:
    """The figures behind the notebook's statements, per world size (as the file's keys, e.g. "4")."""

    slowdowns: list  # reduce-scatter + all-gather time / library time, at the largest size
    latency: dict  # the library's time at the smallest size
    per_step: dict  # that time / 2(n-1): the cost of one ring step
    fair: list  # the world sizes that had a core per rank: only between these can a step's time be compared


def reference_claims(runs: dict) -> Claims:
    """Print, and return, the figures the notebook's statements about the stored timings are checked against."""
    largest = max(row["bytes"] for run in runs.values() for row in run["rows"])
    slowdowns = []
    for world_size, run in runs.items():
        row = next(row for row in run["rows"] if row["bytes"] == largest)
        speed = row["library"]["seconds"] / row["ring"]["seconds"]
        slowdown = row["rs_ag"]["seconds"] / row["library"]["seconds"]
        slowdowns.append(slowdown)
        verdict = "meets" if speed >= 0.9 else "misses"  # the reference solution, loaded or not (see above)
        print(
            f"{world_size} ranks, {largest >> 20} MB: ring speed {speed:.2f}x ({verdict} the 0.9x target); "
            f"reduce-scatter + all-gather takes {slowdown:.1f}x the library's time"
        )
    smallest = min(row["bytes"] for run in runs.values() for row in run["rows"])
    latency = {
        ws: next(r for r in run["rows"] if r["bytes"] == smallest)["library"]["seconds"] for ws, run in runs.items()
    }
    per_step = {ws: seconds / (2 * (int(ws) - 1)) for ws, seconds in latency.items()}  # the ring's 2(n-1) steps
    print(f"{smallest} bytes, library: " + ", ".join(f"{t * 1e3:.2f} ms at {ws} ranks" for ws, t in latency.items()))
    print("per ring step, time / 2(n-1): " + ", ".join(f"{t * 1e3:.2f} ms at {ws} ranks" for ws, t in per_step.items()))
    cores = next(iter(runs.values()))["machine"]["cpu_cores"]
    fair = [ws for ws in per_step if int(ws) <= cores]  # a core per rank: a step waits for no core
    if len(fair) < 2:
        print(
            f"only {', '.join(fair)} ranks had a core per rank ({cores} cores): "
            "the per-step claim is not tested by this table"
        )
    else:
        print(f"per-step times compared at {', '.join(fair)} ranks (a core per rank)")
    return Claims(slowdowns, latency, per_step, fair)
