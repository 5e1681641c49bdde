"""Lesson 09, expert parallelism (TODOs 6-10): the mistakes a learner makes, each of which its test must catch.

Not listed: "f and P swapped" in the load-balancing loss. E x sum_e f_e P_e is symmetric in the two, so swapping
their names changes nothing; the mistakes that do change it (f over tokens instead of choices, P over the chosen
experts only, no factor E) are below.
"""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 6: the router
    Mutant(todo=6, what="gates not renormalised: the chosen experts' probabilities as they are",
           find="    gates = top / top.sum(dim=-1, keepdim=True)\n", replace="    gates = top\n"),
    Mutant(todo=6, what="top-k and gates from the logits instead of the softmax's probabilities",
           find="    top, experts = probs.topk(k, dim=-1)\n", replace="    top, experts = logits.topk(k, dim=-1)\n"),
    Mutant(todo=6, what="load-balancing loss without the factor E",
           find="aux_loss = n_experts * (f * P).sum()", replace="aux_loss = (f * P).sum()"),
    Mutant(todo=6, what="f_e as the fraction of tokens (sums to k), not of the T x k choices",
           find=".to(probs.dtype) / experts.numel()", replace=".to(probs.dtype) / experts.shape[0]"),
    Mutant(todo=6, what="P_e averages the gates of the chosen experts instead of every expert's probability",
           find="    P = probs.mean(dim=0)\n",
           replace="    P = torch.zeros_like(probs).scatter(1, experts, gates).mean(dim=0)\n"),
    # TODO 7: capacity
    Mutant(todo=7, what="capacity from the global batch's tokens (N x T), not this rank's",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = math.ceil(capacity_factor * n_tokens * dist.get_world_size() * k / n_experts)"),
    Mutant(todo=7, what="capacity rounded down instead of up",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = int(capacity_factor * n_tokens * k / n_experts)"),
    Mutant(todo=7, what="positions counted from 1: each expert keeps one choice fewer than its capacity",
           find="(F.one_hot(in_order, n_experts).cumsum(dim=0) - 1)",
           replace="F.one_hot(in_order, n_experts).cumsum(dim=0)"),
    Mutant(todo=7, what="token-major priority: a token's second choice before the next token's first",
           find="    in_order = experts.t().flatten()\n", replace="    in_order = experts.flatten()\n"),
    # TODO 8: the counts exchange and the dispatch
    Mutant(todo=8, what="send counts used as receive counts",
           find="    recv_splits = recv_counts.view(world_size, -1).sum(1).tolist()\n",
           replace="    recv_splits = send_splits\n"),
    Mutant(todo=8, what="no counts exchange: a rank expects what it would send itself",
           find="    dist.all_to_all_single(recv_counts, counts, group=group)\n",
           replace="    recv_counts.copy_(counts)\n"),
    Mutant(todo=8, what="the kept choices sent in token order, not grouped by expert (rows reach the wrong rank)",
           find="    order = kept_choices[torch.argsort(flat_experts[kept_choices], stable=True)]\n",
           replace="    order = kept_choices\n"),
    Mutant(todo=8, what="a choice's index taken as its token's (tokens[order], not tokens[order // k])",
           find="received = exchange(tokens[order // k], recv_splits, send_splits, group)",
           replace="received = exchange(tokens[order % tokens.shape[0]], recv_splits, send_splits, group)"),
    Mutant(todo=8, what="the rows sent with dist.all_to_all_single itself: no gradient flows back to the tokens",
           find="    received = exchange(tokens[order // k], recv_splits, send_splits, group)\n",
           replace="    received = tokens.new_empty((sum(recv_splits), tokens.shape[1]))\n"
                   "    dist.all_to_all_single(received, tokens[order // k], recv_splits, send_splits, group=group)\n"),
    # TODO 9: the combine
    Mutant(todo=9, what="the reverse all-to-all with the dispatch's splits, not swapped",
           find="back = exchange(results, plan.send_splits, plan.recv_splits, group)",
           replace="back = exchange(results, plan.recv_splits, plan.send_splits, group)"),
    Mutant(todo=9, what="the original order not restored: results added to the tokens in sorted order",
           find="output.index_add(0, plan.order // k, back * gates[:, None])",
           replace="output.index_add(0, plan.order.sort().values // k, back * gates[:, None])"),
    Mutant(todo=9, what="results not weighted by their gates",
           find="output.index_add(0, plan.order // k, back * gates[:, None])",
           replace="output.index_add(0, plan.order // k, back)"),
    Mutant(todo=9, what="gates read in token order, not in the order the rows were sent",
           find="    gates = routing.gates.flatten()[plan.order]\n",
           replace="    gates = routing.gates.flatten()[plan.order.sort().values]\n"),
    # TODO 10: the gradients
    Mutant(todo=10, what="expert gradients double-counted: not divided by N (every rank's tokens already summed)",
           find="    for p in experts:\n        p.grad /= world_size\n", replace=""),
    Mutant(todo=10, what="expert gradients all-reduced with the replicated ones (adds other ranks' experts)",
           find="    gradients = [p.grad for p in replicated]\n",
           replace="    gradients = [p.grad for p in replicated + experts]\n"),
    Mutant(todo=10, what="replicated gradients summed over the ranks, not averaged",
           find="    flat /= world_size\n", replace=""),
]  # fmt: skip
