"""Lesson 09's expert-parallel TODOs under torchrun, each on its own, then the whole MoE model against one process.

    torchrun --nproc_per_node=2 tests/workers/ep_checks.py exercises/09_context_and_experts.py

The references are written here or in utils/experts.py (plain loops), never with the learner's TODOs:
- TODO 7 at N ranks: each rank caps its own tokens (capacity from its own T, not the global batch's);
- TODO 8: given the reference's routing, the rows each rank receives (and the splits), known here without
  communication because every rank can rebuild every rank's tokens and routing from their seeds;
- TODO 9: given the reference's plan and known expert results, each token's gate-weighted sum, and the gradients
  that flow back to the gates and to the experts' results;
- TODO 10: known gradients in, their mean (replicated) or their share (experts) out;
- parity: the learner's whole MoE model (every TODO) against utils.experts.reference_model on one process with
  the same groups: the logits, the loss and every gradient after TODO 10.
Each check runs on its own process group, so a check that fails mid-collective does not derail the next one.
Rank 0 prints one line per check: "RESULT <check> ok" or "RESULT <check> TODO n: what is wrong".
"""

import argparse
import importlib.util
import sys
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from utils.distributed_utils import destroy_process_group, setup  # noqa: E402
from utils.experts import reference_model, reference_routing  # noqa: E402
from utils.model import ModelConfig, loss_fn  # noqa: E402

TOLERANCE = 1e-6
N_EXPERTS, K, TOKENS, DIM = 8, 2, 24, 5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to fp32 rounding: the sums here run in another order than the reference's."""
    return torch.allclose(got, want, rtol=1e-5, atol=TOLERANCE)


def rank_tokens(rank: int) -> torch.Tensor:
    """Rank `rank`'s tokens [T, D] (known to every rank)."""
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + rank))


def rank_routing(rank: int, capacity_factor: float = 1.0):
    """Rank `rank`'s routing by the reference: (choices [T][k], kept {(t, i): expert}, gates [T, k]).
    The logits lean towards the low experts, so that some choices overflow and are dropped."""
    generator = torch.Generator().manual_seed(20 + rank)
    logits = torch.randn(TOKENS, N_EXPERTS, generator=generator) - 0.3 * torch.arange(N_EXPERTS)
    probs = F.softmax(logits, dim=-1)
    choices, kept = reference_routing(probs, K, capacity_factor)
    picked = probs.gather(1, torch.tensor(choices))
    return choices, kept, picked / picked.sum(dim=1, keepdim=True)


def expected_rows(rank: int, world_size: int) -> tuple[list[torch.Tensor], list[list[int]], list[tuple[int, int]]]:
    """What rank `rank` must receive: for each source rank, for each of its own experts, the source's tokens
    with a kept choice of that expert, in token order. Returns the rows, [N][E/N] counts, each row's (source, token)."""
    per_rank = N_EXPERTS // world_size
    rows, counts, ids = [], [], []
    for source in range(world_size):
        tokens, (_, kept, _) = rank_tokens(source), rank_routing(source)
        counts.append([])
        for expert in range(rank * per_rank, (rank + 1) * per_rank):
            mine = sorted(t for (t, _), e in kept.items() if e == expert)
            rows += [tokens[t] for t in mine]
            ids += [(source, t) for t in mine]
            counts[-1].append(len(mine))
    return rows, counts, ids


class InconsistentSplits(Exception):
    pass


