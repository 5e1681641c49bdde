"""Lesson 10's mutants: plausible mistakes in each TODO of solutions/10_mixture_of_experts.py, each of which its
TODO's tests must catch (python -m tests.mutants --lesson 10), and VARIANTS: other correct answers, which they must
accept.

Not listed: "f and P swapped" in the load-balancing loss. E x sum_e f_e P_e is symmetric in the two, so swapping
their names changes nothing; the mistakes that do change it (f over tokens instead of choices, P over the chosen
experts only, no factor E, P detached) are below.
"""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {  # names TODO comments may use: the APIs the learner must call, which the notebook introduces
    "dist": "torch.distributed, as the script imports it: the counts exchange is dist.all_to_all_single",
    "all_to_all_single": "the collective of the counts exchange (TODO 3), named in the notebook's section 4",
}

GATES = "    gates = top if k == 1 else top / top.sum(dim=-1, keepdim=True)\n"
F_E = "    f = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()\n"
SLOTS = (
    "    in_order = experts.t().flatten()\n"
    "    positions = (F.one_hot(in_order, n_experts).cumsum(dim=0) - 1).gather(1, in_order[:, None]).squeeze(1)\n"
    "    slots = positions.view(k, n_tokens).t()\n"
)
ORDER = "    order = torch.argsort(flat_experts, stable=True)\n"
EXCHANGE_COUNTS = "    dist.all_to_all_single(recv_counts, counts, group=group)\n"
ADD_BACK = "    return output.index_add(0, plan.order // k, back * gates[:, None])\n"
AVERAGE = "    dist.all_reduce(flat, group=group)\n    flat /= world_size\n"
LARGEST = (  # TODO 6's answer, the lines the lab's mistakes replace
    "    largest = torch.tensor(n_tokens, device=device)  # on the collectives' device: NCCL takes CUDA tensors only\n"
    "    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)  # the rank with the most tokens sizes every "
    "buffer\n"
    "    return math.ceil(capacity_factor * int(largest) * k / n_experts)\n"
)
CAPACITY = "    return math.ceil(capacity_factor * int(largest) * k / n_experts)\n"
REDUCE = "    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)"  # (HINT 3 spells it after a semicolon)

