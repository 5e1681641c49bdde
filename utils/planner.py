"""The layout planner: which (dp, tp, pp, cp, ep, micro-batch, ZeRO stage, recomputation) to run a model with.

    python -m utils.planner --params 70e9 --layers 80 --hidden 8192 --heads 64 --vocab 128256 --seq-len 4096 \\
        --global-batch 1024 --gpus 64 --gpus-per-node 8 --gpu-memory 80GB --top 10
    python -m utils.planner ... --seq-len 131072 --cp 1,2,4,8          # long sequences: context parallelism
    python -m utils.planner ... --experts 8 --top-k 2 --ep 1,2,4,8     # mixture of experts: expert parallelism

    from utils.planner import Model, Cluster, Layout, predict, plan

It enumerates every layout that divides the work, predicts each one's memory per GPU and step time with the
formulas below, refuses those that cannot run (with the reason) and ranks the rest by predicted tokens/s.

Memory per GPU (the first pipeline stage, which holds the most):
- model state: utils/memory.py's ZeRO rule for the params / (tp x pp) parameters this GPU's stage shard holds;
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Table 2 per layer, times the layers of one stage, times the micro-batches in flight.
Step time: compute at an assumed MFU, Megatron's tensor-parallel all-reduces, pipeline sends and bubble, and
the data-parallel gradient traffic, each collective timed with lesson 01's alpha-beta ring model.

Context parallelism (cp) and expert parallelism (ep), the two dimensions lesson 09 builds, in Megatron-LM's rank
order tp, cp, dp, pp (innermost first; cp x dp x tp x pp = GPUs):
- cp splits each sequence over cp ranks (each keeps s/cp tokens: activations / cp); ring attention passes the
  keys and values around the cp group (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  arXiv:2310.01889): per layer and micro-batch each rank receives the K and V chunks of the cp - 1 others,
  2 x (cp-1)/cp x s x b x h / t values forward, twice that backward (K, V and their gradients). Each ring step
  overlaps with the attention of the chunk in hand (2 s^2 b h / (cp t) FLOPs forward, causal): only what exceeds
  it is added. The weights are replicated over cp: gradients (and ZeRO shards) over the dp x cp ranks.
- ep splits each MoE layer's experts over ep ranks taken inside dp x cp (Megatron-Core's expert grid: ep
  innermost after tp, ep dividing dp x cp; expert weights also split over tp). Each MoE layer dispatches every
  token to its top-k experts and combines the results: two all-to-alls forward, each sending tokens x k x h
  values x (ep-1)/ep per rank, so 2 x tokens x k x h x bytes x (ep-1)/ep per layer forward, the same backward;
  they sit between the router and the experts: nothing hides them. Expert gradients are averaged over the
  dp x cp / ep ranks that hold the same experts.
What it leaves out: embeddings counted as spread evenly over the stages (rank_model_state counts one rank's own
slice instead, embeddings on the first stage and the head on the last, for the course's model: lesson 06's runs hold
exactly that), interleaved schedules, memory fragmentation and workspace, the MoE capacity factor and load
imbalance (tokens spread evenly over the experts),
grouped-query attention (K/V as wide as Q), the MLP's activations at any other width than 4 x hidden (--ffn-hidden
sets the experts' parameters and FLOPs, not their activations), communication that overlaps better than stated below.
"""

import argparse
import itertools
import math
from dataclasses import dataclass, field

from utils.memory import OPTIMIZER_STATE, PRECISIONS, bytes_per_param, human, model_state_bytes

RECOMPUTE = ("none", "selective", "full")


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

    @property
    def expert_params(self) -> float:
        """Parameters of the experts, all layers together: up and down projections of ffn_hidden x hidden each (0 for
        a dense model, whose MLP is counted with the rest). The rest of params is dense: every token uses it."""
        if self.experts == 1:
            return 0.0
        return self.layers * self.experts * 2 * self.hidden * (self.ffn_hidden or 4 * self.hidden)

    @property
    def active_params(self) -> float:
        """The parameters one token goes through: the dense ones and top_k of each layer's experts."""
        return self.params - self.expert_params * (1 - self.top_k / self.experts)