def checked_exchange(script, todo: int):
    """The lesson's all-to-all, after checking on every rank that the splits agree: what rank s sends to rank d must
    be what d expects from s. With splits that disagree gloo can abort the process; here every rank raises instead."""

    def exchange(rows, output_splits, input_splits, group=None):
        world_size = dist.get_world_size(group)
        mine = [len(input_splits), len(output_splits), sum(input_splits) - rows.shape[0]]
        mine = torch.tensor([*mine, *(list(input_splits) + [0] * world_size)[:world_size],
                             *(list(output_splits) + [0] * world_size)[:world_size]], dtype=torch.long)  # fmt: skip
        everyone = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine, group=group)
        sends = [row[3 : 3 + world_size].tolist() for row in everyone]
        expects = [row[3 + world_size :].tolist() for row in everyone]
        for rank, row in enumerate(everyone):
            if row[:3].tolist() != [world_size, world_size, 0]:
                raise InconsistentSplits(
                    f"TODO {todo}: rank {rank} gives {int(row[0])} input and {int(row[1])} output splits for "
                    f"{world_size} ranks, or input splits that do not add up to its rows"
                )
            for source in range(world_size):
                if expects[rank][source] != sends[source][rank]:
                    raise InconsistentSplits(
                        f"TODO {todo}: rank {rank} expects {expects[rank][source]} rows from rank {source}, which "
                        f"sends it {sends[source][rank]} (output splits: what each rank sends this one)"
                    )
        return script.exchange_scratch(rows, output_splits, input_splits, group)

    return exchange


def routing_of(script, rank: int, gates=None):
    choices, kept, reference_gates = rank_routing(rank)
    experts = torch.tensor(choices)
    mask = torch.zeros(TOKENS, K, dtype=torch.bool)
    for t, i in kept:
        mask[t, i] = True
    return script.Routing(experts, reference_gates if gates is None else gates, torch.zeros(())), mask


def check_capacity(script, rank, world_size, group):
    for factor in (0.5, 1.0, 1.5):
        choices, kept, _ = rank_routing(rank, factor)
        got, capacity = script.keep_within_capacity(torch.tensor(choices), N_EXPERTS, factor)
        want = torch.zeros(TOKENS, K, dtype=torch.bool)
        for t, i in kept:
            want[t, i] = True
        if not torch.equal(got.bool(), want):
            return (
                f"TODO 7: at {world_size} ranks, rank {rank} keeps {int(got.sum())} of its {TOKENS * K} choices, "
                f"the reference {int(want.sum())} (capacity factor {factor}): each rank caps its own "
                f"T = {TOKENS} tokens, capacity = ceil(C x T x k / E), not the global batch's"
            )


def check_dispatch(script, rank, world_size, group):
    routing, kept = routing_of(script, rank)
    tokens = rank_tokens(rank).requires_grad_()
    received, plan = script.dispatch(tokens, routing, kept, N_EXPERTS, checked_exchange(script, 8), group)
    rows, counts, _ = expected_rows(rank, world_size)
    if [list(map(int, row)) for row in plan.recv_counts.view(world_size, -1).tolist()] != counts:
        return (
            f"TODO 8: rank {rank} receives {counts} rows per (source rank, its expert), its plan says "
            f"{plan.recv_counts.tolist()}: exchange the counts per expert first"
        )
    want_sent = [sum(expected_rows(peer, world_size)[1][rank]) for peer in range(world_size)]
    if list(plan.send_splits) != want_sent or list(plan.recv_splits) != [sum(c) for c in counts]:
        return (
            f"TODO 8: rank {rank}: send splits {plan.send_splits} (want {want_sent}), receive splits "
            f"{plan.recv_splits} (want {[sum(c) for c in counts]}): what a rank receives comes from the counts exchange"
        )
    want = torch.stack(rows) if rows else torch.zeros(0, DIM)
    if received.shape != want.shape or not torch.equal(received, want):
        return (
            f"TODO 8: rank {rank} received rows {tuple(received.shape)} that are not its experts' tokens, grouped by "
            "source rank, then by expert, in token order (sort the kept choices by expert with a stable sort)"
        )
    (received * row_weights(rank, len(rows))).sum().backward()  # each received row's gradient goes back to its token
    want_grad = torch.zeros(TOKENS, DIM)
    for peer in range(world_size):
        peer_ids = expected_rows(peer, world_size)[2]
        for (source, t), weight in zip(peer_ids, row_weights(peer, len(peer_ids))):
            if source == rank:
                want_grad[t] += weight
    if tokens.grad is None or not close(tokens.grad, want_grad):
        return (
            f"TODO 8: rank {rank}: the tokens get no or wrong gradients back from the dispatch: send them with "
            "`exchange` (differentiable), not dist.all_to_all_single"
        )