MUTANTS = [
    # TODO 1: the router
    Mutant(todo=1, what="gates renormalised at k = 1 too: every gate is 1, the router learns nothing from the task",
           find=GATES, replace="    gates = top / top.sum(dim=-1, keepdim=True)\n",
           shows=("every gate is 1",)),
    Mutant(todo=1, what="gates never renormalised: at k > 1 a token's gates do not sum to 1",
           find=GATES, replace="    gates = top\n",
           shows=("not divided by their sum",)),
    Mutant(todo=1, what="top-k and gates from the logits instead of the softmax's probabilities",
           find="    top, experts = probs.topk(k, dim=-1)\n", replace="    top, experts = logits.topk(k, dim=-1)\n",
           shows=("logits",)),
    Mutant(todo=1, what="load-balancing loss without the factor E",
           find="aux_loss = n_experts * (f * P).sum()", replace="aux_loss = (f * P).sum()",
           shows=("factor E is missing",)),
    Mutant(todo=1, what="f_e as the fraction of tokens (sums to k), not of the T x k choices",
           find=".to(probs.dtype) / experts.numel()", replace=".to(probs.dtype) / experts.shape[0]",
           shows=("divides by the tokens T",)),
    Mutant(todo=1, what="P_e averages the gates of the chosen experts instead of every expert's probability",
           find="    P = probs.mean(dim=0)\n",
           replace="    P = torch.zeros_like(probs).scatter(1, experts, gates).mean(dim=0)\n",
           shows=("P_e averages the chosen experts' gates",)),
    Mutant(todo=1, what="P_e detached: the load-balancing loss never reaches the router",
           find="    P = probs.mean(dim=0)\n", replace="    P = probs.mean(dim=0).detach()\n",
           shows=("load-balancing loss", "detached")),
    Mutant(todo=1, what="gates detached: the router learns from the load-balancing loss only",
           find=GATES, replace="    gates = (top if k == 1 else top / top.sum(dim=-1, keepdim=True)).detach()\n",
           shows=("gates", "detached")),
    Mutant(todo=1, what="f_e counts the first choices only",
           find="torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()",
           replace="torch.bincount(experts[:, 0], minlength=n_experts).to(probs.dtype) / experts.shape[0]",
           shows=("first choices only",)),
    Mutant(todo=1, what="f_e from bincount without minlength: an expert no token chose is missing, not 0",
           find="torch.bincount(experts.flatten(), minlength=n_experts)", replace="torch.bincount(experts.flatten())",
           shows=("TODO 1's code raised", "size of tensor")),
    # TODO 2: the capacity
    Mutant(todo=2, what="capacity from the global batch's tokens (N x T), not this rank's",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = math.ceil(capacity_factor * n_tokens * dist.get_world_size() * k / n_experts)",
           shows=("TODO 2's code raised",)),
    Mutant(todo=2, what="capacity rounded down instead of up",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = int(capacity_factor * n_tokens * k / n_experts)",
           shows=("rounded down",)),
    Mutant(todo=2, what="capacity without the factor C",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = math.ceil(n_tokens * k / n_experts)",
           shows=("factor C is missing",)),
    Mutant(todo=2, what="slots counted from 1: each expert keeps one choice fewer than its capacity",
           find="(F.one_hot(in_order, n_experts).cumsum(dim=0) - 1)",
           replace="F.one_hot(in_order, n_experts).cumsum(dim=0)",
           shows=("one fewer than its capacity",)),
    Mutant(todo=2, what="token-major priority: a token's second choice before the next token's first",
           find="    in_order = experts.t().flatten()\n", replace="    in_order = experts.flatten()\n",
           shows=("first choice", "before any second")),
    Mutant(todo=2, what="the slots read back token-major ([T, k] view of the column-by-column order)",
           find="    slots = positions.view(k, n_tokens).t()\n", replace="    slots = positions.view(n_tokens, k)\n",
           shows=("first choice served before any second",)),
    Mutant(todo=2, what="kept up to and including slot = capacity: one choice too many per expert",
           find="    return slots < capacity, slots, capacity\n",
           replace="    return slots <= capacity, slots, capacity\n",
           shows=("one more than its capacity",)),
    # TODO 3: the counts exchange and the dispatch
    Mutant(todo=3, what="send counts used as receive counts",
           find="    recv_splits = recv_counts.view(world_size, -1).sum(1).tolist()\n",
           replace="    recv_splits = send_splits\n",
           shows=("counts exchange",)),
    Mutant(todo=3, what="no counts exchange: a rank expects what it would send itself",
           find=EXCHANGE_COUNTS, replace="    recv_counts.copy_(counts)\n",
           shows=("counts exchange",)),
    Mutant(todo=3, what="the choices sent in token order, not grouped by expert (rows reach the wrong rank)",
           find=ORDER, replace="    order = torch.arange(flat_experts.numel())\n",
           shows=("order the choices by expert",)),
    Mutant(todo=3, what="a choice's index taken as its token's (tokens[order % T], not tokens[order // k])",
           find="received = exchange(tokens[order // k], recv_splits, send_splits, group)",
           replace="received = exchange(tokens[order % tokens.shape[0]], recv_splits, send_splits, group)",
           shows=("c // k",)),
    Mutant(todo=3, what="the rows sent with dist.all_to_all_single itself: no gradient flows back to the tokens",
           find="    received = exchange(tokens[order // k], recv_splits, send_splits, group)\n",
           replace="    received = tokens.new_empty((sum(recv_splits), tokens.shape[1]))\n"
                   "    dist.all_to_all_single(received, tokens[order // k], recv_splits, send_splits, group=group)\n",
           shows=("gradients",)),
    Mutant(todo=3, what="choices sorted by destination rank only, not by expert (rows reach the wrong expert)",
           find="torch.argsort(flat_experts, stable=True)",
           replace="torch.argsort(flat_experts // (n_experts // world_size), stable=True)",
           shows=("order the choices by expert",)),
    Mutant(todo=3, what="expert e placed on rank e % N instead of e // (E / N) when summing the splits",
           find="    send_splits = counts.view(world_size, -1).sum(1).tolist()\n",
           replace="    send_splits = counts.view(-1, world_size).sum(0).tolist()\n",
           shows=("expects", "rows from rank")),
    # TODO 4: the combine
    Mutant(todo=4, what="the reverse all-to-all with the dispatch's splits, not swapped",
           find="back = exchange(results, plan.send_splits, plan.recv_splits, group)",
           replace="back = exchange(results, plan.recv_splits, plan.send_splits, group)",
           shows=("swapped",)),
    Mutant(todo=4, what="the original order not restored: results added to the tokens in sorted order",
           find=ADD_BACK,
           replace="    return output.index_add(0, plan.order.sort().values // k, back * gates[:, None])\n",
           shows=("token each row came from",)),
    Mutant(todo=4, what="results not weighted by their gates",
           find=ADD_BACK, replace="    return output.index_add(0, plan.order // k, back)\n",
           shows=("not weighted",)),
    Mutant(todo=4, what="gates read in token order, not in the order the rows were sent",
           find="    gates = routing.gates.flatten()[plan.order]\n",
           replace="    gates = routing.gates.flatten()[plan.order.sort().values]\n",
           shows=("gates do not follow the rows' order",)),
    Mutant(todo=4, what="output[token] += ...: a token's second choice overwrites its first",
           find=ADD_BACK, replace="    output[plan.order // k] += back * gates[:, None]\n    return output\n",
           shows=("assigned to its token, not added",)),
    Mutant(todo=4, what="gates detached: the router gets no gradient from the experts' outputs",
           find="    gates = routing.gates.flatten()[plan.order]\n",
           replace="    gates = routing.gates.flatten()[plan.order].detach()\n",
           shows=("gates", "gradients")),
    # TODO 5: the gradients
    Mutant(todo=5, what="expert gradients double-counted: not divided by N (every rank's tokens already summed)",
           find="    for p in experts:\n        p.grad /= world_size\n", replace="",
           shows=("divided by",)),
    Mutant(todo=5, what="expert gradients all-reduced with the replicated ones (adds other ranks' experts)",
           find="    gradients = [p.grad for p in replicated]\n",
           replace="    gradients = [p.grad for p in replicated + experts]\n",
           shows=("expert",)),
    Mutant(todo=5, what="replicated gradients summed over the ranks, not averaged",
           find="    flat /= world_size\n", replace="",
           shows=("not the mean",)),
    Mutant(todo=5, what="the replicated gradients averaged twice (all-reduce with AVG, then divided by N)",
           find="    dist.all_reduce(flat, group=group)\n",
           replace="    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n",
           shows=("not the mean",)),
    Mutant(todo=5, what="the averaged buffer never copied back into the replicated gradients",
           find="        gradient.copy_(average.view_as(gradient))\n    for p in experts:",
           replace="        pass\n    for p in experts:",
           shows=("not the mean",)),
    # more mistakes, by TODO
    Mutant(todo=1, what="at k > 1, a softmax over the chosen probabilities (not their logits): gates too even",
           find=GATES, replace="    gates = top if k == 1 else top.softmax(dim=-1)\n",
           shows=("too even",)),
    Mutant(todo=1, what="the softmax taken over the tokens (dim=0) instead of the experts",
           find="    probs = logits.softmax(dim=-1)\n", replace="    probs = logits.softmax(dim=0)\n",
           shows=("softmax runs over the tokens",)),
    Mutant(todo=2, what="capacity without k (C x T / E): at top-2 an expert gets half its even share",
           find="capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)",
           replace="capacity = math.ceil(capacity_factor * n_tokens / n_experts)",
           shows=("k is missing",)),
    Mutant(todo=3, what="the rows' all-to-all with its output and input splits swapped",
           find="received = exchange(tokens[order // k], recv_splits, send_splits, group)",
           replace="received = exchange(tokens[order // k], send_splits, recv_splits, group)",
           shows=("swapped",)),
    # TODO 6: the lab (padded buffers that do not match)
    Mutant(todo=6, what="each rank's capacity from its own token count (the exercise as handed out)",
           find=LARGEST, replace="    return math.ceil(capacity_factor * n_tokens * k / n_experts)\n",
           shows=("from its own token count", "gloo would abort rank 0")),
    Mutant(todo=6, what="the token counts summed over the ranks: the same on every rank, but N times the buffers",
           find=REDUCE, replace=REDUCE.replace("MAX", "SUM"),
           shows=("the sum of the ranks' counts", "nothing crashes")),
    Mutant(todo=6, what="the smallest token count of any rank: the busier ranks drop choices the factor keeps",
           find=REDUCE, replace=REDUCE.replace("MAX", "MIN"),
           shows=("the fewest any rank holds", "drop")),
    Mutant(todo=6, what="the all-reduce without group=: it runs over the whole job, not the expert-parallel group",
           find=REDUCE, replace=REDUCE.replace(", group=group", ""),
           shows=("did not name `group`",)),
    Mutant(todo=6, what="the capacity not rounded: a float",
           find=CAPACITY, replace="    return capacity_factor * int(largest) * k / n_experts\n",
           shows=("a float", "not an int")),
    Mutant(todo=6, what="rounded up with torch.ceil on the tensor, then .item(): a float (6.0)",
           find=CAPACITY, replace="    return torch.ceil(capacity_factor * largest * k / n_experts).item()\n",
           shows=("6.0", "not an int")),
    Mutant(todo=6, what="the largest count's capacity rounded down with int()",
           find=CAPACITY, replace="    return int(capacity_factor * int(largest) * k / n_experts)\n",
           shows=("rounded down",)),
    Mutant(todo=6, what="each rank's capacity all-reduced with MAX, the tensor itself returned",
           find=LARGEST,
           replace="    capacity = torch.tensor(math.ceil(capacity_factor * n_tokens * k / n_experts))\n"
                   "    dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=group)\n"
                   "    return capacity\n",
           shows=("tensor), not an int",)),
    Mutant(todo=6, what="the count all-reduced as a Python int (a collective takes a tensor): it raises",
           find=LARGEST, replace="    dist.all_reduce(n_tokens, op=dist.ReduceOp.MAX, group=group)\n"
                                 "    largest = n_tokens\n",
           shows=("shared_capacity raised", "10_mixture_of_experts.py:", "(`dist.all_reduce(n_tokens")),
    Mutant(todo=6, what="a tensor made with an argument torch.tensor does not take: it raises before any collective",
           find=LARGEST, replace="    largest = torch.tensor(n_tokens, device=device, group=group)\n",
           shows=("shared_capacity raised TypeError", "10_mixture_of_experts.py:")),
    # Answers fitted to the first call: its largest count is rank 1's and its factor 1; the second call's are not.
    Mutant(todo=6, what="the first call's answer typed in: no collective, the same number in every call",
           find=LARGEST, replace="    return 6\n",
           shows=("called no collective", "call 1's answer")),
    Mutant(todo=6, what="the first call's largest count typed in: max(10, 16, 7), no collective",
           find=LARGEST, replace="    return math.ceil(capacity_factor * max(10, 16, 7) * k / n_experts)\n",
           shows=("called no collective", "which no rank holds in call 2")),
    Mutant(todo=6, what="the count broadcast from rank 1 (the busiest in the first call only)",
           find=REDUCE, replace="    dist.broadcast(largest, src=1, group=group)",
           shows=("broadcast from rank 1", "changes from call to call")),
    Mutant(todo=6, what="the largest count's capacity without the capacity factor",
           find=CAPACITY, replace="    return math.ceil(int(largest) * k / n_experts)\n",
           shows=("without the capacity factor",)),
    Mutant(todo=6, what="Switch's mean: the sum of the counts over the group size, one number on every rank",
           find=LARGEST,
           replace="    total = torch.tensor(n_tokens, device=device)\n"
                   "    dist.all_reduce(total, group=group)\n"
                   "    return math.ceil(capacity_factor * int(total) / dist.get_world_size(group) * k / n_experts)\n",
           shows=("the mean count", "fewer slots than the capacity factor promises", "keeps")),
]  # fmt: skip

