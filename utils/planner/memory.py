"""Memory per GPU: model state (utils/memory.py's ZeRO rule for the parameters a stage's GPU holds) and activations
(Korthikanti et al. 2022's count per layer, times the layers a stage holds, times the micro-batches in flight on it).

- model state: the stage's parameters over the dp x cp ranks that hold the same weights (experts: over dp x cp / ep).
  The first stage also holds the embedding (V h), the last the head (V h); the layers share the rest of N. Everything
  a GPU holds is split over tp. Bytes a parameter: precision "bf16" by default, what bf16 training keeps (2-byte
  weights, fp32 gradients, Adam's fp32 master copy and moments: 18; 6 + 12/d under ZeRO-1), or "mixed", the ZeRO
  paper's fp16 count (16-bit gradients: 16), or "fp32" (utils/memory.py).
- activations, Korthikanti et al. 2022 (arXiv:2205.05198) Table 2 per layer (activation_bytes_per_layer) times the
  layers a stage holds times the micro-batches in flight on it: p - k on stage k under 1F1B, and with v virtual
  stages 2(p-k-1) + (v-1)p + 1 chunks of L_k / v layers (Megatron-LM's warm-up; the first stage holds
  L (1 + (p-1)/(p v)) layers' worth); full recomputation rebuilds one layer's activations during backward.
- rank_parameter_shapes and rank_model_state: the exact tensors one rank of the course's own model holds (lessons
  04-06), which the runs of lesson 06 and utils/measure_at_scale.py measure to the byte.
"""

import itertools
import math

from utils.memory import model_state_bytes
from utils.planner.model import FRAMEWORKS, RECOMPUTE, Layout, Model


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
    dropout: bool | None = None,
    vocab_parallel=True,
    layers: int | None = None,
) -> float:
    """One micro-batch's activations on pipeline stage `stage`, in bytes: its layers (Table 2; `layers` of them,
    default lesson 05's cut) and section 4.3's extras, the embedding's dropout mask (sbh/t, 1 byte) on the first
    stage and, on the last, the final norm's and the head's inputs (2 values of sbh, split by sequence parallelism)
    and the loss's fp32 log-probabilities (4sbv, split over t when the head is vocab-parallel as in Megatron; the
    course's head is whole: False). Context parallelism: each rank holds s / cp of every sequence, so every term is
    / cp (ring attention keeps no other chunk's keys and values: its backward passes them around the ring again).
    dropout: default the model's."""
    dropout = model.dropout if dropout is None else dropout
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
    """Activations on pipeline stage `stage` at its peak, in bytes (16-bit values, dropout where the model has it,
    the log-sum-exp of a fused kernel): the micro-batches in flight (in_flight), and with full recomputation one
    layer's activations rebuilt during backward. The head's and the loss's activations exist for one micro-batch at a
    time: on the last stage a micro-batch's backward follows its forward through the last chunk at once, under 1F1B
    and interleaved alike (the warm-up's forwards go through the earlier chunks)."""
    s, b, h, t = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp
    layers = planned_stage_layers(model.layers, layout.pp)[stage] if layers is None else layers
    worth, microbatches = in_flight(layout, stage)
    extras = stage_activation_bytes(model, layout, stage, layers=0)  # the embedding's, the head's and the loss's
    lse = layers * 4 * model.heads / t * s * b if layout.fused_attention and layout.recompute != "full" else 0
    layer_part = stage_activation_bytes(model, layout, stage, layers=layers) - extras + lse
    held = layer_part * worth + extras * (1 if stage == layout.pp - 1 else microbatches)
    if layout.recompute == "full":
        held += activation_bytes_per_layer(
            s, b, h, model.heads, t, layout.sequence_parallel, "none", dropout=model.dropout, top_k=model.top_k,
            fused_attention=layout.fused_attention, kv_fraction=model.kv_fraction, framework=layout.framework,
            ffn_ratio=model.ffn_ratio, gated_mlp=model.gated_mlp,
        )  # fmt: skip
    return held


def stage_params(model: Model, layout: Layout, stage: int, layers: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of stage `stage` holds before ZeRO: its layers' share, the embedding on the
    first stage and the head on the last (tied: one matrix when one stage holds both, a copy on each otherwise, as
    Megatron-LM keeps them), all split over tp; experts also over ep."""
    expert_per_layer = model.expert_params / model.layers
    dense = layers * (model.layer_params - expert_per_layer)
    ends = (stage == 0) + (stage == layout.pp - 1)
    dense += model.embedding_params * (min(ends, 1) if model.tied_embeddings else ends)
    return dense / layout.tp, layers * expert_per_layer / (layout.tp * layout.ep)


def stage_model_state(model: Model, layout: Layout, precision: str = "bf16", optimizer: str = "adam", stage=None):
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
