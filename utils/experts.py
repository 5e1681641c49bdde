"""Lesson 09's mixture of experts outside the lesson: the seeded weights, and the same MoE model on one process.

    router = build_router(config, n_experts=4, seed=0, layer=1)      # the same weights on every rank
    expert = build_expert(config, seed=0, layer=1, expert=2)          # built by the rank that holds expert 2 only
    model = reference_model(config, seed=0, n_experts=4, k=2, capacity_factor=1.25, groups=2)
    losses, weights = train_reference(options, groups=2)              # what `--parallel ep` on 2 ranks must match

The reference is written as plain loops, apart from the lesson's vectorised TODOs: a token at a time for the
capacity, an expert at a time for the outputs. It routes each group of tokens (the batch of one rank of the
parallel run) on its own, with its own capacity and its own load-balancing loss, exactly as the ranks do, so one
process makes the same decisions as N ranks. Its rules (the lesson's, stated once more here):
- softmax over all E experts' logits, then each token's top k; the gates are those k probabilities divided by
  their sum (a token's output is a weighted mean of its experts' outputs);
- capacity = ceil(C x T x k / E) per group of T tokens; choices are served every token's first choice before any
  token's second choice, tokens in order; a choice over its expert's capacity is dropped (it adds nothing: the
  token keeps its residual stream and its other experts' outputs, weighted by their gates as they were);
- the load-balancing loss of a group is E x sum_e f_e x P_e (f_e: the fraction of its T x k choices that picked
  e, before the capacity; P_e: e's mean probability), summed over the layers; the model's is the mean over groups.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from utils.data import load_token_dataset
from utils.model import MLP, ModelConfig, TransformerLM, build_model, init_weights, loss_fn


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


def build_expert(config: ModelConfig, seed: int, layer: int, expert: int) -> MLP:
    """Expert `expert` of block `layer`: an MLP of the course model's shape, initialised as utils.model does."""
    with torch.random.fork_rng(devices=[]):
        mlp = MLP(config.dim, config.mlp_ratio * config.dim)
    init_weights(mlp, config.n_layers, _generator(seed, layer, expert + 1))
    return mlp


def full_weights(model: nn.Module, device: torch.device, keep: bool) -> tuple[dict | None, float]:
    """(every parameter of the whole MoE model, each rank's experts gathered, where `keep`; the sum of their
    squares in float64, on every rank: the checksum one process's model has). Every rank must call it."""
    mine = {name: p.detach().cpu() for name, p in model.named_parameters() if ".experts." in name}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full = {name: p.detach().cpu() for name, p in model.named_parameters() if ".experts." not in name}
    for part in everyone:
        full.update(part)
    checksum = torch.tensor(
        sum(float(p.double().pow(2).sum()) for p in full.values()), dtype=torch.float64, device=device
    )
    dist.broadcast(checksum, src=0)  # rank 0's figure everywhere (the same sums, added in the same order)
    return (full if keep else None), float(checksum)


def reference_routing(probs: torch.Tensor, k: int, capacity_factor: float) -> tuple[list[list[int]], dict]:
    """probs [T, E] -> (each token's k experts, most probable first; {(token, i): expert} for the choices
    within capacity), one token at a time: every token's first choice, then every token's second, ..."""
    n_tokens, n_experts = probs.shape
    choices = [probs[t].topk(k).indices.tolist() for t in range(n_tokens)]
    capacity = math.ceil(capacity_factor * n_tokens * k / n_experts)
    taken, kept = [0] * n_experts, {}
    for i in range(k):
        for t in range(n_tokens):
            expert = choices[t][i]
            if taken[expert] < capacity:
                taken[expert] += 1
                kept[t, i] = expert
    return choices, kept


class ReferenceMoE(nn.Module):
    """A block's MoE MLP on one process: the router, every expert, plain loops. The batch (dim 0) is cut into
    `groups` equal groups, each routed and capped on its own (one group per rank of the parallel run)."""

    def __init__(self, router: nn.Linear, experts: list[nn.Module], k: int, capacity_factor: float, groups: int):
        super().__init__()
        self.router, self.experts = router, nn.ModuleList(experts)
        self.k, self.capacity_factor, self.groups = k, capacity_factor, groups
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, aux_losses = [], []
        for group in x.chunk(self.groups, dim=0):
            out, aux = self._group(group.reshape(-1, group.shape[-1]))
            outputs.append(out.view(group.shape))
            aux_losses.append(aux)
        self.aux_loss = torch.stack(aux_losses).mean()
        return torch.cat(outputs)

    def _group(self, tokens: torch.Tensor):
        n_experts = len(self.experts)
        probs = F.softmax(self.router(tokens), dim=-1)
        choices, kept = reference_routing(probs, self.k, self.capacity_factor)
        out = torch.zeros_like(tokens)
        for expert in range(n_experts):
            mine = [(t, i) for (t, i), e in kept.items() if e == expert]
            if not mine:
                continue
            rows = torch.tensor([t for t, _ in mine])
            gate = torch.stack([probs[t, expert] / probs[t, choices[t]].sum() for t, _ in mine])
            out = out.index_add(0, rows, gate[:, None] * self.experts[expert](tokens[rows]))
        fraction = torch.zeros(n_experts)
        for token_choices in choices:
            for expert in token_choices:
                fraction[expert] += 1 / (len(choices) * self.k)
        return out, n_experts * (fraction * probs.mean(dim=0)).sum()


def reference_model(
    config: ModelConfig, seed: int, n_experts: int, k: int, capacity_factor: float, groups: int
) -> TransformerLM:
    """The course model with every block's MLP a ReferenceMoE, weights as the parallel run builds them."""
    model = build_model(config, seed=seed)
    for layer, block in enumerate(model.blocks):
        experts = [build_expert(config, seed, layer, e) for e in range(n_experts)]
        block.mlp = ReferenceMoE(build_router(config, n_experts, seed, layer), experts, k, capacity_factor, groups)
    return model


def train_reference(options, groups: int, steps: int | None = None):
    """One process trains the reference model with SGD on the parallel run's global batches (groups x
    --batch-size sequences, lesson 00's order of batches). `options`: the script's arguments (or a Namespace with
    seed, dataset, data_dir, seq_len, dim, n_layers, n_heads, batch_size, lr, steps, experts, top_k,
    capacity_factor, aux_loss_weight). Returns (cross-entropy per step, load-balancing loss per step, weights)."""
    config = ModelConfig(seq_len=options.seq_len, dim=options.dim, n_layers=options.n_layers, n_heads=options.n_heads)
    model = reference_model(
        config, options.seed, options.experts, options.top_k, options.capacity_factor, groups=groups
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=options.lr)
    data = load_token_dataset(options.dataset, options.seq_len, "train", cache_dir=options.data_dir)
    generator = torch.Generator().manual_seed(options.seed)
    loader = DataLoader(data, batch_size=groups * options.batch_size, shuffle=True, drop_last=True, generator=generator)
    losses, aux_losses = [], []
    batches = (batch for _ in iter(int, 1) for batch in loader)  # endless: epoch after epoch
    for _, (inputs, targets) in zip(range(steps or options.steps), batches):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        aux = sum(block.mlp.aux_loss for block in model.blocks)
        (loss + options.aux_loss_weight * aux).backward()
        optimizer.step()
        losses.append(loss.item())
        aux_losses.append(aux.item())
    return losses, aux_losses, {name: p.detach().clone() for name, p in model.named_parameters()}
