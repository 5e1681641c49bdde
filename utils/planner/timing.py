"""Time: the kernels of one micro-batch on a stage (FLOPs at the matmuls' rate, memory-bound kernels at the HBM's, a
fixed cost per kernel), and lesson 01's alpha-beta model for every collective, t = messages x alpha + bytes on the
busiest link / bandwidth.

Compute. Model FLOPs per token (what MFU counts): 6N + 6 L s h, the second term the attention scores and their
product with V over the causal half of the s x s matrix (Megatron-LM's papers, PaLM and torchtitan count it whole,
12 L s h: model_flops_per_token(whole_attention=True)). The FLOPs the GPUs execute (hardware FLOPs) differ:
- a fused attention kernel (FlashAttention, PyTorch's scaled_dot_product_attention) skips the masked half of a
  causal score matrix, and its backward recomputes the scores (10 s h a token against the forward's 4 s h);
  an unfused one (Megatron-LM 2021-22) computes the whole matrix (the course's from-scratch ring attention skips
  the blocks above the diagonal but computes the masked half of each diagonal block);
- recomputation adds the forward FLOPs of what it rebuilds: full, every layer's forward (2 x its parameters + the
  attention); selective, unfused, the attention core (Korthikanti et al. 2022); selective, fused, the norms and the
  MLP's activation function, which have no matmul FLOPs (the scores were never stored).
Time of one micro-batch on a stage = its matmul FLOPs / (peak x the GPU's matmul efficiency), each product no faster
than its bytes at the HBM bandwidth (the roofline: a product of few rows, such as an expert's share of the tokens,
is memory-bound; expert parallelism gathers more tokens per expert) + its attention FLOPs at the fused kernel's
rate (Layout.attention_kernel: FlashAttention-2 or -3, hardware.ATTENTION_SPEED) + the bytes its memory-bound kernels
move / HBM bandwidth (norms, residual adds, the activation function; the scores' softmax when unfused) + a fixed
cost per kernel (launch, tail).
The per-kernel cost and the matmuls' share make small micro-batches less efficient; nothing is an assumed MFU.

Communication that overlaps compute, per layer and micro-batch:
- CP (ring attention): cp - 1 ring steps, each sending a K and a V chunk (2 s/cp b h / t values, kv_heads / heads of
  that with grouped-query attention) while the attention of the chunk in hand runs; only the excess shows. Backward
  sends K and V and their gradients in fp32 (three times the bytes) against 2.5 times the forward's attention. The
  per-step compute grows as (s/cp)^2 h, the transfer as (s/cp) h: long chunks hide the ring.
- EP: per MoE layer, a dispatch and a combine all-to-all forward and backward, each tokens x k x h 16-bit values,
  (ep-1)/ep of them to other ranks; exposed, or hidden behind another micro-batch's compute as far as it lasts
  (Layout.ep_overlap: the assumption is a choice, stated in the layout).
"""

from dataclasses import dataclass

from utils.planner.hardware import Cluster, inside_one_node
from utils.planner.model import Layout, Model

# Memory-bound kernels, in values of h (or of a x s scores) read or written per token and layer in the forward; the
# backward moves about twice as much. Norms and residual adds: two LayerNorms (read, write: 4) and two residual adds
# (read 2, write 1: 6). The MLP's activation function reads and writes its ffn-wide input (2 ffn / h). An unfused
# attention's softmax reads and writes the scores, with the scale and the mask fused into it (Megatron-LM's fused
# kernel), and its dropout reads, writes and keeps a mask: 4 passes over the a x s scores of a token.
NORM_RESIDUAL_VALUES = 10
SCORE_PASSES = 4
# Kernels per layer and micro-batch in forward and backward together (about 12 forward, twice that backward) and the
# fixed time each costs beyond its work (launch, the tail of a partly filled wave): a few microseconds on a GPU.
KERNELS_PER_LAYER = 36
KERNEL_OVERHEAD_S = 4e-6


