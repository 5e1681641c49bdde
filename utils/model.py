"""The course's one model: a small decoder-only Transformer language model built from plain nn.Linear layers.

    model = build_model(TINY, seed=0)          # identical weights on every rank, whatever its RNG state
    logits = model(tokens)                     # tokens [B, T] -> logits [B, T, vocab_size]
    loss = loss_fn(logits, targets)

Every later lesson parallelises this same model, so its layout is deliberate:

- `model.blocks` is an nn.ModuleList of identical pre-norm blocks between the embeddings and the head.
  Lesson 03 wraps each block with FSDP; lesson 05 cuts the list into pipeline stages.
- Each projection is its own nn.Linear: attention's `q_proj`, `k_proj`, `v_proj`, `o_proj` and the MLP's
  `up_proj`, `down_proj`. Lesson 04 shards q/k/v and up column-wise (by output features) and o and down
  row-wise (by input features), so that one block needs only one all-reduce in attention and one in the MLP.
- No dropout and no weight tying: runs are deterministic and every parameter belongs to exactly one module,
  which keeps the parity checks between parallel layouts exact.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens (utils.data)
    seq_len: int = 64  # longest sequence; the size of the learned position embedding
    dim: int = 64  # model width
    n_heads: int = 4  # attention heads; dim must be divisible by it (and by the tensor-parallel size)
    n_layers: int = 2  # number of blocks
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * dim

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")


# The tests, notebooks and CPU runs use this one: 137 k parameters, a training step in about 10 ms on one CPU core.
TINY = ModelConfig()

# An example for the GPU cluster (26 M parameters, 1024-token context): divisible by 2, 4 and 8
# in heads and layers, so tensor and pipeline parallelism can split it. Pass the sizes on the command line:
#   --dim 512 --n-layers 8 --n-heads 8 --seq-len 1024
GPU_EXAMPLE = ModelConfig(seq_len=1024, dim=512, n_heads=8, n_layers=8)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate query, key, value and output projections.

    The heads are views of the q/k/v outputs: features [h * head_dim, (h + 1) * head_dim) are head h.
    Tensor parallelism over t ranks keeps whole heads on each rank: it gives rank r the rows
    [r * dim / t, (r + 1) * dim / t) of q_proj, k_proj and v_proj (= heads r * n_heads / t ...) and the
    matching columns of o_proj. The head count is therefore read from the local weight shape at run time
    (`q_proj.out_features // head_dim`), so the same forward code runs on a full or a sharded module.
    """

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads  # fixed; the number of heads this module holds is derived from it
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(projection: torch.Tensor) -> torch.Tensor:  # [B, T, H*hd] -> [B, H, T, hd]
            return projection.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # token t sees tokens <= t only
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attention = Attention(config.dim, config.n_heads)
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.mlp_ratio * config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """tokens [B, T] -> token + position embeddings -> blocks -> final norm -> head -> logits [B, T, V]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.position_embedding = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size)  # not tied to token_embedding

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's place in the whole sequence, when `tokens` is only part of it (lesson 09's
        context parallelism gives each rank a chunk of the sequence); by default 0, 1, ..., T - 1."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_weights(model: nn.Module, n_layers: int, generator: torch.Generator):
    """Small normal weights; the projections that write into the residual stream are scaled down
    by 1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj", "down_proj")) else 0.02
            with torch.no_grad():
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            with torch.no_grad():
                module.weight.normal_(0.0, 0.02, generator=generator)
        # LayerNorm keeps its default weight 1, bias 0.


def build_model(config: ModelConfig = TINY, seed: int = 0) -> TransformerLM:
    """A TransformerLM whose weights depend on `seed` only.

    The weights come from a generator of their own, so they neither depend on nor change the global
    RNG: every rank builds the same model even though `setup()` seeded each rank differently.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own default init draws from the global RNG
        model = TransformerLM(config)
    init_weights(model, config.n_layers, generator)
    return model


def count_parameters(config: ModelConfig) -> int:
    """The parameter count, from the formula (the tests check it against the built model)."""
    d, v, hidden = config.dim, config.vocab_size, config.mlp_ratio * config.dim
    attention = 4 * (d * d + d)  # q, k, v, o: weight and bias each
    mlp = (d * hidden + hidden) + (hidden * d + d)
    norms = 2 * 2 * d  # two LayerNorms per block, weight and bias
    per_block = attention + mlp + norms
    embeddings = v * d + config.seq_len * d
    head = d * v + v
    return embeddings + config.n_layers * per_block + 2 * d + head


def parameter_breakdown(config: ModelConfig) -> dict[str, int]:
    """Where the parameters sit: embeddings, all blocks, the final norm, the head (they add up to count_parameters)."""
    d, v, hidden = config.dim, config.vocab_size, config.mlp_ratio * config.dim
    per_block = 4 * (d * d + d) + (d * hidden + hidden) + (hidden * d + d) + 2 * 2 * d
    return {
        "token + position embeddings": v * d + config.seq_len * d,
        "blocks": config.n_layers * per_block,
        "final norm": 2 * d,
        "head": d * v + v,
    }


def flops_per_token(config: ModelConfig) -> int:
    """Floating-point operations to train on one token (forward + backward), the usual estimate:

    6 x (parameters in matrix multiplications) -- 2 per multiply-add forward, 4 backward -- plus the
    attention scores and their weighted sum, 2 x 2 x seq_len x dim per layer forward (x 3 with backward).
    Embedding lookups, norms and biases are not matrix multiplications and are left out.
    """
    d, hidden = config.dim, config.mlp_ratio * config.dim
    matmul_params = config.n_layers * (4 * d * d + 2 * d * hidden) + d * config.vocab_size
    attention = config.n_layers * 3 * 2 * 2 * config.seq_len * d
    return 6 * matmul_params + attention


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