def row_weights(rank: int, n: int) -> torch.Tensor:
    """Weights for the n rows rank `rank` receives (known to every rank)."""
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(40 + rank))


def reference_plan(script, rank, world_size):
    """The plan TODO 8 should make, built here: kept choices sorted by expert (then token), splits, counts."""
    per_rank = N_EXPERTS // world_size
    _, kept, _ = rank_routing(rank)
    order = sorted((e, t * K + i) for (t, i), e in kept.items())
    send = [sum(1 for e, _ in order if e // per_rank == peer) for peer in range(world_size)]
    counts = expected_rows(rank, world_size)[1]
    plan = script.Plan(torch.tensor([flat for _, flat in order]), send, [sum(c) for c in counts], torch.tensor(counts))
    return plan


def check_combine(script, rank, world_size, group):
    per_rank = N_EXPERTS // world_size
    plan = reference_plan(script, rank, world_size)
    rows, counts, _ = expected_rows(rank, world_size)
    scale = torch.cat([torch.full((n,), 1.0 + rank * per_rank + j) for c in counts for j, n in enumerate(c)])
    results = (torch.stack(rows) * scale[:, None]).requires_grad_()  # expert e's result for token x: (e + 1) x
    gates = rank_routing(rank)[2].clone().requires_grad_()
    routing, kept = routing_of(script, rank, gates)
    output = script.combine(results, plan, routing, TOKENS, checked_exchange(script, 9), group)
    tokens, weights = rank_tokens(rank), torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(30 + rank))
    factor = (routing.experts + 1.0) * kept  # [T, k]: (e + 1) for a kept choice, 0 for a dropped one
    want = (gates.detach() * factor).sum(dim=1, keepdim=True) * tokens
    if output.shape != want.shape or not close(output, want):
        return (
            f"TODO 9: rank {rank}'s combined output differs from sum over kept choices of gate x result: bring the "
            "results back with the splits swapped, to the token each row came from (plan.order // k), weighted"
        )
    (output * weights).sum().backward()
    want_gates = factor * (tokens * weights).sum(dim=1, keepdim=True)
    if gates.grad is None or not close(gates.grad, want_gates):
        return f"TODO 9: rank {rank}: the gates get no or wrong gradients: weight the results by the gates as tensors"
    want_results = []
    for source in range(world_size):
        _, source_kept, source_gates = rank_routing(source)
        source_weights = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(30 + source))
        for expert in range(rank * per_rank, (rank + 1) * per_rank):
            mine = sorted((t, i) for (t, i), e in source_kept.items() if e == expert)
            want_results += [source_gates[t, i] * source_weights[t] for t, i in mine]
    want_results = torch.stack(want_results) if want_results else torch.zeros(0, DIM)
    if results.grad is None or results.grad.shape != want_results.shape or not close(results.grad, want_results):
        return f"TODO 9: rank {rank}: the experts' results get wrong gradients back (gate x the token's gradient)"


def check_gradients(script, rank, world_size, group):
    shapes = [(3, 4), (5,), (2, 2, 2)]

    def gradient(r, index):
        return torch.randn(shapes[index % 50], generator=torch.Generator().manual_seed(100 * r + index))

    replicated = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    experts = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for index, p in enumerate(replicated):
        p.grad = gradient(rank, index)
    for index, p in enumerate(experts):
        p.grad = gradient(rank, 50 + index)
    script.synchronize_gradients(replicated, experts, group)
    for index, p in enumerate(replicated):
        want = sum(gradient(r, index) for r in range(world_size)) / world_size
        if (p.grad - want).abs().max() > TOLERANCE:
            return f"TODO 10: rank {rank}: a replicated gradient is not the mean over the {world_size} ranks"
    for index, p in enumerate(experts):
        want = gradient(rank, 50 + index) / world_size
        if (p.grad - want).abs().max() > TOLERANCE:
            return (
                f"TODO 10: rank {rank}: an expert's gradient should be its own divided by {world_size} (it already "
                "holds every rank's tokens; the other ranks hold other experts)"
            )


