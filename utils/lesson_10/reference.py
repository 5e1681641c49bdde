"""Lesson 10's mixture of experts outside the lesson: the seeded weights, and the same MoE model on one process.

    router = build_router(config, n_experts=4, seed=0, layer=1)          # the same weights on every rank
    experts = build_experts(config, seed=0, layer=1, experts=range(2, 4))  # built by the rank that holds 2 and 3
    model = reference_model(config, seed=0, n_experts=4, k=2, capacity_factor=1.25, groups=2)
    losses, aux_losses, weights = train_reference(options, groups=2)      # what 2 ranks must match

The reference is written as plain loops: a token at a time for the routing and the capacity, an expert at a time
for the outputs. It routes each group of tokens (the batch of one rank of the parallel run) on its own, with its
own capacity and its own load-balancing loss, exactly as the ranks do, so one process makes the same decisions as
N ranks. Its rules (the lesson's, stated once more here):
- softmax over all E experts' logits, then each token's top k; the gates: at k = 1 the probability itself
  (Switch), at k > 1 the k probabilities divided by their sum (GShard, Mixtral);
- with a capacity factor C (--dispatch padded), capacity = ceil(C x T x k / E) per group of T tokens; choices are
  served every token's first choice before any token's second, tokens in order; a choice over its expert's
  capacity is dropped (it adds nothing: the token keeps its residual stream and its other experts' outputs,
  weighted by their gates as they were). Without one (--dispatch dropless), every choice is kept;
- a layer's load-balancing loss is E x sum_e f_e x P_e for each group (f_e: the fraction of its T x k choices that
  picked e, before the capacity; P_e: e's mean probability), the mean over the groups.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from utils.data import load_token_dataset
from utils.model import MLP, ModelConfig, TransformerLM, build_model, init_weights, loss_fn
from utils.training import DEFAULT_LR, batches

EXPERT_WEIGHTS = ("up_weight", "up_bias", "down_weight", "down_bias")  # stacked over experts: [E, D, H], [E, H], ...


def _generator(seed: int, layer: int, index: int) -> torch.Generator:
    """A generator of its own for each (seed, layer, expert): a rank builds its experts without building the rest."""
    return torch.Generator().manual_seed(((seed * 1000 + layer) * 10_000 + index) % 2**62)


def build_router(config: ModelConfig, n_experts: int, seed: int, layer: int) -> nn.Linear:
    """The router of block `layer`: dim -> one logit per expert, no bias, small normal weights."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        router = nn.Linear(config.dim, n_experts, bias=False)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.02, generator=_generator(seed, layer, 0))
    return router


def build_experts(config: ModelConfig, seed: int, layer: int, experts: range) -> dict[str, torch.Tensor]:
    """The weights of `experts` of block `layer`, stacked: {"up_weight": [n, D, H], "up_bias": [n, H],
    "down_weight": [n, H, D], "down_bias": [n, D]}. Each expert is an MLP of the course model's shape (up, GELU,
    down), initialised as utils.model does from its own generator; its matrices are stored input-major (x @ W)."""
    stacked = {name: [] for name in EXPERT_WEIGHTS}
    for expert in experts:
        with torch.random.fork_rng(devices=[]):
            mlp = MLP(config.dim, config.mlp_ratio * config.dim)
        init_weights(mlp, config.n_layers, _generator(seed, layer, expert + 1))
        for name, tensor in zip(EXPERT_WEIGHTS, (mlp.up_proj.weight.t(), mlp.up_proj.bias,
                                                 mlp.down_proj.weight.t(), mlp.down_proj.bias)):  # fmt: skip
            stacked[name].append(tensor.detach())
    return {name: torch.stack(tensors).contiguous() for name, tensors in stacked.items()}


def reference_routing(probs: torch.Tensor, k: int, capacity_factor: float | None):
    """probs [T, E] -> (each token's k experts, most probable first; {(token, i): expert} for the choices kept),
    one token at a time: every token's first choice, then every token's second, ... (all kept without a factor)."""
    n_tokens, n_experts = probs.shape
    choices = [probs[t].topk(k).indices.tolist() for t in range(n_tokens)]
    capacity = n_tokens * k if capacity_factor is None else math.ceil(capacity_factor * n_tokens * k / n_experts)
    taken, kept = [0] * n_experts, {}
    for i in range(k):
        for t in range(n_tokens):
            expert = choices[t][i]
            if taken[expert] < capacity:
                taken[expert] += 1
                kept[t, i] = expert
    return choices, kept