def all_reduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of nbytes over n ranks: 2(n-1) alpha + 2(n-1)/n x nbytes / bandwidth."""
    return 0.0 if n == 1 else 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def all_gather_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather (or reduce-scatter) of nbytes in all: half an all-reduce."""
    return 0.0 if n == 1 else (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Share of a 1F1B step a stage sits idle: (p-1)/(m+p-1), and interleaved with v chunks per rank,
    (p-1)/v of idle micro-batch slots against m busy ones."""
    idle = (p - 1) / v
    return idle / (m + idle)


def attention_kernel(layout: Layout) -> str | None:
    """The kernel that runs the attention: the layout's fused one, or None (unfused: batched matmuls)."""
    return layout.attention_kernel if layout.fused_attention else None


def bubble_by_microbatches(p: int, v: int = 1, multiples=(1, 2, 4, 8, 16)) -> list[tuple[int, float]]:
    """(m, the 1F1B bubble) for m = p, 2p, 4p... micro-batches a step: the bubble is a trade-off against the batch,
    never a wall. At m = p it is (p-1)/(2p-1), about half the step. Megatron-LM requires m >= p, and a multiple of p
    when interleaved; torch's interleaved schedule needs m a multiple of its rounds, m // p; Llama 3 (section 3.3.2)
    lets m be any number."""
    return [(k * p, bubble_fraction(p, k * p, v)) for k in multiples]


def attention_flops(model: Model, layout: Layout) -> tuple[float, float]:
    """(model, hardware) FLOPs of the attention scores and their product with V, forward, per token and layer on the
    whole model width: model FLOPs count the whole s x s matrix (4 s h), a fused kernel skips the causal half."""
    whole = 4 * model.seq_len * model.hidden
    return whole, whole / 2 if layout.fused_attention else whole


# The travelling dK/dV of a ring's backward, in 16-bit K/V bytes: fp32 gradients, twice the bytes of bf16 K and V.
FP32_GRADIENT_HOPS = 2


def ring_attention_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """Per layer and micro-batch, forward and backward, the part of ring attention's K/V traffic that the attention
    does not hide. Each of the cp - 1 ring steps sends a K and a V chunk, 2 x s/cp x b x h / t 16-bit values (1/t:
    the heads are split over tp), while the attention of the chunk in hand runs (1/cp of the rank's attention, a
    zigzag split balancing the causal triangle over the ranks); backward sends K and V again and their gradients,
    which production rings accumulate and pass on in fp32 (torch's context parallelism, convert_to_f32; ring-flash-
    attn): 1 + 2 = 3 times the forward's bytes, against 2.5 times the forward's attention (a fused kernel's
    backward; 2 times unfused). Full recomputation runs the forward ring again."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    s, b = model.seq_len, layout.micro_batch
    bandwidth, latency = cluster.link(inside_one_node(t, cp, cluster.gpus_per_node))
    step_bytes = 2 * 2 * s / cp * b * model.hidden * model.kv_fraction / t  # K and V chunks, 16-bit
    transfer = latency + step_bytes / bandwidth
    rank_flops = attention_flops(model, layout)[1] * (s / cp) * b / t
    kernel = attention_kernel(layout)
    per_step = rank_flops / cluster.attention_flops(kernel) / cp
    backward_ratio = 2.5 if layout.fused_attention else 2
    per_step_backward = backward_ratio * rank_flops / cluster.attention_flops(kernel, backward=True) / cp
    forward = (cp - 1) * max(0.0, transfer - per_step)
    backward_transfer = 2 * latency + (1 + FP32_GRADIENT_HOPS) * step_bytes / bandwidth  # K, V; dK, dV in fp32
    backward = (cp - 1) * max(0.0, backward_transfer - per_step_backward)
    return forward * (2 if layout.recompute == "full" else 1) + backward


def all_to_all_seconds(model: Model, cluster: Cluster, layout: Layout, layer_compute_s: float = 0.0) -> float:
    """Per MoE layer and micro-batch, forward and backward, the all-to-all time that shows: the dispatch and the
    combine, each tokens x k x h 16-bit values from every rank, (ep-1)/ep of them to other ranks (ep - 1 messages
    each), forward and again backward: 4 all-to-alls (6 with full recomputation). tokens: the rank's s/cp x b.
    layout.ep_overlap (model.EP_OVERLAP) says what hides them: "none", every one exposed (a plain 1F1B schedule: the
    experts wait for their tokens); "compute", another micro-batch's compute of the same layer, layer_compute_s,
    runs meanwhile and only the excess shows (DeepSeek-V3's DualPipe overlaps each chunk's all-to-alls with
    another's computation, section 3.2.1 of its report; Megatron-Core offers a like overlap for 1F1B)."""
    ep = layout.ep
    if ep == 1 or model.experts == 1:
        return 0.0
    tokens = model.seq_len // layout.cp * layout.micro_batch
    bandwidth, latency = cluster.link(inside_one_node(layout.tp, ep, cluster.gpus_per_node))
    one = (ep - 1) * latency + tokens * model.top_k * model.hidden * 2 * (ep - 1) / ep / bandwidth
    total = (6 if layout.recompute == "full" else 4) * one
    return max(0.0, total - layer_compute_s) if layout.ep_overlap == "compute" else total


def gemm_slowdown(cluster: Cluster, gemms: list[tuple[float, float, float]]) -> float:
    """How much longer the products (m, k, n) take on the roofline (Cluster.gemm_seconds) than their FLOPs at the
    matmul rate: 1 for the large products of a dense layer, more for products of few rows."""
    if not gemms:
        return 1.0
    compute = sum(2 * m * k * n for m, k, n in gemms) / cluster.matmul_flops
    return sum(cluster.gemm_seconds(m, k, n) for m, k, n in gemms) / compute


def layer_gemms(model: Model, layout: Layout) -> tuple[list, list]:
    """The matrix products of one layer's forward on one GPU, as (m, k, n): (dense ones, one expert's). Dense: Q, K
    and V together (kv_fraction), the attention's output, and a dense model's MLP (up, and gate when gated; down), m
    the rank's tokens (sequence parallelism gathers them whole before each product). An expert's up (and gate) and
    down with m its tokens: each of the rank's E / ep experts gets the tokens that every rank of the EP group routes
    to it, s/cp x b x top_k x ep / E of them when the load is even. Widths split over tp."""
    t, h = layout.tp, model.hidden
    ffn, tokens = model.ffn_hidden or 4 * h, model.seq_len // layout.cp * layout.micro_batch
    mlp = lambda m: [(m, h, ffn / t)] * (2 if model.gated_mlp else 1) + [(m, ffn / t, h)]  # noqa: E731
    dense = [(tokens, h, (1 + 2 * model.kv_fraction) * h / t), (tokens, h / t, h)]
    if model.experts == 1:
        return dense + mlp(tokens), []
    return dense, mlp(tokens * model.top_k * layout.ep / model.experts)


@dataclass
class StageWork:
    """One micro-batch on one GPU of a stage: seconds of forward and backward kernels, and hardware FLOPs."""

    forward_s: float
    backward_s: float
    flops: float


def stage_work(model: Model, cluster: Cluster, layout: Layout, stage: int, layers: int) -> StageWork:
    """The kernels of one micro-batch on one GPU of stage `stage` holding `layers` layers: matmul FLOPs at the GPU's
    matmul efficiency (slower for products on the roofline's memory-bound side: gemm_slowdown), memory-bound kernels
    at its HBM bandwidth, and KERNEL_OVERHEAD_S per kernel."""
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    s_local, h, a = model.seq_len // cp, model.hidden, model.heads
    tokens = s_local * b
    dense_per_layer = model.layer_params - model.expert_params / model.layers
    active_experts = model.expert_params / model.layers * model.top_k / model.experts
    matmul = 2 * (dense_per_layer + active_experts) * tokens / t  # forward, one layer, this GPU
    attention = attention_flops(model, layout)[1] * tokens / t
    head = 2 * model.embedding_params * tokens / t if stage == layout.pp - 1 else 0.0
    attention_backward = 2.5 if layout.fused_attention else 2.0
    dense_gemms, expert_gemms = layer_gemms(model, layout)
    layer_matmul_s = (
        2 * dense_per_layer * tokens / t * gemm_slowdown(cluster, dense_gemms)
        + 2 * active_experts * tokens / t * gemm_slowdown(cluster, expert_gemms)
    ) / cluster.matmul_flops  # fmt: skip
    head_s = head / cluster.matmul_flops * gemm_slowdown(cluster, [(tokens, h, model.vocab / t)])
    matmul_s = layers * layer_matmul_s + head_s  # one forward; backward's two products a forward one take twice
    forward = layers * (matmul + attention) + head
    backward = layers * (2 * matmul + attention_backward * attention) + 2 * head
    recomputed = {"none": 0.0, "full": layers * (matmul + attention)}
    recomputed["selective"] = 0.0 if layout.fused_attention else layers * attention
    flops = forward + backward + recomputed[layout.recompute]

    # Memory-bound kernels: norms and residual adds on the tokens this rank holds (split over t by sequence
    # parallelism), the activation function on its ffn / t slice, the unfused scores' softmax and dropout.
    ffn = model.ffn_hidden or 4 * h
    values = NORM_RESIDUAL_VALUES * h / (t if layout.sequence_parallel else 1) + 2 * ffn * model.top_k / t
    values_bytes = 2 * values * tokens
    score_bytes = 0.0 if layout.fused_attention else 2 * SCORE_PASSES * a / t * s_local * model.seq_len * b
    moved_forward = layers * (values_bytes + score_bytes)
    moved_recomputed = {"none": 0.0, "full": moved_forward, "selective": layers * score_bytes}
    if layout.fused_attention:  # the norms and the activation function, again
        moved_recomputed["selective"] = layers * values_bytes / 2

    # The attention's FLOPs at the attention kernel's rates (its forward's, its backward's), the rest at the matmuls'.
    attention_forward = layers * attention
    rebuilt = layout.recompute == "full" or (layout.recompute == "selective" and not layout.fused_attention)
    kernel = attention_kernel(layout)
    attention_rate, attention_backward_rate = cluster.attention_flops(kernel), cluster.attention_flops(kernel, True)
    attention_later_s = (  # the backward, and the forward rebuilt for it
        layers * attention * attention_backward / attention_backward_rate
        + layers * attention * rebuilt / attention_rate
    )
    overhead = layers * KERNELS_PER_LAYER * KERNEL_OVERHEAD_S
    forward_s = (
        matmul_s + attention_forward / attention_rate + moved_forward / cluster.hbm_bandwidth + overhead / 3
    )  # fmt: skip
    backward_s = (
        2 * matmul_s + (layers * layer_matmul_s if layout.recompute == "full" else 0.0)
        + attention_later_s
        + (2 * moved_forward + moved_recomputed[layout.recompute]) / cluster.hbm_bandwidth
        + overhead * (2 / 3 + (1 / 3 if layout.recompute == "full" else 0))
    )  # fmt: skip
    return StageWork(forward_s, backward_s, flops)


def model_flops_per_token(model: Model, whole_attention: bool = False) -> float:
    """The model FLOPs MFU counts, per token: 6N (the active parameters of a MoE model) plus the attention's scores
    and their product with V, 6 L s h for a causal model (the half of the s x s matrix it needs), or 12 L s h counted
    whole (whole_attention=True), as Megatron-LM's papers, PaLM and torchtitan count it."""
    return 6 * model.active_params + (12 if whole_attention else 6) * model.layers * model.seq_len * model.hidden