VARIANTS = [  # correct answers written another way: each TODO's tests must accept them
    Mutant(todo=1, what="the k most probable experts from a full sort instead of topk",
           find="    top, experts = probs.topk(k, dim=-1)\n",
           replace="    ranked, by_rank = probs.sort(dim=-1, descending=True)\n"
                   "    top, experts = ranked[:, :k], by_rank[:, :k]\n"),
    Mutant(todo=2, what="each expert's kept choices in reverse order of their slots (last served in slot 0)",
           find="    slots = positions.view(k, n_tokens).t()\n",
           replace="    slots = positions.view(k, n_tokens).t()\n"
                   "    slots = torch.where(slots < capacity, capacity - 1 - slots, slots)\n"),
    Mutant(todo=4, what="the results added with scatter_add on an index expanded to the rows",
           find=ADD_BACK,
           replace="    index = (plan.order // k)[:, None].expand(-1, back.shape[1])\n"
                   "    return output.scatter_add(0, index, back * gates[:, None])\n"),
    # TODO 1
    Mutant(todo=1, what="at k > 1, a softmax over the chosen experts' logits (Mixtral's way: the same gates)",
           find=GATES, replace="    gates = top if k == 1 else logits.gather(1, experts).softmax(dim=-1)\n"),
    Mutant(todo=1, what="f_e from one-hot vectors instead of bincount, E x f . P as a dot product",
           find=F_E + "    P = probs.mean(dim=0)\n    aux_loss = n_experts * (f * P).sum()\n",
           replace="    f = F.one_hot(experts, n_experts).sum(dim=(0, 1)).to(probs.dtype) / experts.numel()\n"
                   "    P = probs.mean(dim=0)\n    aux_loss = n_experts * torch.dot(f, P)\n"),
    # TODO 2
    Mutant(todo=2, what="the slots counted by a loop over the choices in priority order",
           find=SLOTS,
           replace="    slots, taken = torch.empty_like(experts), [0] * n_experts\n"
                   "    for i in range(k):\n"
                   "        for t in range(n_tokens):\n"
                   "            slots[t, i] = taken[experts[t, i]]\n"
                   "            taken[experts[t, i]] += 1\n"),
    # TODO 3: any consistent order of the rows within an expert is right
    Mutant(todo=3, what="the rows of each expert in reverse order (sorted by expert, then by descending choice)",
           find=ORDER,
           replace="    order = torch.argsort(flat_experts * len(flat_experts) - torch.arange(len(flat_experts)))\n"),
    Mutant(todo=3, what="an unstable sort: the rows of an expert in whatever order argsort leaves them",
           find=ORDER, replace="    order = torch.argsort(flat_experts)\n"),
    # TODO 4
    Mutant(todo=4, what="the results added with index_put(accumulate=True)",
           find=ADD_BACK,
           replace="    return output.index_put((plan.order // k,), back * gates[:, None], accumulate=True)\n"),
    # TODO 5
    Mutant(todo=5, what="the replicated gradients all-reduced with ReduceOp.AVG (no division after it)",
           find=AVERAGE, replace="    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)\n"),
    Mutant(todo=5, what="one all-reduce per replicated gradient instead of one flat buffer",
           find="    gradients = [p.grad for p in replicated]\n    flat = torch.cat([g.flatten() for g in gradients])\n"
                + AVERAGE
                + "    for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):\n"
                  "        gradient.copy_(average.view_as(gradient))\n",
           replace="    for p in replicated:\n"
                   "        dist.all_reduce(p.grad, group=group)\n"
                   "        p.grad /= world_size\n"),
    Mutant(todo=5, what="the replicated gradients divided by N before the all-reduce",
           find=AVERAGE, replace="    flat /= world_size\n    dist.all_reduce(flat, group=group)\n"),
    Mutant(todo=1, what="at k > 1, the gates normalised with F.normalize(p=1)",
           find=GATES, replace="    gates = top if k == 1 else F.normalize(top, p=1, dim=-1)\n"),
    Mutant(todo=3, what="the choices ordered by torch.sort's indices (stable)",
           find=ORDER, replace="    order = flat_experts.sort(stable=True).indices\n"),
    Mutant(todo=4, what="the results put back in choice order, then each token's k gate-weighted results summed",
           find="    gates = routing.gates.flatten()[plan.order]\n"
                "    output = back.new_zeros(n_tokens, back.shape[1])\n" + ADD_BACK,
           replace="    unsorted = back[torch.argsort(plan.order)].view(n_tokens, k, -1)\n"
                   "    return (unsorted * routing.gates[..., None]).sum(dim=1)\n"),
    # TODO 6: the largest count, or the largest capacity (ceil is monotone: the same number), however gathered
    Mutant(todo=6, what="each rank's own capacity, then its maximum over the group (all-reduce MAX, .item())",
           find=LARGEST,
           replace="    capacity = torch.tensor(math.ceil(capacity_factor * n_tokens * k / n_experts), device=device)\n"
                   "    dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=group)\n"
                   "    return capacity.item()\n"),
    Mutant(todo=6, what="every rank's token count gathered as Python objects, then the largest",
           find=LARGEST,
           replace="    counts = [None] * dist.get_world_size(group)\n"
                   "    dist.all_gather_object(counts, n_tokens, group=group)\n"
                   "    return math.ceil(capacity_factor * max(counts) * k / n_experts)\n"),
    Mutant(todo=6, what="every rank's count all-gathered into one tensor, then its largest",
           find=LARGEST,
           replace="    counts = torch.empty(dist.get_world_size(group), dtype=torch.long, device=device)\n"
                   "    dist.all_gather_into_tensor(counts, torch.tensor([n_tokens], device=device), group=group)\n"
                   "    return math.ceil(capacity_factor * int(counts.max()) * k / n_experts)\n"),
    Mutant(todo=6, what="every rank's count all-gathered into a list of tensors, then the largest",
           find=LARGEST,
           replace="    counts = [torch.tensor(0, device=device) for _ in range(dist.get_world_size(group))]\n"
                   "    dist.all_gather(counts, torch.tensor(n_tokens, device=device), group=group)\n"
                   "    return math.ceil(capacity_factor * max(int(count) for count in counts) * k / n_experts)\n"),
    Mutant(todo=6, what="every rank's capacity all-gathered, the largest returned as a NumPy integer",
           find=LARGEST,
           replace="    mine = torch.tensor([math.ceil(capacity_factor * n_tokens * k / n_experts)], device=device)\n"
                   "    capacities = torch.empty(dist.get_world_size(group), dtype=mine.dtype, device=device)\n"
                   "    dist.all_gather_into_tensor(capacities, mine, group=group)\n"
                   "    return capacities.cpu().numpy().max()  # numpy.int64\n"),
    Mutant(todo=6, what="the unrounded capacity as a float tensor, all-reduced with MAX, then math.ceil",
           find=LARGEST,
           replace="    share = capacity_factor * n_tokens * k / n_experts\n"
                   "    share = torch.tensor(share, dtype=torch.float64, device=device)\n"
                   "    dist.all_reduce(share, op=dist.ReduceOp.MAX, group=group)\n"
                   "    return math.ceil(share.item())\n"),
]  # fmt: skip
