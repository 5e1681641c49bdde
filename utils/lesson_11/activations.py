"""What each operation of a block keeps for backward, what it costs to recompute, and the checkpointing wrappers.

Activation checkpointing keeps a block's input and recomputes the rest of its forward during backward: memory
down, time up. Selective checkpointing keeps the outputs of some operations (those expensive to recompute for the
bytes they take) and recomputes the others; the lesson's TODO 4 chooses them under a cap, from this table.
"""

from functools import partial

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# The operations a block of the course model runs (as a policy sees them: torch.ops.aten's names), apart from
# views and transposes, which cost nothing and hold no memory of their own. Attention's fused kernel has one name
# per device: the CPU's, and the GPU's flash and memory-efficient ones.
ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
             "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention")  # fmt: skip


def block_op_costs(config, tokens: int, bytes_per_value: int = 4) -> dict[str, tuple[int, float]]:
    """op -> (bytes its outputs take in one block, FLOPs to recompute them) for `tokens` tokens (batch x sequence).
    Per token, with D the width and 4D the MLP's: six projections (q, k, v, o: D each; up: 4D; down: D), causal
    attention (D, and a log-sum-exp per head), GELU (4D), two layer norms and two residual additions (D each)."""
    d, n, t = config.dim, tokens, config.seq_len
    values = {
        "aten.addmm": (9 * d, 2 * (4 * d * d + 2 * 4 * d * d)),  # six projections: 12 D^2 multiply-adds per token
        "attention": (d + config.n_heads, 2 * t * d),  # causal: half of the 4 T D of scores and weighted sum
        "aten.gelu": (4 * d, 8 * 4 * d),  # a few operations per value
        "aten.native_layer_norm": (2 * d, 2 * 5 * d),
        "aten.add": (2 * d, 2 * d),
    }
    return {op: (n * per_token * bytes_per_value, float(n * flops)) for op, (per_token, flops) in values.items()}


def op_name(func) -> str:
    """A policy's name for an operation: 'aten.addmm', ...; the attention kernels of every device as 'attention'."""
    name = str(func.overloadpacket)
    return "attention" if name in ATTENTION else name


def checkpoint_blocks(model, how: str, saved_ops=frozenset()):
    """Wrap every block's forward in activation checkpointing: how = "full" (keep only the block's input) or
    "selective" (also keep the outputs of the operations named in saved_ops). Call before DDP/FSDP wrap the model."""

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op_name(func) in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE

    for block in model.blocks:
        forward = block.forward
        if how == "full":
            block.forward = partial(checkpoint, forward, use_reentrant=False)
        else:
            context = partial(create_selective_checkpoint_contexts, policy)
            block.forward = partial(checkpoint, forward, use_reentrant=False, context_fn=context)
    return model
