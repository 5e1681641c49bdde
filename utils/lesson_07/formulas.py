"""Bytes one rank sends per step for each method, from the formulas of the notebook's section 1 (ring model)."""

import math

import torch


def all_reduce(nbytes: float, n: int) -> float:
    """An all-reduce of `nbytes` over n ranks: each sends 2(n-1)/n of it (reduce-scatter, then all-gather)."""
    return 2 * (n - 1) / n * nbytes


def matrix_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Each parameter as the matrix PowerSGD sees: (rows, the numbers in a row)."""
    return [(p.shape[0], p[0].numel()) for p in model.parameters()]


def powersgd_floats(shapes: list[tuple[int, int]], rank: int) -> int:
    """Numbers PowerSGD all-reduces per step: r x (rows + cols) per matrix that shrinks at least 2x, else all."""
    floats = 0
    for rows, cols in shapes:
        r = min(rows, cols, rank)
        floats += r * (rows + cols) if 2 * r * (rows + cols) < rows * cols else rows * cols
    return floats


def formula_bytes(metrics: dict, shapes: list[tuple[int, int]]) -> float:
    """Bytes one rank sends in a steady-state step of the run `metrics` describes, averaged over averaging
    periods (Local SGD, post-local SGD)."""
    n, method, buckets = metrics["world_size"], metrics["method"], metrics["bucket_sizes"]
    params = sum(buckets)
    if method == "none":
        return all_reduce(4 * params, n)
    if method in ("fp16", "bf16"):
        return all_reduce(2 * params, n)
    if method == "topk":
        return sum((n - 1) * 8 * math.ceil(metrics["topk_ratio"] * size) for size in buckets)
    if method == "quantize":
        return sum((n - 1) * (math.ceil(metrics["bits"] * size / 8) + 4) for size in buckets)
    if method == "powersgd":
        return all_reduce(4 * powersgd_floats(shapes, metrics["powersgd_rank"]), n)
    if method == "localsgd":
        return all_reduce(4 * params, n) / metrics["local_steps"]
    if method == "postlocal":
        return all_reduce(4 * params, metrics["local_group_size"]) + all_reduce(4 * params, n) / metrics["local_steps"]
    raise ValueError(f"no formula for --method {method}")
