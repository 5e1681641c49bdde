"""Lesson 04's notebook tables: parity with one process, collectives against the formula, memory, and traffic.

Each prints its table and returns what the notebook's cell asserts (the claim stays in the cell)."""

import torch


def below(value: float, bound: float) -> str:
    """A tiny difference printed as a bound, so that the output is the same every run."""
    return f"< {bound:.0e}" if value < bound else f"{value:.1e}"


def parity_table(runs, names, reference: str = "1 process (lesson 00)") -> dict:
    """Each run against `reference`: {name: (max |loss difference|, max |parameter difference|, checksum's
    relative difference)}, the parameters read from the full models the runs saved."""
    one = runs[reference]
    whole = torch.load(runs.checkpoints[reference], weights_only=True)["model"]
    print(
        f"{'run':22s} {'final loss':>10s} {'max |loss diff|':>16s} {'max |param diff|':>17s} "
        f"{'checksum rel. diff':>19s}"
    )
    gaps = {}
    for name in names:
        metrics = runs[name]
        state = torch.load(runs.checkpoints[name], weights_only=True)["model"]
        param_gap = max(float((state[k] - whole[k]).abs().max()) for k in whole)
        loss_gap = max(abs(a - b) for a, b in zip(metrics["losses"], one["losses"]))
        checksum_gap = abs(metrics["param_checksum"] / one["param_checksum"] - 1)
        print(
            f"{name:22s} {metrics['final_loss']:10.5f} {below(loss_gap, 1e-5):>16s} {below(param_gap, 1e-6):>17s} "
            f"{below(checksum_gap, 1e-9):>19s}"
        )
        gaps[name] = (loss_gap, param_gap, checksum_gap)
    return gaps


def formula(sp: bool, activation: int, n_layers: int) -> dict:
    """{phase: {kind: [collectives, bytes]}} of the activations in step 1 (with SP the norms' gradients apart):
    g's all-reduce after attention and after the MLP in forward, f's in backward; with SP each becomes an
    all-gather and a reduce-scatter, plus one all-gather at an end of the stack each way."""
    if not sp:
        return {phase: {"all_reduce": [2 * n_layers, 2 * n_layers * activation]} for phase in ("forward", "backward")}
    gathers, scatters = 2 * n_layers + 1, 2 * n_layers
    each_way = {"all_gather": [gathers, gathers * activation], "reduce_scatter": [scatters, scatters * activation]}
    return {"forward": each_way, "backward": each_way}


def ring_bytes(kind: str, size: float, n: int) -> float:
    """Bytes each rank sends on a ring for a collective on a `size`-byte tensor."""
    return size * (n - 1) / n * (2 if kind == "all_reduce" else 1)


def communication_table(runs, names, batch: int, seq_len: int, dim: int, n_layers: int) -> dict:
    """Step 1's collectives of each run, by phase, beside the formula: {(name, phase): (counted, formula)}.
    With SP the partial gradients' all-reduces are shown apart (under one activation in bytes, checked here)."""
    activation = batch * seq_len * dim * 4
    print(f"S = {batch} x {seq_len} x {dim} x 4 bytes = {activation:,} bytes; L = {n_layers} blocks\n")
    print(f"{'run':18s} {'phase':9s} {'counted in step 1':50s} {'formula':8s} {'ring bytes sent per rank':>25s}")
    compared = {}
    for name in names:
        metrics = runs[name]
        n, sp, table = metrics["tp_size"], metrics["sequence_parallel"], metrics["collectives_step1"]
        assert set(table) <= {"forward", "backward", "step"}, table
        assert sp or "step" not in table, "without SP, nothing to synchronise in the optimizer step"
        expected = formula(sp, activation, n_layers)
        for phase in ("forward", "backward"):
            activations = {k: v for k, v in table[phase].items() if not (sp and k == "all_reduce")}
            compared[name, phase] = (activations, expected[phase])
            text = ", ".join(f"{c} {kind} {b:,} B" for kind, (c, b) in activations.items())
            sent = sum(ring_bytes(kind, b, n) for kind, (c, b) in activations.items())
            verdict = "equal" if activations == expected[phase] else "DIFFERS"
            print(f"{name:18s} {phase:9s} {text:50s} {verdict:8s} {sent:>25,.0f}")
        gradients = {phase: kinds["all_reduce"] for phase, kinds in table.items() if sp and "all_reduce" in kinds}
        for phase, (c, b) in gradients.items():
            assert b < activation, "the partial gradients are the norms' parameters: far smaller than one activation"
            if "scratch" in name:  # TODO 6: one flat all-reduce after backward
                print(f"{'':18s} {phase:9s} + {c} all_reduce of partial gradients, {b:,} B in all")
        if gradients and "dtensor" in name:  # how many, and in which phase: DTensor's choice, may change by release
            print(f"{'':18s} {'':9s} + DTensor's all-reduces of partial gradients, under one activation per phase")
        assert not sp or gradients, "with SP the norms' partial gradients must be all-reduced"
    return compared


def memory_table(runs, activation_estimate, param_bytes) -> dict:
    """The tensor-parallel runs' saved activations and parameter bytes (rank 0) beside the estimates:
    {name: (activations saved, estimate, parameter bytes, formula)}."""
    print(
        f"{'run':18s} {'activations saved (rank 0)':>27s} {'estimate':>10s} {'parameters per rank':>20s} "
        f"{'formula':>9s}"
    )
    rows = {}
    for name, metrics in runs.items():
        if "TP" not in name:
            continue
        n, sp = metrics["tp_size"], metrics["sequence_parallel"]
        rows[name] = (metrics["activation_bytes"], activation_estimate(n, sp), metrics["bytes_per_rank"]["params"])
        rows[name] += (param_bytes(n),)
        saved, estimate, params, formula_bytes = rows[name]
        print(f"{name:18s} {saved:>27,} {estimate:>10,.0f} {params:>20,} {formula_bytes:>9,.0f}")
    return rows


def traffic_table(traffic: dict, n: int, nvlink_gbps: float, network_gbps: float):
    """TP's and DDP's bytes per token and their transfer times per step: traffic = {model: (TP bytes, DDP bytes,
    tokens of one TP step)}, each per rank and per step (a DDP step trains on n times those tokens)."""
    print(f"N = {n} ranks, bf16; times assume the whole link for the transfer, without overlap\n")
    print(
        f"{'model':20s} {'TP B/token':>11s} {'DDP B/token':>12s} {'TP step on NVLink':>18s} "
        f"{'TP step on network':>19s} {'DDP step on network':>20s}"
    )
    for name, (tp_bytes, ddp_bytes, tokens) in traffic.items():
        tp_token, ddp_token = tp_bytes / tokens, ddp_bytes / (n * tokens)
        print(
            f"{name:20s} {tp_token / 1e3:>8.1f} kB {ddp_token / 1e3:>9.1f} kB {tp_bytes / nvlink_gbps / 1e6:>15.1f} ms "
            f"{tp_bytes / network_gbps / 1e6:>16.1f} ms {ddp_bytes / network_gbps / 1e6:>17.1f} ms"
        )
