"""The alpha-beta model of lesson 01 applied to each method: time = rounds x alpha + bytes / beta."""

import torch

from utils.lesson_07.formulas import formula_bytes, matrix_shapes


def comm_time(rounds: float, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds for `rounds` ring rounds (alpha seconds each) that send `nbytes` at `beta` bytes per second."""
    return rounds * alpha + nbytes / beta


def show_times(rows: dict, links: dict, reference: str, title: str, unit: str = "ms"):
    """Print each method's ({label: (rounds, bytes)}) time on each link ({name: (alpha, beta)}) and what it saves
    over the `reference` row."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    print(title)
    header = "".join(f"{link:>34s}" for link in links)
    print(f"{'method':34s}{header}")
    for label, (rounds, nbytes) in rows.items():
        cells = ""
        for alpha, beta in links.values():
            t, t_ref = comm_time(rounds, nbytes, alpha, beta), comm_time(*rows[reference], alpha, beta)
            cells += f"{t * scale:11.1f} {unit} (saves {(t_ref - t) * scale:7.1f})"
        print(f"{label:34s}{cells}")
    print()


# Ring rounds per bucket: one all-reduce (or two all-gathers of n-1 rounds); PowerSGD: three all-reduces.
ALL_REDUCES_PER_BUCKET = {"none": 1, "fp16": 1, "bf16": 1, "topk": 1, "quantize": 1, "powersgd": 3}


def traffic_at_scale(runs: dict, model: torch.nn.Module, n: int, bucket: int) -> tuple[dict, int, list]:
    """({label: (rounds, bytes) per step}, parameters, bucket sizes): each run's method and options ({label:
    metrics}) applied to `model` on n ranks, its gradients in buckets of `bucket` numbers, post-local SGD in
    groups of 2 ranks."""
    parameters = sum(p.numel() for p in model.parameters())
    buckets = [bucket] * (parameters // bucket) + [parameters % bucket]
    shapes = matrix_shapes(model)
    traffic = {}
    for label, run in runs.items():
        metrics = {**run, "world_size": n, "bucket_sizes": buckets, "local_group_size": 2}
        method = metrics["method"]
        if method in ALL_REDUCES_PER_BUCKET:
            rounds = ALL_REDUCES_PER_BUCKET[method] * 2 * (n - 1) * len(buckets)
        else:  # one flat all-reduce of the parameters every H steps (+ post-local's in-group gradient all-reduces)
            rounds = 2 * (n - 1) / metrics["local_steps"]
            if method == "postlocal":
                rounds += 2 * (metrics["local_group_size"] - 1) * len(buckets)
        traffic[label] = (rounds, formula_bytes(metrics, shapes))
    return traffic, parameters, buckets