def check_parity(script, rank, world_size, group):
    args = argparse.Namespace(
        seed=3, seq_len=16, dim=32, n_layers=2, n_heads=2, experts=4, top_k=2, capacity_factor=1.0,
        aux_loss_weight=0.05, impl="scratch", batch_size=2,
    )  # fmt: skip
    config = ModelConfig(seq_len=args.seq_len, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
    tokens = torch.randint(
        0, 256, (world_size * args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(5)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = reference_model(config, args.seed, args.experts, args.top_k, args.capacity_factor, world_size)
    want_logits = reference(inputs)
    want_loss = loss_fn(want_logits, targets) + args.aux_loss_weight * sum(b.mlp.aux_loss for b in reference.blocks)
    want_loss.backward()

    model = script.build_moe_model(args, group)
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    logits = model(inputs[mine])
    loss = loss_fn(logits, targets[mine]) + args.aux_loss_weight * sum(b.mlp.aux_loss for b in model.blocks)
    loss.backward()
    script.synchronize_gradients(*script.split_parameters(model), group)
    if (logits - want_logits[mine]).abs().max() > TOLERANCE:
        return (
            f"rank {rank}'s logits differ from one process's by {float((logits - want_logits[mine]).abs().max()):.1e}"
        )
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    if abs(mean_loss.item() / world_size - want_loss.item()) > TOLERANCE:
        return f"the mean loss {mean_loss.item() / world_size:.7f} is not one process's {want_loss.item():.7f}"
    references = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = references[name].grad
        got = torch.zeros_like(p) if p.grad is None else p.grad
        difference = (got - want).abs().max().item()
        if difference > TOLERANCE:
            return f"rank {rank}: the gradient of {name} differs from one process's by {difference:.1e}"


CHECKS = {"todo7": check_capacity, "todo8": check_dispatch, "todo9": check_combine, "todo10": check_gradients}


def main() -> int:
    spec = importlib.util.spec_from_file_location("lesson09", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, rank, _, world_size = setup(0)
    groups = {name: dist.new_group(timeout=timedelta(seconds=20)) for name in [*CHECKS, "parity"]}
    problems = {}
    for name, check in [*CHECKS.items(), ("parity", check_parity)]:
        todo = name.removeprefix("todo")
        if name == "parity":  # the whole model only when every TODO passed its own check on every rank
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, problems)
            failing = sorted({n for p in everyone for n, problem in p.items() if problem})
            if failing:
                problems[name] = f"not checked: {', '.join(failing)} failed their own checks"
                continue
        try:
            problems[name] = check(script, rank, world_size, groups[name])
        except InconsistentSplits as error:
            problems[name] = str(error)
        except NotImplementedError as error:
            problems[name] = f"TODO {todo}: not done yet ({error})" if todo.isdigit() else f"not done yet ({error})"
        except Exception as error:  # noqa: BLE001 - a learner's mistake that raises: say what and where
            where = traceback.extract_tb(error.__traceback__)[-1]
            prefix = f"TODO {todo}: " if todo.isdigit() else ""
            problems[name] = (
                f"{prefix}rank {rank}: {type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})"
            )
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, problems)
    if rank == 0:
        for name in problems:
            found = next((p[name] for p in everyone if p[name]), None)
            print(f"RESULT {name} {found.splitlines()[0] if found else 'ok'}", flush=True)
    destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