@dataclass(frozen=True)
class Cluster:
    """Defaults: one H100 SXM node (80 GB, 989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s each way, one 400 Gb/s
    InfiniBand NIC per GPU = 50 GB/s). The latencies are assumptions of the order NCCL shows per ring step."""

    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9  # bytes per GPU
    peak_flops: float = 989e12  # FLOP/s per GPU
    intra_bandwidth: float = 450e9  # bytes/s per GPU inside a node
    inter_bandwidth: float = 50e9  # bytes/s per GPU between nodes
    intra_latency: float = 5e-6  # seconds per message inside a node
    inter_latency: float = 10e-6  # seconds per message between nodes
    mfu: float = 0.5  # assumed fraction of peak that compute reaches while it runs

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

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self):
        extra = "".join(f" {name}={size}" for name, size in (("cp", self.cp), ("ep", self.ep)) if size > 1)
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} mb={self.micro_batch} m={self.microbatches} "
            f"zero={self.zero} recompute={self.recompute}"
        )


@dataclass
class Prediction:
    layout: Layout
    reason: str | None = None  # why the layout cannot run; None when it can
    model_state: dict = field(default_factory=dict)  # bytes of params, grads, optimizer on one GPU
    activations: float = 0.0  # bytes of activations on the first pipeline stage at its peak
    compute_s: float = 0.0  # matmuls of one step on one GPU, recomputation included
    tp_s: float = 0.0  # tensor-parallel all-reduces (not overlapped)
    cp_s: float = 0.0  # the ring's K/V traffic that the attention compute does not hide
    ep_s: float = 0.0  # MoE all-to-alls (not overlapped)
    pp_s: float = 0.0  # pipeline sends between stages (not overlapped)
    bubble_s: float = 0.0  # pipeline fill and drain: idle time
    dp_s: float = 0.0  # data-parallel gradient (and ZeRO-3 parameter) traffic
    dp_exposed_s: float = 0.0  # the part of dp_s that the last backward does not hide
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0  # what the predicted step achieves: 6 N tokens/s / (GPUs x peak)

    @property
    def memory(self) -> float:
        return sum(self.model_state.values()) + self.activations

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
) -> float:
    """Bytes one transformer layer keeps for backward, 16-bit activations and 1-byte dropout masks.

    Korthikanti et al. 2022, Table 2 (s sequence, b micro-batch, h width, a heads, t tensor-parallel size):
      no parallelism                      sbh (34 + 5as/h)
      tensor parallel                     sbh (10 + 24/t + 5as/(ht))
      tensor + sequence parallel          sbh (34/t + 5as/(ht))
      selective recomputation             drops the 5as/(ht) term (attention scores, softmax, its dropout)
      full recomputation                  2sbh: only the layer's input (split over t by sequence parallelism)
    The 10 are the layer norms' and dropouts' tensors, which tensor parallelism alone leaves whole on every rank.
    Section 4.1's sum behind them, in values of s x b x h: 4 that TP leaves whole (the two norms' inputs, the
    inputs of QKV and of the MLP), 12 that it splits (Q, K, V, the attention output, the MLP's up output and its
    GELU output), and two 1-byte dropout masks; the scores are a x s x s x b values (the softmax output, and with
    dropout its mask and output). value_bytes and dropout restate them for another model: 4 for fp32 (the course's
    CPU runs), dropout=False for the course model (it has none). A fused attention kernel (FlashAttention, and
    PyTorch's scaled_dot_product_attention on CPU) keeps no scores either: recompute="selective" is its memory.
    A MoE layer runs each token through top_k experts: the MLP's input (dispatched) and its up and GELU outputs
    count top_k times (1 of the 4 whole values, 8 of the 12 split ones).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    sbh = s * b * h
    split_by_sp = t if sequence_parallel else 1
    if recompute == "full":
        return value_bytes * sbh / split_by_sp
    masks = 2 if dropout else 0
    scores = 0 if recompute == "selective" else a * s * s * b * (value_bytes * (1 + dropout) + dropout) / t
    whole, split = 3 + top_k, 4 + 8 * top_k
    return sbh * ((whole * value_bytes + masks) / split_by_sp + split * value_bytes / t) + scores


def layers_of_stage(layers: int, pp: int, stage: int) -> int:
    """Blocks of pipeline stage `stage`: the first layers % pp stages get one more (lesson 05's partition)."""
    return layers // pp + (stage < layers % pp)


def stage_activation_bytes(
    model: Model, layout: Layout, stage: int = 0, value_bytes: int = 2, dropout: bool = True, vocab_parallel=True
) -> float:
    """One micro-batch's activations on pipeline stage `stage`, in bytes: its layers (Table 2) and section 4.3's
    extras, the embedding's dropout mask (sbh/t, 1 byte) on the first stage and, on the last, the final norm's and
    the head's inputs (2 values of sbh, split by sequence parallelism) and the loss's fp32 log-probabilities
    (4sbv, split over t when the head is vocab-parallel as in Megatron; the course's head is whole: False).
    Context parallelism: each rank holds s / cp of every sequence, so every term is / cp (ring attention keeps
    no other chunk's keys and values: its backward passes them around the ring again)."""
    s, b, h, t, p = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp, layout.pp
    split_by_sp = t if layout.sequence_parallel else 1
    per_layer = activation_bytes_per_layer(
        s, b, h, model.heads, t, layout.sequence_parallel, layout.recompute, value_bytes, dropout, model.top_k
    )
    held = per_layer * layers_of_stage(model.layers, p, stage)
    if stage == 0 and dropout:
        held += s * b * h / split_by_sp
    if stage == p - 1:
        held += 2 * value_bytes * s * b * h / split_by_sp + 4 * s * b * model.vocab / (t if vocab_parallel else 1)
    return held


def omitted_activation_bytes(model: Model, layout: Layout, stage: int = 0, fused_attention: bool = True) -> float:
    """What Table 2 and section 4.3 leave out, in bytes for one micro-batch on stage `stage`, from what PyTorch's
    backward formulas save: each LayerNorm's fp32 mean and 1/std per token (two per layer, one more on the last
    stage), a fused attention's fp32 log-sum-exp per head and token, the int64 token ids on the first stage (the
    embedding's backward) and its int64 positions (one sequence), and on the last stage the int64 targets and the
    loss's fp32 normaliser (the NLL's total weight, one value)."""
    s, b, t, p = model.seq_len // layout.cp, layout.micro_batch, layout.tp, layout.pp
    tokens_here = s * b / (t if layout.sequence_parallel else 1)
    norms = 2 * layers_of_stage(model.layers, p, stage) + (stage == p - 1)
    held = norms * 2 * 4 * tokens_here
    if fused_attention and layout.recompute != "full":
        held += layers_of_stage(model.layers, p, stage) * 4 * model.heads / t * s * b
    if stage == 0:
        held += 8 * s * b + 8 * s
    if stage == p - 1:
        held += 8 * s * b + 4
    return held


def activation_bytes(model: Model, layout: Layout) -> float:
    """Activations on the first pipeline stage at its peak, in bytes.

    1F1B: the first stage runs p forwards before its first backward, so it holds min(p, m) micro-batches of its
    L/p layers (Korthikanti et al. 2022, section 4.2.3: p x L/p = L layers' worth). Full recomputation also rebuilds
    one layer's whole activations during backward. The extras of section 4.3: the embedding's dropout mask
    (sbh/t per micro-batch in flight) and, when the first stage is also the last, the final layer norm and
    output projection inputs (4sbh/t) and the fp32 logits of the loss (4sbv/t).
    """
    s, b, h, t = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp
    in_flight = min(layout.pp, layout.microbatches)  # one stage (pp = 1): one micro-batch at a time
    held = stage_activation_bytes(model, layout, 0) * in_flight
    if layout.recompute == "full":
        held += activation_bytes_per_layer(s, b, h, model.heads, t, layout.sequence_parallel, "none", top_k=model.top_k)
    return held


def stage_model_state(model: Model, layout: Layout, precision: str = "mixed", optimizer: str = "adam") -> dict:
    """utils/memory.py's ZeRO rule for the parameters of one stage's tensor-parallel shard: the dense ones sharded
    over the dp x cp ranks that hold the same weights, the experts split over ep and sharded over the dp x cp / ep
    ranks that hold the same experts (a dense model: the first term only)."""
    tp, pp = layout.tp, layout.pp
    dense = model.params - model.expert_params
    state = model_state_bytes(dense / (tp * pp), layout.dp * layout.cp, layout.zero, precision, optimizer)
    if model.expert_params:
        experts = model.expert_params / (tp * pp * layout.ep)
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
    its dp group. Sharded state is padded as FSDP2 pads it: each tensor's first dimension to a multiple of dp. The
    bytes each rank of lesson 06's runs holds, exactly: ZeRO-0 from scratch, ZeRO-3 built in (FSDP2)."""
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


def bubble_fraction(p: int, m: int) -> float:
    """Share of a GPipe or 1F1B step a stage sits idle: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def inside_one_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks spaced `stride` apart stays inside a node (ranks fill nodes in order).
    The rank grid puts TP innermost (stride 1), then DP (stride tp), then PP (stride tp x dp)."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0


def ring_attention_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """Per layer and micro-batch, forward and backward, the part of ring attention's K/V traffic that the attention
    compute does not hide. Forward: each rank receives the K and V chunks of the cp - 1 others, 2 x (cp-1)/cp x
    s x b x h / t values (1/t: the heads are split over tp), one chunk per ring step, each step's transfer
    overlapping the attention of the chunk in hand: 2 s^2 b h / (cp t) FLOPs forward (causal, balanced over the cp
    ranks by a zig-zag split) at the assumed MFU. Backward: K, V and their gradients, twice the bytes, against twice
    the FLOPs. So 3 x max(0, forward transfer - forward attention)."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    s, b, h = model.seq_len, layout.micro_batch, model.hidden
    bandwidth, latency = cluster.link(inside_one_node(t, cp, cluster.gpus_per_node))
    kv_bytes = 2 * 2 * (cp - 1) / cp * s * b * h / t  # K and V, 16-bit
    transfer = (cp - 1) * latency + kv_bytes / bandwidth
    attention = 2 * s * s * b * h / (cp * t) / (cluster.peak_flops * cluster.mfu)
    return 3 * max(0.0, transfer - attention)


def all_to_all_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """Per MoE layer and micro-batch, forward and backward: the dispatch and the combine, each tokens x k x h
    16-bit values from every rank, (ep-1)/ep of them to other ranks (ep - 1 messages each), forward and again
    backward: 4 all-to-alls, 2 x tokens x k x h x 2 bytes x (ep-1)/ep each way. tokens: the rank's s/cp x b."""
    ep = layout.ep
    if ep == 1 or model.experts == 1:
        return 0.0
    tokens = model.seq_len // layout.cp * layout.micro_batch
    bandwidth, latency = cluster.link(inside_one_node(layout.tp, ep, cluster.gpus_per_node))
    one = (ep - 1) * latency + tokens * model.top_k * model.hidden * 2 * (ep - 1) / ep / bandwidth
    return 4 * one


def predict(model: Model, cluster: Cluster, layout: Layout, precision: str = "mixed", optimizer="adam"):
    """Memory and step time of one layout (whether or not it can run: see check_layout)."""
    s, b, h, t, p, m = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.pp, layout.microbatches
    cp = layout.cp
    pred = Prediction(layout)
    pred.model_state = stage_model_state(model, layout, precision, optimizer)
    pred.activations = activation_bytes(model, layout)

    # Compute: 6 FLOPs per parameter per token (forward 2, backward 4), spread over every GPU; a MoE model's
    # tokens go through its active parameters only (the dense ones and top_k experts a layer).
    tokens = layout.dp * m * b * s
    # Recomputation: selective adds the attention scores again, about s/6h (Korthikanti et al. 2022, eq. 9);
    # full adds a whole forward, 2 of the 6 FLOPs.
    extra = {"none": 1.0, "selective": 1 + s / (6 * h), "full": 4 / 3}[layout.recompute]
    pred.compute_s = 6 * model.active_params * tokens * extra / (cluster.gpus * cluster.peak_flops * cluster.mfu)

    # Tensor parallelism (Megatron): per layer 2 all-reduces forward, 2 backward (2 more when the forward is
    # recomputed), each of s/cp x b x h 16-bit values, inside the node. Sequence parallelism swaps each for a
    # reduce-scatter + all-gather of the same volume. They sit between matmuls: nothing hides them.
    layers_here = math.ceil(model.layers / p)
    per_layer = 4 + (2 if layout.recompute == "full" else 0)
    tp_link = cluster.link(inside_one_node(1, t, cluster.gpus_per_node))
    pred.tp_s = layers_here * m * per_layer * all_reduce_seconds(2 * s // cp * b * h, t, *tp_link)
    # Context and expert parallelism: per layer and micro-batch, as tensor parallelism's traffic is.
    pred.cp_s = layers_here * m * ring_attention_seconds(model, cluster, layout)
    pred.ep_s = layers_here * m * all_to_all_seconds(model, cluster, layout)

    # Pipeline: fill and drain leave each stage idle (p-1)/(m+p-1) of the time; one send of the boundary
    # activation (sequence parallel: 1/t of it per rank) per schedule slot, forward and backward.
    busy = pred.compute_s + pred.tp_s + pred.cp_s + pred.ep_s
    pipeline = busy * (m + p - 1) / m
    pred.bubble_s = pipeline - busy
    if p > 1:
        bandwidth, latency = cluster.link(inside_one_node(t * cp * layout.dp, p, cluster.gpus_per_node))
        boundary = 2 * s // cp * b * h / (t if layout.sequence_parallel else 1)
        pred.pp_s = 2 * (m + p - 1) * (latency + boundary / bandwidth)

    # Data parallelism: the stage's gradients once per step, over the dp x cp ranks that hold the same weights
    # (the experts': over the dp x cp / ep that hold the same experts, ep ranks apart). ZeRO 0-2 move them as an
    # all-reduce (ZeRO-1/2: reduce-scatter + all-gather of the updated parameters, the same bytes); ZeRO-3 adds a
    # second parameter all-gather (forward and backward), 1.5x, counted once per step (parameters kept across
    # micro-batches).
    per_param = bytes_per_param(precision, optimizer)["grads"]
    dense_bytes = per_param * (model.params - model.expert_params) / (t * p)
    transfers = 3 if layout.zero == 3 else 2
    dp_link = cluster.link(inside_one_node(t, layout.dp * cp, cluster.gpus_per_node))
    pred.dp_s = transfers * all_gather_seconds(dense_bytes, layout.dp * cp, *dp_link)
    if model.expert_params:
        expert_bytes = per_param * model.expert_params / (t * p * layout.ep)
        replicas = layout.dp * cp // layout.ep
        expert_link = cluster.link(inside_one_node(t * layout.ep, replicas, cluster.gpus_per_node))
        pred.dp_s += transfers * all_gather_seconds(expert_bytes, replicas, *expert_link)
    # What overlaps: the traffic starts during the last micro-batch's backward (2/3 of its compute) and hides there.
    pred.dp_exposed_s = max(0.0, pred.dp_s - (2 / 3) * pred.compute_s / m)

    pred.step_s = pipeline + pred.pp_s + pred.dp_exposed_s
    pred.tokens_per_s = tokens / pred.step_s
    pred.mfu = 6 * model.active_params * pred.tokens_per_s / (cluster.gpus * cluster.peak_flops)
    return pred


# --------------------------------------------------------------------------------------------------
# Which layouts can run, and the ranking
# --------------------------------------------------------------------------------------------------


def check_layout(model: Model, cluster: Cluster, layout: Layout, global_batch: int) -> str | None:
    """Why a layout cannot run on this model and cluster, in a few words; None when its shape is sound."""
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
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
    if model.layers % pp:
        return f"layers not divisible by pp ({model.layers} layers, pp={pp})"
    if dp * layout.micro_batch * layout.microbatches != global_batch:
        return f"batch does not split ({global_batch} sequences over dp={dp} x micro-batch {layout.micro_batch})"
    if dp * cp == 1 and layout.zero > 0:
        return f"ZeRO shards nothing at dp=1 (ZeRO-{layout.zero} is ZeRO-0)"
    if layout.recompute not in RECOMPUTE:
        return f"unknown recomputation ({layout.recompute!r}, not one of {RECOMPUTE})"
    return None


def evaluate(model: Model, cluster: Cluster, layout: Layout, global_batch: int, **state) -> Prediction:
    """check_layout, then predict; a layout whose shape is sound but whose memory exceeds the GPU's is refused."""
    reason = check_layout(model, cluster, layout, global_batch)
    if reason:
        return Prediction(layout, reason)
    pred = predict(model, cluster, layout, **state)
    if pred.memory > cluster.memory:
        pred.reason = f"does not fit ({human(pred.memory)} > {human(cluster.memory)})"
    return pred


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    cluster: Cluster, global_batch: int, micro_batches=(1, 2, 4, 8), sequence_parallel=True, cps=(1,), eps=(1,)
):
    """Every (tp, pp, cp, dp) whose product is the GPU count for each cp of `cps`, with each ep of `eps`, micro-batch
    size, ZeRO stage and recomputation. A cp that does not divide the GPUs left by tp x pp is skipped."""
    for tp, pp in itertools.product(divisors(cluster.gpus), repeat=2):
        if cluster.gpus % (tp * pp):
            continue
        for cp in cps:
            if cluster.gpus % (tp * pp * cp):
                continue
            dp = cluster.gpus // (tp * pp * cp)
            for ep, b, zero, recompute in itertools.product(eps, micro_batches, range(4), RECOMPUTE):
                m = global_batch // (dp * b)  # 0 or a remainder: check_layout says the batch does not split
                yield Layout(dp, tp, pp, b, m, zero, recompute, sequence_parallel, cp, ep)


def plan(model, cluster, global_batch, micro_batches=(1, 2, 4, 8), sequence_parallel=True, cps=(1,), eps=(1,), **state):
    """Every layout evaluated: those that run first, fastest first (the smaller memory first among equals), then
    the refused ones. cps, eps: the context- and expert-parallel sizes to consider. state: precision and
    optimizer, as utils/memory.py takes them."""
    layouts = enumerate_layouts(cluster, global_batch, micro_batches, sequence_parallel, cps, eps)
    predictions = [evaluate(model, cluster, layout, global_batch, **state) for layout in layouts]
    return sorted(predictions, key=lambda pred: (not pred.fits, -round(pred.tokens_per_s, 6), pred.memory))


def table(predictions: list[Prediction]) -> str:
    header = (
        f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'mb':>3} {'m':>4} {'zero':>4} {'recompute':>9} "
        f"{'state':>8} {'activ.':>8} {'step s':>7} {'bubble':>6} {'comm s':>7} {'tokens/s':>10} {'MFU':>5}  reason"
    )
    lines = [header]
    for rank, pred in enumerate(predictions, 1):
        lay = pred.layout
        cells = f"{rank:>3} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.ep:>3} "
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


