"""The layout planner: which (dp, tp, pp, cp, ep, micro-batch, ZeRO stage, recomputation, virtual stages) to run a
model with, on which GPUs.

    python -m utils.planner --params 70e9 --layers 80 --hidden 8192 --heads 64 --vocab 128256 --seq-len 4096 \\
        --global-batch 1024 --gpus 64 --gpu H100 --top 10
    python -m utils.planner ... --seq-len 131072 --cp 1,2,4,8          # long sequences: context parallelism
    python -m utils.planner ... --experts 8 --top-k 2 --ep 1,2,4,8     # mixture of experts: expert parallelism

    from utils.planner import Model, Cluster, Layout, predict, plan

It enumerates every layout that divides the work, predicts each one's memory per GPU and step time with the
physics below, refuses those that cannot run (with the reason) and ranks the rest by predicted tokens/s. When none
runs, it names the reasons that refused the most layouts and a change that would admit one, and exits with 1.

The physics (s sequence, b micro-batch, h width, a heads, L layers, V vocabulary, N parameters, t = tp, p = pp,
v virtual stages, m micro-batches per step per replica):

Compute. Model FLOPs per token (what MFU counts): 6N + 6 L s h, the second term the attention scores and their
product with V over the causal half of the s x s matrix (Megatron-LM's papers, PaLM and torchtitan count it whole,
12 L s h: model_flops_per_token(whole_attention=True)). The FLOPs the GPUs execute (hardware FLOPs) differ:
- a fused attention kernel (FlashAttention, PyTorch's scaled_dot_product_attention) skips the masked half of a
  causal score matrix, and its backward recomputes the scores (10 s h a token against the forward's 4 s h);
  an unfused one (Megatron-LM 2021-22, the course's from-scratch ring attention) computes the whole matrix;
- recomputation adds the forward FLOPs of what it rebuilds: full, every layer's forward (2 x its parameters + the
  attention); selective, unfused, the attention core (Korthikanti et al. 2022); selective, fused, the norms and the
  MLP's activation function, which have no matmul FLOPs (the scores were never stored).
Time of one micro-batch on a stage = its matmul FLOPs / (peak x the GPU's matmul efficiency) + its attention FLOPs
at a fused kernel's slower rate (attention_speed) + the bytes its memory-bound kernels move / HBM bandwidth (norms,
residual adds, the activation function; the scores' softmax when unfused) + a fixed cost per kernel (launch, tail).
The per-kernel cost and the matmuls' share make small micro-batches less efficient; nothing is an assumed MFU.

Memory per GPU, on the stage that needs the most:
- model state: utils/memory.py's ZeRO rule for the stage's parameters over the dp x cp ranks that hold the same
  weights (experts: over dp x cp / ep). The first stage also holds the embedding (V h), the last the head (V h);
  the layers share the rest of N. Everything a GPU holds is split over tp.
- "mixed" precision keeps 16-bit gradients (2 bytes a parameter; FSDP2 with an fp32 reduce_dtype accumulates fp32
  ones under a pipeline, 4 bytes: count that run as precision "fp32" gradients).
- ZeRO under gradient accumulation, as torch runs it: with pp > 1 torch's pipelining defers the gradient
  reduce-scatter to the last micro-batch, so full gradients are held across micro-batches, and torchtitan keeps the
  parameters gathered (reshard_after_forward = not pp): ZeRO-2/3 would hold what ZeRO-1 holds, so the planner
  refuses them with that reason (DeepSpeed refuses them too); FSDP under a pipeline is ZeRO-1 here. With pp = 1 FSDP2
  reduce-scatters every micro-batch (ZeRO-2/3) and ZeRO-3 gathers every block twice a micro-batch: m times the
  traffic of one, each micro-batch's collectives overlapping its own compute.
- activations, Korthikanti et al. 2022 (arXiv:2205.05198) Table 2 per layer (activation_bytes_per_layer) times the
  layers a stage holds times the micro-batches in flight on it: p - k on stage k under 1F1B, and with v virtual
  stages 2(p-k-1) + (v-1)p + 1 chunks of L_k / v layers (Megatron-LM's warm-up; the first stage holds
  L (1 + (p-1)/(p v)) layers' worth); full recomputation rebuilds one layer's activations during backward.
- buffers: ZeRO-3's gathered parameters and their unsharded gradients (the block in use and the prefetched one),
  ZeRO-2's bucket of one layer's gradients.
- a reserve the planner never fills: RESERVE_FIXED for the CUDA context, NCCL's buffers and workspaces, and
  RESERVE_FRACTION of the memory for the caching allocator's fragmentation.

Communication, each collective with lesson 01's alpha-beta ring model on the link its group uses (NVLink inside a
node, the NIC across), ranks ordered tp, cp, dp, pp innermost first (Megatron-LM's order):
- TP: per layer and micro-batch 2 all-reduces forward and 2 backward (2 more when recomputation replays the
  forward: full, and torch's selective policy, which keeps the matmuls' outputs but replays the collectives), each
  of s/cp x b x h 16-bit values; sequence parallelism swaps each for a reduce-scatter and an all-gather of the
  same volume. Counted as exposed (asynchronous TP, which overlaps them with the matmuls on GPUs,
  is not modelled).
- CP (ring attention): per layer and micro-batch cp - 1 ring steps, each sending a K and a V chunk (2 s/cp b h / t
  values, kv_heads / heads of that with grouped-query attention) while the attention of the chunk in hand runs;
  only the excess shows. Backward sends K, V and their gradients (twice the bytes) against 2.5 times the forward's
  attention. The per-step compute grows as (s/cp)^2 h, the transfer as (s/cp) h: long chunks hide the ring.
- EP: per MoE layer and micro-batch, a dispatch and a combine all-to-all forward and backward, each tokens x k x h
  16-bit values, (ep-1)/ep of them to other ranks; nothing hides them.
- PP: one send of the boundary activation per micro-batch and chunk boundary, forward and backward; the steady
  state's sends overlap the next micro-batch's compute, the fill and drain's (2 (p v - 1) of them) do not. The
  bubble: (p-1) / (v m) of the busiest stage's work.
- DP: the stage's gradients over the dp x cp ranks that hold the same weights: an all-reduce (ZeRO-0), or a
  reduce-scatter and an all-gather of the updated parameters (ZeRO-1/2), plus ZeRO-3's parameter all-gathers, one
  collective per block (FSDP2's unit), each paying the ring's n - 1 latencies. The final reduction hides behind the
  last micro-batch's backward, the parameter all-gather behind the next step's first forward; what exceeds them
  shows.

What it leaves out: NCCL's tree and PAT algorithms, whose latency grows as log n instead of the ring's n - 1 (the
planner overcharges very large flat groups), asynchronous TP, the MoE capacity factor and load imbalance (tokens spread
evenly over the experts), the optimizer step's own time, data loading, stragglers and network contention.
"""

import argparse
import itertools
import math
import sys
from dataclasses import dataclass, field, replace

from utils.memory import OPTIMIZER_STATE, PRECISIONS, bytes_per_param, human, model_state_bytes

RECOMPUTE = ("none", "selective", "full")
FRAMEWORKS = (
    "torch",
    "megatron",
)  # whose sequence parallelism and selective recomputation (activation_bytes_per_layer)

# Memory the planner never fills: the CUDA context, NCCL's buffers and cuBLAS/attention workspaces (a fixed amount),
# and the caching allocator's fragmentation (a share of the GPU). PyTorch's allocator commonly loses 5-10 % to it.
RESERVE_FIXED = 3e9
RESERVE_FRACTION = 0.05

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