def slot_problem(choices, kept, slots, capacity: int) -> str | None:
    """What is wrong with the slots of a capacity's decisions, or None. Within each expert the kept choices take
    distinct slots below the capacity, in any order (the dispatch writes each token to its slot and the combine reads
    its result back from the same one); a dropped choice's slot is at or past the capacity."""
    choices, kept, slots = torch.as_tensor(choices), torch.as_tensor(kept).bool(), torch.as_tensor(slots)
    if slots.shape != choices.shape:
        return f"slots of shape {list(slots.shape)}, not the choices' {list(choices.shape)}"
    for expert in choices.unique().tolist():
        taken = slots[kept & (choices == expert)].tolist()
        if len(set(taken)) != len(taken) or not all(0 <= slot < capacity for slot in taken):
            return (
                f"expert {expert}'s {len(taken)} kept choices take slots {sorted(taken)}: want {len(taken)} different "
                f"slots in 0 .. {capacity - 1} (two in one slot lose a token)"
            )
    if bool((slots[~kept] < capacity).any()):
        return f"a dropped choice has a slot below the capacity {capacity} (a choice is kept when its slot < capacity)"
    return None


def queue_order(n_tokens: int, k: int, token_major: bool = False) -> list[tuple[int, int]]:
    """The (token, i) choices in the order an expert's queue serves them: every token's first choice, then every
    second, ... (token_major: a token's k choices, then the next token's: the mistake)."""
    if token_major:
        return [(t, i) for t in range(n_tokens) for i in range(k)]
    return [(t, i) for i in range(k) for t in range(n_tokens)]


def keep_first(choices: torch.Tensor, capacity: int, order) -> torch.Tensor:
    """The kept mask when each expert keeps the first `capacity` choices it meets in `order`."""
    kept, taken = torch.zeros(choices.shape, dtype=torch.bool), {}
    for t, i in order:
        expert = int(choices[t, i])
        if taken.get(expert, 0) < capacity:
            kept[t, i], taken[expert] = True, taken.get(expert, 0) + 1
    return kept


def kept_problem(choices, want, got, capacity: int) -> str | None:
    """The first choice, in the queue's order (every token's first choice, then every second, ...), that `got` keeps
    or drops otherwise than `want`, and the likely cause when a known mistake keeps exactly what `got` keeps."""
    choices, want, got = torch.as_tensor(choices), torch.as_tensor(want).bool(), torch.as_tensor(got).bool()
    if got.shape != want.shape:
        return f"the kept mask has shape {list(got.shape)}, not the choices' {list(want.shape)} [T, k]"
    n_tokens, k = choices.shape
    mistakes = {
        "a token's k choices are queued before the next token's: every token's first choice comes before any "
        "second": keep_first(choices, capacity, queue_order(n_tokens, k, token_major=True)),
        f"each expert keeps {capacity + 1}, one more than its capacity: a choice is kept when its slot < capacity, "
        "slots counting from 0": keep_first(choices, capacity + 1, queue_order(n_tokens, k)),
        f"each expert keeps {capacity - 1}, one fewer than its capacity: slots count from 0": keep_first(
            choices, capacity - 1, queue_order(n_tokens, k)),
    }  # fmt: skip
    cause = next((why for why, wrong in mistakes.items() if torch.equal(got, wrong) and not torch.equal(got, want)),
                 "is every token's first choice served before any second, tokens in order?")  # fmt: skip
    queued = {}  # expert -> choices served before this one
    for t, i in queue_order(n_tokens, k):
        expert = int(choices[t, i])
        before = queued.get(expert, 0)
        queued[expert] = before + 1
        if bool(got[t, i]) != bool(want[t, i]):
            place = f"token {t}'s choice {i + 1} (expert {expert}, {before} of its choices before it)"
            verdict = "is dropped; capacity {} keeps it" if want[t, i] else "is kept; capacity {} is full by then"
            return f"{place} {verdict.format(capacity)} ({cause})"
    return None


