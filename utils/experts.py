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

Also the expert part's command line and checks (add_expert_options, check_experts) and what a run records for its
metrics (ExpertRecord), kept out of the lesson script.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from utils.data import load_token_dataset
from utils.distributed_utils import CourseError
from utils.model import MLP, ModelConfig, TransformerLM, build_model, init_weights, loss_fn
from utils.training import non_negative_float, positive_int


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


# --------------------------------------------------------------------------------------------------
# The lesson script's command line, checks and metrics for --parallel ep
# --------------------------------------------------------------------------------------------------


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_expert_options(parser):
    """--experts, --top-k, --capacity-factor, --aux-loss-weight and any other option of expert parallelism only."""
    parser.add_argument("--experts", type=positive_int, default=4, help="experts per MoE layer (divisible by ranks)")
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token")
    parser.add_argument(
        "--capacity-factor", type=positive_float, default=1.25, help="capacity = ceil(C x tokens x k / E) per rank"
    )
    parser.add_argument("--aux-loss-weight", type=non_negative_float, default=0.01, help="load-balancing loss weight")


def check_experts(args, world_size: int):
    """Refuse what cannot run, with one line, before any collective."""
    if args.experts % world_size:
        divisors = [str(n) for n in range(1, args.experts + 1) if args.experts % n == 0]
        fits = " or ".join([", ".join(divisors[:-1]), divisors[-1]] if len(divisors) > 1 else divisors)
        raise CourseError(
            f"--experts {args.experts} does not split evenly over {world_size} ranks: use a multiple of {world_size} "
            f"experts, or launch {fits} processes"
        )
    if args.top_k > args.experts:
        raise CourseError(f"--top-k {args.top_k} is more than --experts {args.experts}: choose at most {args.experts}")


class ExpertRecord:
    """What an expert-parallel run records, step by step: the losses averaged over the ranks, each expert's choices
    (before the capacity) and kept rows (after it), all ranks together, in one all-reduce a step; and the rows each
    rank sent and received in step 1's dispatches. `layers`: the model's blocks, whose .mlp is the lesson's MoEMLP
    (after each forward: aux_loss, chosen, kept, splits)."""

    def __init__(self, layers, n_experts: int):
        self.layers, self.n_experts = list(layers), n_experts
        self.losses, self.aux_losses, self.chosen, self.kept, self.splits = [], [], [], [], []

    def step(self, loss: torch.Tensor, aux: torch.Tensor) -> tuple[float, float]:
        """After a step: (the mean loss, the mean auxiliary loss) over the ranks."""
        world_size = dist.get_world_size()
        summed = torch.cat([torch.stack([loss.detach(), aux.detach()]) / world_size]
                           + [torch.cat([b.mlp.chosen, b.mlp.kept]).to(loss.dtype) for b in self.layers])  # fmt: skip
        dist.all_reduce(summed)
        self.losses.append(summed[0].item())
        self.aux_losses.append(summed[1].item())
        counts = summed[2:].view(len(self.layers), 2, self.n_experts).round().long().tolist()
        self.chosen.append([layer[0] for layer in counts])
        self.kept.append([layer[1] for layer in counts])
        if not self.splits:
            self.splits = [block.mlp.splits for block in self.layers]
        return self.losses[-1], self.aux_losses[-1]

    @property
    def dropped(self) -> list:
        """[step][layer]: the choices dropped, all ranks together."""
        return [[sum(c) - sum(k) for c, k in zip(*step)] for step in zip(self.chosen, self.kept)]

    def metrics(self, all_to_all_bytes: int) -> dict:
        """The metrics file's part of it (every rank calls it): all_to_all_bytes, this rank's all-to-all input
        bytes in step 1."""
        rows = [[sum(send), sum(receive)] for send, receive in self.splits]
        mine = {"bytes": all_to_all_bytes, "rows": rows, "send_splits": [send for send, _ in self.splits]}
        sent = [None] * dist.get_world_size()
        dist.all_gather_object(sent, mine)
        return {
            "losses": self.losses,
            "aux_losses": self.aux_losses,
            "expert_choices": self.chosen,  # [step][layer][expert]: choices before the capacity, all ranks together
            "expert_load": self.kept,  # [step][layer][expert]: rows each expert processed
            "dropped": self.dropped,  # [step][layer]
            "all_to_all": sent,  # per rank, step 1: input bytes; per layer [rows sent, received]; rows to each rank
        }