def rejection_summary(predictions: list[Prediction]) -> str:
    """How many layouts each kind of reason refused (a reason is its kind, then its numbers in brackets)."""
    counts = {}
    for pred in predictions:
        if not pred.fits:
            kind = pred.reason.split(" (")[0]
            counts[kind] = counts.get(kind, 0) + 1
    return "\n".join(f"  {n:>5}  {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def parse_size(text: str) -> float:
    """'80GB', '80e9' or '141 GB' -> bytes (decimal units, as utils/memory.py prints them)."""
    units = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    text = text.strip().upper()
    for unit, size in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * size
    return float(text)


def main(argv=None):
    defaults = Cluster(gpus=8)
    parser = argparse.ArgumentParser(
        prog="python -m utils.planner",
        description="Rank every (dp, tp, pp, micro-batch, ZeRO, recompute) layout by predicted tokens/s.",
        epilog="The cluster defaults describe H100 SXM nodes: 8 GPUs a node, 80 GB, 989 TFLOP/s dense bf16, NVLink 4 "
        "at 450 GB/s each way inside a node, one 400 Gb/s InfiniBand NIC (50 GB/s) per GPU between nodes; the "
        "latencies and the MFU are assumptions.",
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
    add("--gpus-per-node", type=int, default=defaults.gpus_per_node, help="default: 8 (an H100 node)")
    add("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB (default: H100 80GB)")
    add("--peak-tflops", type=float, default=defaults.peak_flops / 1e12, help="default: 989 (H100 SXM, dense bf16)")
    add("--mfu", type=float, default=defaults.mfu, help="assumed fraction of peak while computing (default 0.5)")
    add("--intra-gbps", type=float, default=defaults.intra_bandwidth / 1e9, help="GB/s per GPU in a node (NVLink: 450)")
    add("--inter-gbps", type=float, default=defaults.inter_bandwidth / 1e9, help="GB/s per GPU across nodes (IB: 50)")
    add("--intra-latency-us", type=float, default=defaults.intra_latency * 1e6, help="per message in a node (5)")
    add("--inter-latency-us", type=float, default=defaults.inter_latency * 1e6, help="per message across nodes (10)")
    add("--precision", choices=sorted(PRECISIONS), default="mixed", help="model state as utils/memory.py counts it")
    add("--optimizer", choices=sorted(OPTIMIZER_STATE), default="adam")
    add("--micro-batches", default="1,2,4,8", help="micro-batch sizes to try, comma-separated")
    add("--cp", default="1", help="context-parallel sizes to try, comma-separated, e.g. 1,2,4 (default 1)")
    add("--ep", default="1", help="expert-parallel sizes to try, comma-separated, e.g. 1,2,4,8 (default 1)")
    add("--no-sequence-parallel", action="store_true", help="tensor parallelism without sequence parallelism")
    add("--top", type=int, default=10, help="how many runnable layouts to print")
    add("--all", action="store_true", help="print every layout, the refused ones with their reason")
    args = parser.parse_args(argv)
    try:
        micro_batches, cps, eps = (
            tuple(int(n) for n in text.split(",")) for text in (args.micro_batches, args.cp, args.ep)
        )
        memory = parse_size(args.gpu_memory)
    except ValueError:
        parser.error("--micro-batches, --cp and --ep take integers like 1,2,4 and --gpu-memory a size like 80GB")
    numbers = [args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.global_batch]
    sizes = [args.gpus, args.gpus_per_node, memory, args.top, args.experts, args.top_k, *micro_batches, *cps, *eps]
    if min(numbers + sizes) < 1:
        parser.error(
            "model sizes, --global-batch, --gpus, --gpus-per-node, --gpu-memory, --top, --experts, --top-k, "
            "--micro-batches, --cp and --ep must be positive"
        )
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}: route each token to fewer experts")
    if not 0 < args.mfu <= 1:
        parser.error("--mfu is a fraction of peak, in (0, 1]")
    model = Model(
        args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.experts, args.top_k,
        args.ffn_hidden,
    )  # fmt: skip
    if model.expert_params >= model.params:
        parser.error(
            f"{args.experts} experts of 2 x {args.hidden} x {args.ffn_hidden or 4 * args.hidden} parameters in "
            f"{args.layers} layers are {model.expert_params:.3g}, not less than --params {args.params:.3g}"
        )
    cluster = Cluster(
        args.gpus, args.gpus_per_node, memory, args.peak_tflops * 1e12, args.intra_gbps * 1e9, args.inter_gbps * 1e9,
        args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6, args.mfu,
    )  # fmt: skip
    state = {"precision": args.precision, "optimizer": args.optimizer}
    sp = not args.no_sequence_parallel
    predictions = plan(model, cluster, args.global_batch, micro_batches, sp, cps, eps, **state)
    runnable = [pred for pred in predictions if pred.fits]
    print(
        f"{args.params:.3g} parameters, {args.gpus} GPUs ({args.gpus_per_node} per node, {human(memory)} each), "
        f"global batch {args.global_batch} x {args.seq_len} tokens, {args.precision} {args.optimizer}, "
        f"assumed MFU {args.mfu:.0%}: "
        f"{len(runnable)} of {len(predictions)} layouts run"
    )
    print(table(predictions if args.all else runnable[: args.top]))
    print(f"refused ({len(predictions) - len(runnable)}):\n{rejection_summary(predictions)}")
    if not runnable:
        print("no layout fits: add GPUs, shorten the sequence, or allow smaller micro-batches")


if __name__ == "__main__":
    main()