def experts_pair_by_pair(experts, received: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """What a rank's experts give the rows it received, one small matmul pair per (source rank, expert), in the order
    the rows arrived (source 0's rows for expert 0, for expert 1, ..., then source 1's): the loop that one batched
    call replaces. experts: stacked weights up_weight [n, D, H], up_bias, down_weight [n, H, D], down_bias; counts
    [sources, n]: the rows from each source for each expert."""
    pairs = [expert for _ in range(counts.shape[0]) for expert in range(counts.shape[1])]
    return torch.cat([
        F.gelu(rows @ experts.up_weight[e] + experts.up_bias[e]) @ experts.down_weight[e] + experts.down_bias[e]
        for e, rows in zip(pairs, received.split(counts.flatten().tolist()))
    ])  # fmt: skip


def reference_gate(probs_of_token: torch.Tensor, choices: list[int], expert: int) -> torch.Tensor:
    """The gate of `expert` for one token: its probability at k = 1, renormalised over the token's choices at k > 1."""
    if len(choices) == 1:
        return probs_of_token[expert]
    return probs_of_token[expert] / probs_of_token[choices].sum()


class ReferenceMoE(nn.Module):
    """A block's MoE MLP on one process: the router, every expert, plain loops. The batch (dim 0) is cut into
    `groups` equal groups, each routed and capped on its own (one group per rank of the parallel run)."""

    def __init__(self, router: nn.Linear, experts: dict, k: int, capacity_factor: float | None, groups: int):
        super().__init__()
        self.router = router
        self.experts = nn.ParameterDict({name: nn.Parameter(tensor.clone()) for name, tensor in experts.items()})
        self.k, self.capacity_factor, self.groups = k, capacity_factor, groups
        self.aux_loss = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w = self.experts
        return F.gelu(x @ w["up_weight"][e] + w["up_bias"][e]) @ w["down_weight"][e] + w["down_bias"][e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, aux_losses = [], []
        for group in x.chunk(self.groups, dim=0):
            out, aux = self._group(group.reshape(-1, group.shape[-1]))
            outputs.append(out.view(group.shape))
            aux_losses.append(aux)
        self.aux_loss = torch.stack(aux_losses).mean()
        return torch.cat(outputs)

    def _group(self, tokens: torch.Tensor):
        n_experts = self.router.out_features
        probs = F.softmax(self.router(tokens), dim=-1)
        choices, kept = reference_routing(probs, self.k, self.capacity_factor)
        out = torch.zeros_like(tokens)
        for expert in range(n_experts):
            mine = [t for (t, _), e in kept.items() if e == expert]
            if mine:
                gate = torch.stack([reference_gate(probs[t], choices[t], expert) for t in mine])
                out = out.index_add(0, torch.tensor(mine), gate[:, None] * self.expert(expert, tokens[mine]))
        fraction = torch.zeros(n_experts)
        for token_choices in choices:
            for expert in token_choices:
                fraction[expert] += 1 / (len(choices) * self.k)
        return out, n_experts * (fraction * probs.mean(dim=0)).sum()


def reference_model(config: ModelConfig, seed: int, n_experts: int, k: int, capacity_factor: float | None,
                    groups: int) -> TransformerLM:  # fmt: skip
    """The course model (lesson 00's) with every block's MLP a ReferenceMoE, weights as the parallel run builds them.
    capacity_factor None: dropless (every choice kept)."""
    model = build_model(config, seed=seed)
    for layer, block in enumerate(model.blocks):
        experts = build_experts(config, seed, layer, range(n_experts))
        router = build_router(config, n_experts, seed, layer)
        block.mlp = ReferenceMoE(router, experts, k, capacity_factor, groups)
    return model


def train_reference(options, groups: int, steps: int | None = None):
    """One process trains the reference model with SGD on the parallel run's global batches (groups x
    --batch-size sequences, lesson 00's order of batches). `options`: the script's arguments (or a Namespace with
    seed, dataset, data_dir, seq_len, dim, n_layers, n_heads, batch_size, lr, steps, experts, top_k, dispatch,
    capacity_factor, aux_loss_weight). Returns (cross-entropy per step, [step][layer] load-balancing loss, weights)."""
    config = ModelConfig(seq_len=options.seq_len, dim=options.dim, n_layers=options.n_layers, n_heads=options.n_heads)
    factor = options.capacity_factor if options.dispatch == "padded" else None
    model = reference_model(config, options.seed, options.experts, options.top_k, factor, groups=groups)
    lr = options.lr if options.lr is not None else DEFAULT_LR["sgd"]  # the script's default when none is given
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = load_token_dataset(options.dataset, options.seq_len, "train", cache_dir=options.data_dir)
    generator = torch.Generator().manual_seed(options.seed)
    loader = DataLoader(data, batch_size=groups * options.batch_size, shuffle=True, drop_last=True, generator=generator)
    losses, aux_losses = [], []
    for _, (inputs, targets) in zip(range(steps or options.steps), batches(loader)):  # epoch after epoch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        per_layer = [block.mlp.aux_loss for block in model.blocks]
        (loss + options.aux_loss_weight * sum(per_layer)).backward()
        optimizer.step()
        losses.append(loss.item())
        aux_losses.append([aux.item() for aux in per_layer])
    return losses, aux_losses, {name: p.detach().clone() for name, p in model.named_parameters()}