@dataclass(frozen=True)
class Model:
    params: float  # parameters in the whole model
    layers: int  # transformer blocks
    hidden: int  # width h
    heads: int  # attention heads a
    vocab: int  # vocabulary size v
    seq_len: int  # tokens per sequence s
    experts: int = 1  # experts per MoE layer (1: a dense model; with more, every layer's MLP is a MoE layer)
    top_k: int = 1  # experts each token is routed to
    ffn_hidden: int | None = None  # an expert's (or the MLP's) hidden width; None: 4 x hidden
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: as many as heads
    gated_mlp: bool = False  # a gated MLP (SwiGLU: gate, up and down matrices) instead of up and down

    @property
    def ffn_ratio(self) -> float:
        """The MLP's (or an expert's) hidden width against the model's: 4 unless ffn_hidden says otherwise."""
        return (self.ffn_hidden or 4 * self.hidden) / self.hidden

    @property
    def kv_fraction(self) -> float:
        """How wide K and V are against Q: kv_heads / heads (1 without grouped-query attention)."""
        return (self.kv_heads or self.heads) / self.heads

    @property
    def expert_params(self) -> float:
        """Parameters of the experts, all layers together: up and down projections of ffn_hidden x hidden each (0 for
        a dense model, whose MLP is counted with the rest). The rest of params is dense: every token uses it."""
        if self.experts == 1:
            return 0.0
        matrices = 3 if self.gated_mlp else 2
        return self.layers * self.experts * matrices * self.hidden * (self.ffn_hidden or 4 * self.hidden)

    @property
    def active_params(self) -> float:
        """The parameters one token goes through: the dense ones and top_k of each layer's experts."""
        return self.params - self.expert_params * (1 - self.top_k / self.experts)

    @property
    def embedding_params(self) -> float:
        """The token embedding's (and, on the last stage, the head's) parameters: V x h."""
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> float:
        """One block's parameters (experts included): what the embedding and the head leave of N, shared evenly."""
        return max(0.0, self.params - 2 * self.embedding_params) / self.layers


