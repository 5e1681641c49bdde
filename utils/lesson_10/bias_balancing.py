"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437, section 2.1.2), on one process.

DeepSeek-V3's router scores each expert with a sigmoid of its logit, not a softmax over the experts. Each expert e
has a bias b_e that is added to the scores only to choose the top-k; the gates come from the unbiased scores of the
chosen experts, divided by their sum. After each step, b_e rises by a fixed speed gamma when e got fewer choices
than the mean and falls by gamma when it got more. The bias is not a parameter: no gradient, no loss term, nothing
that pulls the router away from the task.

The lesson script keeps Switch's softmax router and its loss; this module trains the same course model with this
router instead, every expert on one process (the balance does not depend on where the experts live; on N ranks the
loads are all-reduced before the update, so that every rank moves its copy of the bias alike).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from utils.data import load_token_dataset
from utils.lesson_10.reference import build_experts, build_router
from utils.model import ModelConfig, build_model, loss_fn
from utils.training import DEFAULT_LR, batches


def route_with_bias(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], bias [E] -> (experts [T, k], gates [T, k]): chosen by sigmoid score + bias, weighted by the
    chosen sigmoid scores alone, divided by their sum (DeepSeek-V3's eq. 13-16)."""
    scores = logits.sigmoid()
    experts = (scores.detach() + bias).topk(k, dim=-1).indices  # the bias chooses, it never weights
    chosen = scores.gather(1, experts)
    return experts, chosen / chosen.sum(dim=-1, keepdim=True)


def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """The bias after one step whose choices per expert were `load` [E]: +gamma for an expert below the mean load,
    -gamma above it, unchanged at it (the sign of the violation, as DeepSeek-V3 describes it)."""
    return bias + gamma * torch.sign(load.float().mean() - load.float())


class BiasBalancedMoE(nn.Module):
    """A block's MLP as E experts with a sigmoid router and a balancing bias, every expert on this process:
    [B, T, D] -> [B, T, D]. After each forward, `load` holds the choices per expert (the step's, summed)."""

    def __init__(self, router: nn.Linear, experts: dict, k: int):
        super().__init__()
        self.router, self.k = router, k
        self.experts = nn.ParameterDict({name: nn.Parameter(tensor.clone()) for name, tensor in experts.items()})
        self.register_buffer("bias", torch.zeros(router.out_features))
        self.load = torch.zeros(router.out_features, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        experts, gates = route_with_bias(self.router(tokens), self.bias, self.k)
        self.load = torch.bincount(experts.flatten(), minlength=self.bias.numel())
        w = self.experts  # every expert on every token: E is small here, and the choices then pick the rows
        hidden = F.gelu(torch.einsum("td,edh->eth", tokens, w["up_weight"]) + w["up_bias"][:, None])
        every = torch.einsum("eth,ehd->etd", hidden, w["down_weight"]) + w["down_bias"][:, None]  # [E, T, D]
        token = torch.arange(tokens.shape[0])[:, None].expand_as(experts)
        return (every[experts, token] * gates[..., None]).sum(dim=1).view(x.shape)


def train(gamma: float, steps: int, experts: int = 8, k: int = 2, seed: int = 0, batch_size: int = 8,
          seq_len: int = 32, dim: int = 32, n_layers: int = 2) -> list:  # fmt: skip
    """The course model with BiasBalancedMoE MLPs, trained with AdamW on the synthetic corpus, no load-balancing
    loss; gamma = 0 leaves the bias at 0 (no balancing). Returns [step][layer] the choices per expert."""
    config = ModelConfig(seq_len=seq_len, dim=dim, n_layers=n_layers, n_heads=2)
    model = build_model(config, seed=seed)
    for layer, block in enumerate(model.blocks):
        weights = build_experts(config, seed, layer, range(experts))
        block.mlp = BiasBalancedMoE(build_router(config, experts, seed, layer), weights, k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULT_LR["adamw"], weight_decay=0.0)
    data = load_token_dataset("synthetic", seq_len, "train")
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    loads, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls this small run faster on one thread than on cores shared with other jobs
    for _, (inputs, targets) in zip(range(steps), batches(loader)):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()  # the task's loss only
        optimizer.step()
        loads.append([block.mlp.load.tolist() for block in model.blocks])
        with torch.no_grad():  # on N ranks: all-reduce the loads first, so that every rank's bias moves alike
            for block in model.blocks:
                block.mlp.bias.copy_(update_bias(block.mlp.bias, block.mlp.load, gamma))
    torch.set_num_threads(threads)
    return loads


def busiest_share(loads: list, last: int = 20) -> float:
    """The busiest expert's choices over the even share, worst layer of each step, mean over the last steps."""
    worst = [max(max(layer) * len(layer) / sum(layer) for layer in step) for step in loads[-last:]]
    return sum(worst) / len(worst)
