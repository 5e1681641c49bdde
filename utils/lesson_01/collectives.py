"""What each collective of lesson 01 must leave on every rank, from the tensors the ranks held before it."""


def expected_after(name: str, before: list[list[float]]):
    """A function of the rank q: what rank q must hold after collective `name` (None where nothing is defined).

    `before` holds every rank's tensor (as a list, one element per rank); chunk q is element q of it."""
    n = len(before)
    total = [sum(column) for column in zip(*before)]
    chunk = len(before[0]) // n
    return {
        "broadcast": lambda q: before[0],
        "reduce": lambda q: total if q == 0 else None,  # only the destination's result is defined
        "all_reduce": lambda q: total,
        "all_gather": lambda q: [v for values in before for v in values],
        "reduce_scatter": lambda q: total[q * chunk : (q + 1) * chunk],
        "all_to_all": lambda q: [v for values in before for v in values[q * chunk : (q + 1) * chunk]],
        "send_recv": lambda q: before[(q - 1) % n],
    }[name]