# GPU presets: dense bf16 peak, HBM bandwidth, NVLink bandwidth per GPU each way, NIC bandwidth per GPU each way,
# from NVIDIA's A100 datasheet (2021), H100 datasheet (2023) and H200 product brief (2024); the H800 is the H100 with
# NVLink cut to 400 GB/s in all (Zhao et al., "Insights into DeepSeek-V3", ISCA 2025, arXiv:2505.09343, section 4.1).
# Latencies: the order NCCL shows
# per ring step.
# MATMUL_EFFICIENCY, the share of peak the matmuls reach inside a real training loop, is the planner's one fitted
# number: fitted once, to Narayanan et al. 2021's Table 1 (ten GPT runs of Megatron-LM from 1.7B to 1T parameters on
# A100s, the widest range of sizes one software ran: the geometric mean of predicted over published TFLOP/s is 1), and
# used for every GPU and every other published run, which it then predicts (utils/published_runs.py). cuBLAS alone
# reaches more on large shapes (about 80 % of an A100's peak); the difference is what the planner does not model:
# the optimizer step, data loading, launch gaps, clocks under power limits.
MATMUL_EFFICIENCY = 0.6
# A fused attention kernel runs its FLOPs slower than a large matmul: FlashAttention-2 reaches 50-73 % of an A100's
# peak forward and less backward (Dao 2023, arXiv:2307.08691), and only about 35 % of an H100's (Shah et al. 2024,
# FlashAttention-3, arXiv:2407.08608), where cuBLAS reaches about 80 % and 75 %. attention_speed is that ratio: the
# fused kernel's FLOP rate as a share of the matmuls'. An unfused attention runs as batched matmuls, at their rate.
HARDWARE = {
    "A100": dict(
        name="A100 SXM 80GB", memory=80e9, peak_flops=312e12, hbm_bandwidth=2.0e12, intra_bandwidth=300e9,
        inter_bandwidth=25e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speed=0.75,
    ),  # NVLink 3: 600 GB/s in all; one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100, Selene)
    "H100": dict(
        name="H100 SXM 80GB", memory=80e9, peak_flops=989e12, hbm_bandwidth=3.35e12, intra_bandwidth=450e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speed=0.47,
    ),  # NVLink 4: 900 GB/s in all; one 400 Gb/s NDR InfiniBand (or RoCE) NIC per GPU
    "H200": dict(
        name="H200 SXM 141GB", memory=141e9, peak_flops=989e12, hbm_bandwidth=4.8e12, intra_bandwidth=450e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speed=0.47,
    ),  # the H100's compute and links, more and faster memory
    "H800": dict(
        name="H800 SXM 80GB", memory=80e9, peak_flops=989e12, hbm_bandwidth=3.35e12, intra_bandwidth=200e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speed=0.47,
    ),  # NVLink 400 GB/s in all; 400 Gb/s InfiniBand per GPU
}  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """GPUs, nodes and links. The defaults describe H100 SXM nodes (HARDWARE["H100"]); Cluster.of("A100", gpus) takes
    another preset."""

    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9  # bytes per GPU
    peak_flops: float = 989e12  # dense bf16 FLOP/s per GPU
    intra_bandwidth: float = 450e9  # bytes/s per GPU inside a node, each way
    inter_bandwidth: float = 50e9  # bytes/s per GPU between nodes, each way
    intra_latency: float = 5e-6  # seconds per message inside a node
    inter_latency: float = 10e-6  # seconds per message between nodes
    matmul_efficiency: float = MATMUL_EFFICIENCY  # share of peak the matmuls reach in a training loop
    hbm_bandwidth: float = 3.35e12  # bytes/s of the GPU's own memory
    attention_speed: float = 0.47  # a fused attention kernel's FLOP rate as a share of the matmuls'
    name: str = "H100 SXM 80GB"

    @classmethod
    def of(cls, gpu: str, gpus: int, gpus_per_node: int = 8, **overrides) -> "Cluster":
        if gpu not in HARDWARE:
            raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(HARDWARE)}")
        return cls(gpus, gpus_per_node, **{**HARDWARE[gpu], **overrides})

    @property
    def usable_memory(self) -> float:
        """What a layout may fill: the memory less the reserve (RESERVE_FIXED, RESERVE_FRACTION)."""
        return self.memory * (1 - RESERVE_FRACTION) - RESERVE_FIXED

    @property
    def matmul_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def attention_flops(self, fused: bool) -> float:
        """FLOP/s of the attention's scores and their product with V: a fused kernel's, or batched matmuls'."""
        return self.matmul_flops * (self.attention_speed if fused else 1.0)

    def link(self, inside_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the link a group uses: the slow one as soon as it leaves a node."""
        if inside_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch: int  # sequences per micro-batch (b)
    microbatches: int  # micro-batches per step per data-parallel replica (m)
    zero: int = 1  # ZeRO stage 0-3 over the dp group
    recompute: str = "selective"  # none, selective or full activation recomputation
    sequence_parallel: bool = True  # Megatron sequence parallelism inside the TP group (no effect at tp=1)
    cp: int = 1  # context parallelism: ranks that split each sequence
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's experts, inside dp x cp
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank (1: plain 1F1B)
    fused_attention: bool = True  # a fused attention kernel (no stored scores); False: the s x s scores are kept
    framework: str = "torch"  # whose sequence parallelism and selective recomputation: torch or megatron

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self):
        extra = "".join(f" {name}={size}" for name, size in (("cp", self.cp), ("ep", self.ep)) if size > 1)
        extra += f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} mb={self.micro_batch} m={self.microbatches} "
            f"zero={self.zero} recompute={self.recompute}"
        )


@dataclass
class Prediction:
    layout: Layout
    reason: str | None = None  # why the layout cannot run; None when it can
    model_state: dict = field(default_factory=dict)  # bytes of params, grads, optimizer on the stage that needs most
    activations: float = 0.0  # bytes of activations on that stage at its peak
    buffers: float = 0.0  # gathered parameters and gradient buckets (ZeRO-2/3) on that stage
    stage: int = 0  # the stage whose memory is reported (the one that needs the most)
    stage_layers: tuple = ()  # layers per pipeline stage
    compute_s: float = 0.0  # the busiest stage's kernels over the step: matmuls, memory-bound kernels, launches
    tp_s: float = 0.0  # tensor-parallel collectives (not overlapped)
    cp_s: float = 0.0  # the ring's K/V traffic that the attention does not hide
    ep_s: float = 0.0  # MoE all-to-alls (not overlapped)
    pp_s: float = 0.0  # pipeline sends of the fill and drain (the steady state's overlap)
    bubble_s: float = 0.0  # pipeline fill and drain: idle time
    dp_s: float = 0.0  # data-parallel gradient (and ZeRO parameter) traffic
    dp_exposed_s: float = 0.0  # the part of dp_s that compute does not hide
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    model_flops: float = 0.0  # one step, the whole job: (6N + 6 L s h) per token (model_flops_per_token)
    hardware_flops: float = 0.0  # one step, the whole job: what the GPUs execute (recomputation included)
    mfu: float = 0.0  # model FLOPs per second / (GPUs x peak)
    hfu: float = 0.0  # hardware FLOPs per second / (GPUs x peak)
    tflops_per_gpu: float = 0.0  # hardware TFLOP/s per GPU, as Narayanan et al. 2021 report it

    @property
    def memory(self) -> float:
        return sum(self.model_state.values()) + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.reason is None


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    value_bytes: int = 2,
    dropout: bool = True,
    top_k: int = 1,
    fused_attention: bool = False,
    kv_fraction: float = 1.0,
    framework: str = "megatron",
    ffn_ratio: float = 4.0,
    gated_mlp: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, 16-bit activations and 1-byte dropout masks.

    Korthikanti et al. 2022, Table 2 (s sequence, b micro-batch, h width, a heads, t tensor-parallel size), the
    scores kept (unfused attention, fused_attention=False):
      no parallelism                      sbh (34 + 5as/h)
      tensor parallel                     sbh (10 + 24/t + 5as/(ht))
      tensor + sequence parallel          sbh (34/t + 5as/(ht))
      selective recomputation             drops the 5as/(ht) term (attention scores, softmax, its dropout)
      full recomputation                  2sbh: only the layer's input (split over t by sequence parallelism)
    The 10 are the layer norms' and dropouts' tensors, which tensor parallelism alone leaves whole on every rank.
    Section 4.1's sum behind them, in values of s x b x h: 4 that TP leaves whole (the two norms' inputs, the
    inputs of QKV and of the MLP, which are the norms' outputs), 12 that it splits (Q, K, V, the attention output,
    the MLP's up output and its GELU output), and two 1-byte dropout masks; the scores are a x s x s x b values
    (the softmax output, and with dropout its mask and output).

    A fused attention kernel (FlashAttention, PyTorch's scaled_dot_product_attention) keeps no scores at all
    (its fp32 log-sum-exp, a x s x b values, is in omitted_activation_bytes): "none" is the table without the
    score term, and "selective" recomputes what is cheap to rebuild instead, the norms and the MLP's activation
    function. How, depends on the framework (utils/measure_at_scale.py measures torch's, to the byte):
    - "megatron" (the paper's): sequence parallelism keeps each column-parallel matmul's input sharded and
      all-gathers it again in backward (the /t above); selective (Megatron-Core's --recompute-modules layernorm
      and the activation function) keeps 2 values that sequence parallelism splits (the norms' inputs) and 8 that
      TP splits (Q, K, V, the attention output, the up projection's output).
    - "torch" (the course: DTensor's SequenceParallel, and a selective-checkpoint policy that keeps every matmul's
      output, utils/measure_at_scale.keep_matmuls): a column-parallel matmul saves the input it all-gathered, so the
      two norms' outputs stay whole under sequence parallelism; selective keeps the layer's input (split by
      sequence parallelism), the output and down projections' outputs (partial sums before their all-reduce or
      reduce-scatter: whole) and the same 8 split values, and replays the norms, the activation function, the
      residual adds and the collectives.
    value_bytes and dropout restate them for another model: 4 for fp32 (the course's CPU runs), dropout=False for
    the course model (it has none). A MoE layer runs each token through top_k experts: the MLP's input
    (dispatched) and its up and GELU outputs count top_k times (1 of the 4 whole values, 8 of the 12 split ones).
    Grouped-query attention keeps K and V kv_fraction as wide as Q (kv_heads / heads); an MLP ffn_ratio x h wide
    (the table's 4) keeps its up output and its activation's output at that width, a gated one (SwiGLU) its gate's
    output too.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, not {framework!r}")
    sbh = s * b * h
    split_by_sp = t if sequence_parallel else 1
    if recompute == "full":
        return value_bytes * sbh / split_by_sp
    masks = 2 if dropout else 0
    up_outputs = (2 if gated_mlp else 1) * ffn_ratio * top_k  # the up projection's output (and the gate's)
    matmul_outputs = 2 + 2 * kv_fraction + up_outputs  # Q, K, V, the attention output, the up (and gate) output
    if fused_attention and recompute == "selective":  # the norms and the activation function recomputed
        if framework == "torch":  # the input, and the output and down projections' partial sums, kept
            return sbh * value_bytes * (1 / split_by_sp + 1 + top_k + matmul_outputs / t)
        return sbh * ((2 * value_bytes + masks) / split_by_sp + matmul_outputs * value_bytes / t)
    kept_scores = not fused_attention and recompute == "none"
    scores = a * s * s * b * (value_bytes * (1 + dropout) + dropout) / t if kept_scores else 0
    split = matmul_outputs + ffn_ratio * top_k  # and the activation function's output
    norm_outputs = (1 + top_k) * value_bytes / (1 if framework == "torch" else split_by_sp)  # QKV's and the MLP's input
    return sbh * ((2 * value_bytes + masks) / split_by_sp + norm_outputs + split * value_bytes / t) + scores


def layers_of_stage(layers: int, pp: int, stage: int) -> int:
    """Blocks of pipeline stage `stage` in the course's own cut: the first layers % pp stages get one more (lesson
    05's partition). The planner's predictions cut as planned_stage_layers does."""
    return layers // pp + (stage < layers % pp)


def planned_stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage as large runs cut them: equal where they divide; otherwise every stage takes ceil(L/p) and
    the stages with the most else to hold give one back, the last (the head and the loss) and the first (the
    embedding and the most micro-batches in flight) first, then inwards. Llama 3 405B: 126 layers over 16 stages,
    7 + 14 x 8 + 7."""
    if pp > layers:
        raise ValueError(f"{pp} stages for {layers} layers: a stage would be empty")
    counts = [math.ceil(layers / pp)] * pp
    order = [i for pair in zip(range(pp - 1, -1, -1), range(pp)) for i in pair]  # last, first, last-1, second...
    for stage in itertools.islice(itertools.cycle(dict.fromkeys(order)), sum(counts) - layers):
        counts[stage] -= 1
    return tuple(counts)


def stage_activation_bytes(
    model: Model,
    layout: Layout,
    stage: int = 0,
    value_bytes: int = 2,
    dropout: bool = True,
    vocab_parallel=True,
    layers: int | None = None,
) -> float:
    """One micro-batch's activations on pipeline stage `stage`, in bytes: its layers (Table 2; `layers` of them,
    default lesson 05's cut) and section 4.3's extras, the embedding's dropout mask (sbh/t, 1 byte) on the first
    stage and, on the last, the final norm's and the head's inputs (2 values of sbh, split by sequence parallelism)
    and the loss's fp32 log-probabilities (4sbv, split over t when the head is vocab-parallel as in Megatron; the
    course's head is whole: False). Context parallelism: each rank holds s / cp of every sequence, so every term is
    / cp (ring attention keeps no other chunk's keys and values: its backward passes them around the ring again)."""
    s, b, h, t, p = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp, layout.pp
    split_by_sp = t if layout.sequence_parallel else 1
    per_layer = activation_bytes_per_layer(
        s, b, h, model.heads, t, layout.sequence_parallel, layout.recompute, value_bytes, dropout, model.top_k,
        layout.fused_attention, model.kv_fraction, layout.framework, model.ffn_ratio, model.gated_mlp,
    )  # fmt: skip
    held = per_layer * (layers_of_stage(model.layers, p, stage) if layers is None else layers)
    if stage == 0 and dropout:
        held += s * b * h / split_by_sp
    if stage == p - 1:
        held += 2 * value_bytes * s * b * h / split_by_sp + 4 * s * b * model.vocab / (t if vocab_parallel else 1)
    return held


def omitted_activation_bytes(
    model: Model, layout: Layout, stage: int = 0, fused_attention: bool | None = None, layers: int | None = None
) -> float:
    """What Table 2 and section 4.3 leave out, in bytes for one micro-batch on stage `stage`, from what PyTorch's
    backward formulas save: each LayerNorm's fp32 mean and 1/std per token (two per layer, one more on the last
    stage; none for a recomputed norm), a fused attention's fp32 log-sum-exp per head and token, the int64 token
    ids on the first stage (the embedding's backward) and its int64 positions (one sequence), and on the last stage
    the int64 targets and the loss's fp32 normaliser (the NLL's total weight, one value). fused_attention: default
    the layout's."""
    fused = layout.fused_attention if fused_attention is None else fused_attention
    s, b, t, p = model.seq_len // layout.cp, layout.micro_batch, layout.tp, layout.pp
    tokens_here = s * b / (t if layout.sequence_parallel else 1)
    layers = layers_of_stage(model.layers, p, stage) if layers is None else layers
    kept_norms = 0 if layout.recompute == "full" or (fused and layout.recompute == "selective") else 2
    held = (kept_norms * layers + (stage == p - 1)) * 2 * 4 * tokens_here
    if fused and layout.recompute != "full":
        held += layers * 4 * model.heads / t * s * b
    if stage == 0:
        held += 8 * s * b + 8 * s
    if stage == p - 1:
        held += 8 * s * b + 4
    return held


def in_flight(layout: Layout, stage: int) -> tuple[float, int]:
    """(layers' worth of activations per stage layer, micro-batches) held at once on stage `stage` at its peak.
    1F1B: p - stage micro-batches; interleaved with v chunks per rank, Megatron-LM's warm-up keeps 2(p-k-1) + (v-1)p + 1
    chunks, each 1/v of the stage's layers. Never more than the step's m micro-batches."""
    p, v, m = layout.pp, layout.virtual_stages, layout.microbatches
    if v == 1:
        held = min(m, p - stage)
        return held, held
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v, min(m, math.ceil(chunks / v))


def activation_bytes(model: Model, layout: Layout, stage: int = 0, layers: int | None = None) -> float:
    """Activations on pipeline stage `stage` at its peak, in bytes (16-bit values, dropout as the paper has it,
    the log-sum-exp of a fused kernel): the micro-batches in flight (in_flight), and with full recomputation one
    layer's activations rebuilt during backward."""
    s, b, h, t = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp
    layers = planned_stage_layers(model.layers, layout.pp)[stage] if layers is None else layers
    worth, microbatches = in_flight(layout, stage)
    extras = stage_activation_bytes(model, layout, stage, layers=0)  # the embedding's, the head's and the loss's
    lse = layers * 4 * model.heads / t * s * b if layout.fused_attention and layout.recompute != "full" else 0
    layer_part = stage_activation_bytes(model, layout, stage, layers=layers) - extras + lse
    held = layer_part * worth + extras * microbatches
    if layout.recompute == "full":
        held += activation_bytes_per_layer(
            s, b, h, model.heads, t, layout.sequence_parallel, "none", top_k=model.top_k,
            fused_attention=layout.fused_attention, kv_fraction=model.kv_fraction, framework=layout.framework,
            ffn_ratio=model.ffn_ratio, gated_mlp=model.gated_mlp,
        )  # fmt: skip
    return held


def stage_params(model: Model, layout: Layout, stage: int, layers: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of stage `stage` holds before ZeRO: its layers' share, the embedding on the
    first stage and the head on the last, all split over tp; experts also over ep."""
    expert_per_layer = model.expert_params / model.layers
    dense = layers * (model.layer_params - expert_per_layer)
    dense += model.embedding_params * ((stage == 0) + (stage == layout.pp - 1))
    return dense / layout.tp, layers * expert_per_layer / (layout.tp * layout.ep)


def stage_model_state(model: Model, layout: Layout, precision: str = "mixed", optimizer: str = "adam", stage=None):
    """utils/memory.py's ZeRO rule for one GPU's parameters: the dense ones sharded over the dp x cp ranks that hold
    the same weights, the experts split over ep and sharded over the dp x cp / ep ranks that hold the same experts.
    stage None: the model spread evenly, params / (tp x pp) (a dense model: the first term only); a stage number:
    that stage's own layers (planned_stage_layers), with the embedding or the head."""
    tp, pp = layout.tp, layout.pp
    if stage is None:
        dense, experts = (model.params - model.expert_params) / (tp * pp), model.expert_params / (tp * pp * layout.ep)
    else:
        dense, experts = stage_params(model, layout, stage, planned_stage_layers(model.layers, pp)[stage])
    state = model_state_bytes(dense, layout.dp * layout.cp, layout.zero, precision, optimizer)
    if model.expert_params:
        shared = model_state_bytes(experts, layout.dp * layout.cp // layout.ep, layout.zero, precision, optimizer)
        state = {kind: state[kind] + shared[kind] for kind in state}
    return state


def rank_parameter_shapes(model: Model, tp: int, pp: int, stage: int) -> list[tuple[int, ...]]:
    """The shapes of the parameters one rank of pipeline stage `stage` holds, for the course's model (utils/model.py:
    learned token and position embeddings, pre-norm blocks with biased q/k/v/o and up/down projections, a final norm,
    an untied biased head) cut as lessons 04 and 05 cut it. Unlike stage_model_state's even split, each stage holds
    its own blocks (lesson 05's partition: the first layers % pp stages one more), the embeddings sit on the first
    stage and the final norm and the head on the last; tensor parallelism splits q/k/v/up by rows (weight and bias,
    column-parallel) and o/down by columns (weight only: a row-parallel bias is added once, after the all-reduce),
    and leaves the norms, the embeddings and the head whole on every TP rank. model.params is not used."""
    h, ffn, v = model.hidden, model.ffn_hidden or 4 * model.hidden, model.vocab
    norm = [(h,), (h,)]  # LayerNorm: weight and bias
    block = [
        *norm,
        *[(h // tp, h), (h // tp,)] * 3,  # q, k, v: column-parallel
        (h, h // tp), (h,),  # o: row-parallel
        *norm,
        (ffn // tp, h), (ffn // tp,),  # up: column-parallel
        (h, ffn // tp), (h,),  # down: row-parallel
    ]  # fmt: skip
    shapes = [(v, h), (model.seq_len, h)] if stage == 0 else []
    shapes += block * layers_of_stage(model.layers, pp, stage)
    if stage == pp - 1:
        shapes += [*norm, (v, h), (v,)]
    return shapes


def rank_model_state(model: Model, layout: Layout, stage: int, precision: str = "fp32", optimizer: str = "sgd"):
    """utils/memory.py's ZeRO rule for the parameters one rank of stage `stage` holds (rank_parameter_shapes), over
    its dp group, at rest (between steps). Sharded state is padded as FSDP2 pads it: each tensor's first dimension
    to a multiple of dp. The bytes each rank of lesson 06's runs holds, exactly: ZeRO-0 from scratch, ZeRO-3 built
    in (FSDP2); at real size, the bytes of the rank with the largest shards (utils/measure_at_scale.py: FSDP2 keeps
    every rank's parameters and gradients in padded buffers, but torch allocates an optimizer's moments like the
    unpadded local shard, so a last rank whose rows run out holds less optimizer state)."""
    shapes = rank_parameter_shapes(model, layout.tp, layout.pp, stage)
    count = sum(math.prod(shape) for shape in shapes)
    padded = sum(-(-shape[0] // layout.dp) * layout.dp * math.prod(shape[1:]) for shape in shapes)
    return model_state_bytes(count, layout.dp, layout.zero, precision, optimizer, padded)


# --------------------------------------------------------------------------------------------------
# Time: lesson 01's alpha-beta model, t = messages x alpha + bytes on the busiest link / bandwidth
# --------------------------------------------------------------------------------------------------


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


def inside_one_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks spaced `stride` apart stays inside a node (ranks fill nodes in order).
    The rank grid puts TP innermost (stride 1), then CP, DP, then PP."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0


def attention_flops(model: Model, layout: Layout) -> tuple[float, float]:
    """(model, hardware) FLOPs of the attention scores and their product with V, forward, per token and layer on the
    whole model width: model FLOPs count the whole s x s matrix (4 s h), a fused kernel skips the causal half."""
    whole = 4 * model.seq_len * model.hidden
    return whole, whole / 2 if layout.fused_attention else whole


def ring_attention_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """Per layer and micro-batch, forward and backward, the part of ring attention's K/V traffic that the attention
    does not hide. Each of the cp - 1 ring steps sends a K and a V chunk, 2 x s/cp x b x h / t 16-bit values (1/t:
    the heads are split over tp), while the attention of the chunk in hand runs (1/cp of the rank's attention, a
    zigzag split balancing the causal triangle over the ranks); backward sends K, V and their gradients, twice the
    bytes, against 2.5 times the forward's attention (a fused kernel's backward; 2 times unfused). Full
    recomputation runs the forward ring again."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    s, b = model.seq_len, layout.micro_batch
    bandwidth, latency = cluster.link(inside_one_node(t, cp, cluster.gpus_per_node))
    step_bytes = 2 * 2 * s / cp * b * model.hidden * model.kv_fraction / t  # K and V chunks, 16-bit
    transfer = latency + step_bytes / bandwidth
    rank_attention = (
        attention_flops(model, layout)[1] * (s / cp) * b / t / cluster.attention_flops(layout.fused_attention)
    )
    per_step = rank_attention / cp
    backward_ratio = 2.5 if layout.fused_attention else 2
    forward = (cp - 1) * max(0.0, transfer - per_step)
    backward = (cp - 1) * max(0.0, 2 * transfer - backward_ratio * per_step)
    return forward * (2 if layout.recompute == "full" else 1) + backward


def all_to_all_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """Per MoE layer and micro-batch, forward and backward: the dispatch and the combine, each tokens x k x h
    16-bit values from every rank, (ep-1)/ep of them to other ranks (ep - 1 messages each), forward and again
    backward: 4 all-to-alls (6 with full recomputation). tokens: the rank's s/cp x b."""
    ep = layout.ep
    if ep == 1 or model.experts == 1:
        return 0.0
    tokens = model.seq_len // layout.cp * layout.micro_batch
    bandwidth, latency = cluster.link(inside_one_node(layout.tp, ep, cluster.gpus_per_node))
    one = (ep - 1) * latency + tokens * model.top_k * model.hidden * 2 * (ep - 1) / ep / bandwidth
    return (6 if layout.recompute == "full" else 4) * one


@dataclass
class StageWork:
    """One micro-batch on one GPU of a stage: seconds of forward and backward kernels, and hardware FLOPs."""

    forward_s: float
    backward_s: float
    flops: float


def stage_work(model: Model, cluster: Cluster, layout: Layout, stage: int, layers: int) -> StageWork:
    """The kernels of one micro-batch on one GPU of stage `stage` holding `layers` layers: matmul FLOPs at the GPU's
    matmul efficiency, memory-bound kernels at its HBM bandwidth, and KERNEL_OVERHEAD_S per kernel."""
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    s_local, h, a = model.seq_len // cp, model.hidden, model.heads
    tokens = s_local * b
    dense_per_layer = model.layer_params - model.expert_params / model.layers
    active_experts = model.expert_params / model.layers * model.top_k / model.experts
    matmul = 2 * (dense_per_layer + active_experts) * tokens / t  # forward, one layer, this GPU
    attention = attention_flops(model, layout)[1] * tokens / t
    head = 2 * model.embedding_params * tokens / t if stage == layout.pp - 1 else 0.0
    attention_backward = 2.5 if layout.fused_attention else 2.0
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

    # The attention's FLOPs at the attention kernel's rate, the rest at the matmuls'.
    attention_forward = layers * attention
    rebuilt = layout.recompute == "full" or (layout.recompute == "selective" and not layout.fused_attention)
    attention_later = layers * attention * (attention_backward + rebuilt)  # backward, and the rebuilt forward
    matmul_rate, attention_rate = cluster.matmul_flops, cluster.attention_flops(layout.fused_attention)
    overhead = layers * KERNELS_PER_LAYER * KERNEL_OVERHEAD_S
    forward_s = (
        (forward - attention_forward) / matmul_rate + attention_forward / attention_rate
        + moved_forward / cluster.hbm_bandwidth + overhead / 3
    )  # fmt: skip
    backward_s = (
        (flops - forward - attention_later) / matmul_rate + attention_later / attention_rate
        + (2 * moved_forward + moved_recomputed[layout.recompute]) / cluster.hbm_bandwidth
        + overhead * (2 / 3 + (1 / 3 if layout.recompute == "full" else 0))
    )  # fmt: skip
    return StageWork(forward_s, backward_s, flops)


def model_flops_per_token(model: Model, whole_attention: bool = False) -> float:
    """The model FLOPs MFU counts, per token: 6N (the active parameters of a MoE model) plus the attention's scores
    and their product with V, 6 L s h for a causal model (the half of the s x s matrix it needs), or 12 L s h counted
    whole (whole_attention=True), as Megatron-LM's papers, PaLM and torchtitan count it."""
    return 6 * model.active_params + (12 if whole_attention else 6) * model.layers * model.seq_len * model.hidden


def predict(model: Model, cluster: Cluster, layout: Layout, precision: str = "mixed", optimizer="adam"):
    """Memory and step time of one layout (whether or not it can run: see check_layout)."""
    s, b, h, t, p, m = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.pp, layout.microbatches
    cp, v = layout.cp, layout.virtual_stages
    pred = Prediction(layout)
    pred.stage_layers = planned_stage_layers(model.layers, p)
    replicas = layout.dp * cp  # ranks that hold the same dense weights
    expert_replicas = replicas // layout.ep
    per = bytes_per_param(precision, optimizer)

    # Memory: every stage's model state, buffers and activations; the stage that needs the most is reported.
    def stage_memory(stage):
        layers = pred.stage_layers[stage]
        state = stage_model_state(model, layout, precision, optimizer, stage)
        buffers = 0.0
        one_layer = sum(stage_params(model, layout, stage, 1)) - sum(stage_params(model, layout, stage, 0))
        if layout.zero == 3:  # the block in use and the prefetched one, gathered, and their unsharded gradients
            buffers = 2 * one_layer * (per["params"] + per["grads"])
        elif layout.zero == 2:  # one layer's gradients waiting for their reduce-scatter
            buffers = one_layer * per["grads"]
        return state, activation_bytes(model, layout, stage, layers), buffers

    memories = [stage_memory(stage) for stage in range(p)]
    pred.stage = max(range(p), key=lambda k: sum(memories[k][0].values()) + memories[k][1] + memories[k][2])
    pred.model_state, pred.activations, pred.buffers = memories[pred.stage]

    # Compute, per micro-batch, on every stage; the busiest sets the pace.
    works = [stage_work(model, cluster, layout, stage, pred.stage_layers[stage]) for stage in range(p)]
    busiest = max(range(p), key=lambda k: works[k].forward_s + works[k].backward_s)
    work = works[busiest]
    layers_here = pred.stage_layers[busiest]
    pred.compute_s = m * (work.forward_s + work.backward_s)

    # Tensor parallelism: per layer 2 all-reduces forward, 2 backward (2 more when the forward is recomputed).
    # Recomputation replays the forward's two: full always, torch's selective too (its policy keeps the matmuls'
    # outputs, not the collectives', and the replay runs every operation it did not keep).
    replayed = layout.recompute == "full" or (layout.recompute == "selective" and layout.framework == "torch")
    per_layer = 4 + (2 if replayed else 0)
    tp_link = cluster.link(inside_one_node(1, t, cluster.gpus_per_node))
    pred.tp_s = layers_here * m * per_layer * all_reduce_seconds(2 * s // cp * b * h, t, *tp_link)
    pred.cp_s = layers_here * m * ring_attention_seconds(model, cluster, layout)
    pred.ep_s = layers_here * m * all_to_all_seconds(model, cluster, layout)

    # Pipeline: the bubble is (p-1)/v idle micro-batch slots of the busiest stage's work.
    busy = pred.compute_s + pred.tp_s + pred.cp_s + pred.ep_s
    pred.bubble_s = busy / m * (p - 1) / v
    if p > 1:
        bandwidth, latency = cluster.link(inside_one_node(t * cp * layout.dp, p, cluster.gpus_per_node))
        boundary = 2 * s // cp * b * h / (t if layout.sequence_parallel else 1)
        pred.pp_s = 2 * (p * v - 1) * (latency + boundary / bandwidth)

    # Data parallelism, for the busiest stage's parameters (bytes in the gradients' precision).
    dense, experts = stage_params(model, layout, busiest, layers_here)
    dp_link = cluster.link(inside_one_node(t, replicas, cluster.gpus_per_node))
    expert_link = cluster.link(inside_one_node(t * layout.ep, expert_replicas, cluster.gpus_per_node))

    # One collective per block (FSDP2's unit; Megatron's gradient buckets are of that order), the embedding and the
    # head one each: every one pays the ring's (n - 1) latencies, which grow with the dp group.
    units = layers_here + (busiest == 0) + (busiest == p - 1)

    def gather(nbytes_dense, nbytes_experts):  # all-gathers (or reduce-scatters) of the stage's parameters, per unit
        seconds = units * all_gather_seconds(nbytes_dense / units, replicas, *dp_link)
        if nbytes_experts:
            seconds += layers_here * all_gather_seconds(nbytes_experts / layers_here, expert_replicas, *expert_link)
        return seconds

    one = gather(per["grads"] * dense, per["grads"] * experts)
    first_forward, last_backward = work.forward_s, work.backward_s
    if layout.zero == 0:  # one all-reduce after the last backward
        pred.dp_s = 2 * one
        pred.dp_exposed_s = max(0.0, 2 * one - last_backward)
    elif layout.zero == 1:  # reduce-scatter after the last backward, all-gather before the next forward
        pred.dp_s = 2 * one
        pred.dp_exposed_s = max(0.0, one - last_backward) + max(0.0, one - first_forward)
    elif layout.zero == 2:  # a reduce-scatter every micro-batch, each hidden by its own backward
        pred.dp_s = (m + 1) * one
        pred.dp_exposed_s = m * max(0.0, one - last_backward) + max(0.0, one - first_forward)
    else:  # ZeRO-3: gather before each forward and each backward, reduce-scatter after, every micro-batch
        pred.dp_s = 3 * m * one
        pred.dp_exposed_s = m * (max(0.0, one - first_forward) + max(0.0, 2 * one - last_backward))

    pred.step_s = busy + pred.bubble_s + pred.pp_s + pred.dp_exposed_s
    tokens = layout.dp * m * b * s
    pred.tokens_per_s = tokens / pred.step_s
    pred.model_flops = model_flops_per_token(model) * tokens
    pred.hardware_flops = sum(w.flops for w in works) * t * cp * layout.dp * m
    pred.mfu = pred.model_flops / pred.step_s / (cluster.gpus * cluster.peak_flops)
    pred.hfu = pred.hardware_flops / pred.step_s / (cluster.gpus * cluster.peak_flops)
    pred.tflops_per_gpu = pred.hardware_flops / pred.step_s / cluster.gpus / 1e12
    return pred


# --------------------------------------------------------------------------------------------------
# Which layouts can run, and the ranking
# --------------------------------------------------------------------------------------------------


def check_layout(model: Model, cluster: Cluster, layout: Layout, global_batch: int) -> str | None:
    """Why a layout cannot run on this model and cluster, in a few words; None when its shape is sound."""
    dp, tp, pp, cp, ep, v = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.virtual_stages
    if layout.gpus != cluster.gpus:
        return f"cp x dp x tp x pp is not the GPU count ({layout.gpus} != {cluster.gpus})"
    if model.heads % tp:
        return f"heads not divisible by tp ({model.heads} heads, tp={tp})"
    if not inside_one_node(1, tp, cluster.gpus_per_node):
        return f"TP group crosses a node (tp={tp}, {cluster.gpus_per_node} GPUs per node)"
    if cp > 1 and model.seq_len % (2 * cp):
        return f"sequence not divisible by 2 x cp for a zig-zag split ({model.seq_len} tokens, cp={cp})"
    if layout.sequence_parallel and model.seq_len // cp % tp:
        return f"sequence not divisible by tp for sequence parallelism ({model.seq_len // cp} tokens, tp={tp})"
    if ep > 1 and model.experts == 1:
        return f"EP without experts (ep={ep}: a dense model has no experts to split)"
    if model.experts % ep:
        return f"experts not divisible by ep ({model.experts} experts, ep={ep})"
    if (dp * cp) % ep:
        return f"ep does not divide dp x cp (ep={ep}, dp={dp}, cp={cp}: EP ranks are taken inside dp x cp)"
    if pp * v > model.layers:
        return f"more pipeline chunks than layers ({model.layers} layers, pp={pp} x v={v})"
    if v > 1 and pp == 1:
        return f"virtual stages without a pipeline (v={v}, pp=1)"
    if v > 1 and math.ceil(model.layers / pp) % v:
        return f"stages do not split into v chunks ({math.ceil(model.layers / pp)} layers a stage, v={v})"
    if v > 1 and layout.microbatches % pp:
        return f"interleaving needs micro-batches in multiples of pp (m={layout.microbatches}, pp={pp})"
    if dp * layout.micro_batch * layout.microbatches != global_batch:
        return f"batch does not split ({global_batch} sequences over dp={dp} x micro-batch {layout.micro_batch})"
    if dp * cp == 1 and layout.zero > 0:
        return f"ZeRO shards nothing at dp=1 (ZeRO-{layout.zero} is ZeRO-0)"
    if pp > 1 and layout.zero >= 2:
        return (
            f"ZeRO-{layout.zero} under a pipeline holds what ZeRO-1 holds (pp={pp}: full gradients kept until the "
            "last micro-batch; use ZeRO-1)"
        )
    if layout.recompute not in RECOMPUTE:
        return f"unknown recomputation ({layout.recompute!r}, not one of {RECOMPUTE})"
    if layout.framework not in FRAMEWORKS:
        return f"unknown framework ({layout.framework!r}, not one of {FRAMEWORKS})"
    return None


def evaluate(model: Model, cluster: Cluster, layout: Layout, global_batch: int, **state) -> Prediction:
    """check_layout, then predict; a layout whose shape is sound but whose memory exceeds what the GPU can give
    (its memory less the reserve) is refused."""
    reason = check_layout(model, cluster, layout, global_batch)
    if reason:
        return Prediction(layout, reason)
    pred = predict(model, cluster, layout, **state)
    if pred.memory > cluster.usable_memory:
        pred.reason = (
            f"does not fit ({human(pred.memory)} > {human(cluster.usable_memory)} usable of {human(cluster.memory)})"
        )
    return pred


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    cluster: Cluster,
    global_batch: int,
    micro_batches=(1, 2, 4, 8),
    sequence_parallel=True,
    cps=(1,),
    eps=(1,),
    virtual_stages=(1,),
    software: dict | None = None,
):
    """Every (tp, pp, cp, dp) whose product is the GPU count for each cp of `cps`, with each ep of `eps`, micro-batch
    size, ZeRO stage, recomputation and number of virtual stages (v > 1 only where pp > 1). A cp that does not divide
    the GPUs left by tp x pp is skipped. software: Layout fields every layout gets, e.g. {"framework": "megatron",
    "fused_attention": False}."""
    for tp, pp in itertools.product(divisors(cluster.gpus), repeat=2):
        if cluster.gpus % (tp * pp):
            continue
        for cp in cps:
            if cluster.gpus % (tp * pp * cp):
                continue
            dp = cluster.gpus // (tp * pp * cp)
            vs = sorted({v for v in virtual_stages if v == 1 or pp > 1})
            for ep, b, zero, recompute, v in itertools.product(eps, micro_batches, range(4), RECOMPUTE, vs):
                m = global_batch // (dp * b)  # 0 or a remainder: check_layout says the batch does not split
                yield Layout(dp, tp, pp, b, m, zero, recompute, sequence_parallel, cp, ep, v, **(software or {}))


def plan(
    model,
    cluster,
    global_batch,
    micro_batches=(1, 2, 4, 8),
    sequence_parallel=True,
    cps=(1,),
    eps=(1,),
    virtual_stages=(1,),
    software: dict | None = None,
    **state,
):
    """Every layout evaluated: those that run first, fastest first (the smaller memory first among equals), then
    the refused ones. cps, eps, virtual_stages: the sizes to consider; software: Layout fields for every layout
    (enumerate_layouts). state: precision and optimizer, as utils/memory.py takes them."""
    layouts = enumerate_layouts(
        cluster, global_batch, micro_batches, sequence_parallel, cps, eps, virtual_stages, software
    )
    predictions = [evaluate(model, cluster, layout, global_batch, **state) for layout in layouts]
    return sorted(predictions, key=lambda pred: (not pred.fits, -round(pred.tokens_per_s, 6), pred.memory))


def table(predictions: list[Prediction]) -> str:
    header = (
        f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'v':>2} {'cp':>3} {'ep':>3} {'mb':>3} {'m':>4} {'zero':>4} "
        f"{'recompute':>9} {'state':>8} {'activ.':>8} {'step s':>7} {'bubble':>6} {'comm s':>7} {'tokens/s':>10} "
        f"{'MFU':>5}  reason"
    )
    lines = [header]
    for rank, pred in enumerate(predictions, 1):
        lay = pred.layout
        cells = f"{rank:>3} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.virtual_stages:>2} {lay.cp:>3} {lay.ep:>3} "
        cells += f"{lay.micro_batch:>3} {lay.microbatches:>4} "
        cells += f"{lay.zero:>4} {lay.recompute:>9} "
        if pred.step_s:  # the numbers exist once the layout's shape was sound
            comm = pred.tp_s + pred.cp_s + pred.ep_s + pred.pp_s + pred.dp_exposed_s
            cells += f"{human(sum(pred.model_state.values())):>8} {human(pred.activations):>8} {pred.step_s:>7.2f} "
            cells += f"{pred.bubble_s / pred.step_s:>6.1%} {comm:>7.2f} {pred.tokens_per_s:>10,.0f} {pred.mfu:>5.1%}"
        else:
            cells += f"{'-':>8} {'-':>8} {'-':>7} {'-':>6} {'-':>7} {'-':>10} {'-':>5}"
        lines.append(cells + f"  {pred.reason or 'runs'}")
    return "\n".join(lines)


def reason_kind(reason: str) -> str:
    """A reason's kind: its words before the numbers in brackets."""
    return reason.split(" (")[0]


def rejection_summary(predictions: list[Prediction]) -> str:
    """How many layouts each kind of reason refused."""
    counts = {}
    for pred in predictions:
        if not pred.fits:
            counts[reason_kind(pred.reason)] = counts.get(reason_kind(pred.reason), 0) + 1
    return "\n".join(f"  {n:>5}  {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def round_to(n: int, multiple: int, up: bool) -> int:
    return (math.ceil(n / multiple) if up else n // multiple) * multiple


def what_would_run(model: Model, cluster: Cluster, global_batch: int, predictions: list[Prediction], **options) -> str:
    """When no layout runs: the one change, tried in this order, that admits a layout: the closest GPU memory need
    (the smallest prediction among layouts whose shape was sound), a global batch near the given one, more GPUs
    (whole nodes), a shorter sequence. options: plan's other arguments."""
    sound = [pred for pred in predictions if pred.step_s]
    lines = []
    if sound:
        least = min(sound, key=lambda pred: pred.memory)
        lines.append(
            f"the least memory any layout needs: {human(least.memory)} ({least.layout}), "
            f"{human(cluster.usable_memory)} usable per GPU"
        )
    near = {round_to(global_batch, d, up) for d in (2, 4, 8, 16, 32, 64, cluster.gpus_per_node, cluster.gpus)
            for up in (False, True)} - {0, global_batch}  # fmt: skip
    for batch in sorted(near, key=lambda g: (abs(g - global_batch), g)):
        if any(pred.fits for pred in plan(model, cluster, batch, **options)):
            lines.append(f"a global batch of {batch} sequences runs")
            break
    nodes = math.ceil(cluster.gpus / cluster.gpus_per_node)
    for more in (nodes + 1, 2 * nodes, 4 * nodes, 8 * nodes):
        bigger = replace(cluster, gpus=more * cluster.gpus_per_node)
        if any(pred.fits for pred in plan(model, bigger, global_batch, **options)):
            lines.append(f"{bigger.gpus} GPUs ({more} nodes of {cluster.gpus_per_node}) run it")
            break
    shorter = model.seq_len // 2
    while shorter >= 512:
        if any(pred.fits for pred in plan(replace(model, seq_len=shorter), cluster, global_batch, **options)):
            lines.append(f"sequences of {shorter} tokens run")
            break
        shorter //= 2
    return "\n".join(lines) if lines else "no single change tried (batch, GPUs, sequence) admits a layout"


def parse_size(text: str) -> float:
    """'80GB', '80e9' or '141 GB' -> bytes (decimal units, as utils/memory.py prints them)."""
    units = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    text = text.strip().upper()
    for unit, size in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * size
    return float(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.planner",
        description="Rank every (dp, tp, pp, v, cp, ep, micro-batch, ZeRO, recompute) layout by predicted tokens/s.",
        epilog="GPU presets (--gpu): "
        + "; ".join(
            f"{key}: {hw['name']}, {hw['peak_flops'] / 1e12:.0f} TFLOP/s bf16, {hw['intra_bandwidth'] / 1e9:.0f} GB/s "
            f"NVLink and {hw['inter_bandwidth'] / 1e9:.0f} GB/s NIC per GPU each way"
            for key, hw in HARDWARE.items()
        )
        + ". The other --gpu-* options override the preset. Exit status 1 when no layout runs.",
    )
    add = parser.add_argument
    add("--params", type=float, required=True, help="parameters in the model, e.g. 70e9")
    add("--layers", type=int, required=True, help="transformer blocks")
    add("--hidden", type=int, required=True, help="model width h")
    add("--heads", type=int, required=True, help="attention heads")
    add("--vocab", type=int, required=True, help="vocabulary size")
    add("--seq-len", type=int, required=True, help="tokens per sequence")
    add("--experts", type=int, default=1, help="experts per MoE layer (default 1: a dense model)")
    add("--top-k", type=int, default=1, help="experts each token goes through (MoE)")
    add("--ffn-hidden", type=int, help="an expert's hidden width (default 4 x --hidden)")
    add("--global-batch", type=int, required=True, help="sequences per optimizer step, all GPUs together")
    add("--gpus", type=int, required=True, help="GPUs in the job")
    add("--gpu", choices=sorted(HARDWARE), default="H100", help="the GPU's preset (default H100)")
    add("--gpus-per-node", type=int, default=8, help="default: 8")
    add("--gpu-memory", help="memory per GPU, e.g. 80GB (default: the preset's)")
    add("--peak-tflops", type=float, help="dense bf16 peak per GPU (default: the preset's)")
    add("--intra-gbps", type=float, help="GB/s per GPU in a node, each way (default: the preset's NVLink)")
    add("--inter-gbps", type=float, help="GB/s per GPU across nodes, each way (default: the preset's NIC)")
    add("--precision", choices=sorted(PRECISIONS), default="mixed", help="model state as utils/memory.py counts it")
    add("--optimizer", choices=sorted(OPTIMIZER_STATE), default="adam")
    add("--micro-batches", default="1,2,4,8", help="micro-batch sizes to try, comma-separated")
    add("--cp", default="1", help="context-parallel sizes to try, comma-separated, e.g. 1,2,4 (default 1)")
    add("--ep", default="1", help="expert-parallel sizes to try, comma-separated, e.g. 1,2,4,8 (default 1)")
    add("--virtual-stages", default="1,2,4", help="interleaved chunks per pipeline rank to try (default 1,2,4)")
    add("--unfused-attention", action="store_true", help="attention that stores its s x s scores (no fused kernel)")
    add("--no-sequence-parallel", action="store_true", help="tensor parallelism without sequence parallelism")
    add("--top", type=int, default=10, help="how many runnable layouts to print")
    add("--all", action="store_true", help="print every layout, the refused ones with their reason")
    args = parser.parse_args(argv)
    try:
        micro_batches, cps, eps, vs = (
            tuple(int(n) for n in text.split(","))
            for text in (args.micro_batches, args.cp, args.ep, args.virtual_stages)
        )
        memory = parse_size(args.gpu_memory) if args.gpu_memory else HARDWARE[args.gpu]["memory"]
    except ValueError:
        parser.error(
            "--micro-batches, --cp, --ep and --virtual-stages take integers like 1,2,4 and --gpu-memory a size like "
            "80GB"
        )
    numbers = [args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.global_batch]
    sizes = [args.gpus, args.gpus_per_node, memory, args.top, args.experts, args.top_k, *micro_batches, *cps, *eps]
    if min(numbers + sizes + list(vs)) < 1:
        parser.error(
            "model sizes, --global-batch, --gpus, --gpus-per-node, --gpu-memory, --top, --experts, --top-k, "
            "--micro-batches, --cp, --ep and --virtual-stages must be positive"
        )
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}: route each token to fewer experts")
    model = Model(
        args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.experts, args.top_k,
        args.ffn_hidden,
    )  # fmt: skip
    if model.expert_params >= model.params:
        parser.error(
            f"{args.experts} experts of 2 x {args.hidden} x {args.ffn_hidden or 4 * args.hidden} parameters in "
            f"{args.layers} layers are {model.expert_params:.3g}, not less than --params {args.params:.3g}"
        )
    overrides = {"memory": memory}
    for option, key, scale in (("peak_tflops", "peak_flops", 1e12), ("intra_gbps", "intra_bandwidth", 1e9),
                               ("inter_gbps", "inter_bandwidth", 1e9)):  # fmt: skip
        if getattr(args, option) is not None:
            if getattr(args, option) <= 0:
                parser.error(f"--{option.replace('_', '-')} must be positive")
            overrides[key] = getattr(args, option) * scale
    cluster = Cluster.of(args.gpu, args.gpus, args.gpus_per_node, **overrides)
    state = {"precision": args.precision, "optimizer": args.optimizer}
    options = dict(micro_batches=micro_batches, sequence_parallel=not args.no_sequence_parallel, cps=cps, eps=eps,
                   virtual_stages=vs)  # fmt: skip
    if args.unfused_attention:  # every layout, and every alternative what_would_run tries
        options["software"] = {"fused_attention": False}
    predictions = plan(model, cluster, args.global_batch, **options, **state)
    runnable = [pred for pred in predictions if pred.fits]
    print(
        f"{args.params:.3g} parameters, {args.gpus} x {cluster.name} ({args.gpus_per_node} per node, "
        f"{human(cluster.usable_memory)} usable of {human(memory)}), global batch {args.global_batch} x "
        f"{args.seq_len} tokens, {args.precision} {args.optimizer}: {len(runnable)} of {len(predictions)} layouts run"
    )
    print(table(predictions if args.all else runnable[: args.top]))
    print(f"refused ({len(predictions) - len(runnable)}):\n{rejection_summary(predictions)}")
    if not runnable:
        print("no layout runs. What would:\n" + what_would_run(model, cluster, args.global_batch, predictions,
                                                               **options, **state))  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
