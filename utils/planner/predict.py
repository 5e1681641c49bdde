"""One layout's prediction: the memory of the stage that needs the most, and the step time of the busiest stage,
its compute and every dimension's communication added up as far as they do not overlap.

- TP: per layer and micro-batch 2 all-reduces forward and 2 backward (2 more when recomputation replays the
  forward: full, and torch's selective policy, which keeps the matmuls' outputs but replays the collectives), each
  of s/cp x b x h 16-bit values; sequence parallelism swaps each for a reduce-scatter and an all-gather of the
  same volume. Counted as exposed (asynchronous TP, which overlaps them with the matmuls on GPUs, is not modelled).
- PP: one send of the boundary activation per micro-batch and chunk boundary, forward and backward; the steady
  state's sends overlap the next micro-batch's compute, the fill and drain's (2 (p v - 1) of them) do not. The
  bubble: (p-1) / (v m) of the busiest stage's work.
- DP: the stage's gradients over the dp x cp ranks that hold the same weights: an all-reduce (ZeRO-0), or a
  reduce-scatter and an all-gather of the updated parameters (ZeRO-1/2), plus ZeRO-3's parameter all-gathers, one
  collective per block (FSDP2's unit), each paying the ring's n - 1 latencies. The final reduction hides behind the
  last micro-batch's backward, the parameter all-gather behind the next step's first forward; what exceeds them
  shows. ZeRO under gradient accumulation, as torch runs it: with pp = 1 FSDP2 reduce-scatters every micro-batch
  (ZeRO-2/3) and ZeRO-3 gathers every block twice a micro-batch: m times the traffic of one, each micro-batch's
  collectives overlapping its own compute. Under a pipeline the same: one reduce-scatter a micro-batch, as Llama 3
  shards gradients (section 3.3.2), where the framework allows it (search.py says which do).
- buffers: ZeRO-3's gathered parameters and their unsharded gradients (the block in use and the prefetched one),
  ZeRO-2's bucket of one layer's gradients.
Ranks are ordered tp, cp, dp, pp, innermost first (Megatron-LM's order): each group's link follows from it.
"""

from dataclasses import dataclass, field

from utils.memory import bytes_per_param
from utils.planner.hardware import Cluster, inside_one_node
from utils.planner.memory import activation_bytes, planned_stage_layers, stage_model_state, stage_params
from utils.planner.model import Layout, Model
from utils.planner.timing import (
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    model_flops_per_token,
    ring_attention_seconds,
    stage_work,
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
    mfu: float = 0.0  # model FLOPs per second / (GPUs x peak), the attention's causal half counted
    mfu_whole: float = 0.0  # the same with the attention counted whole (PaLM's, Megatron-LM's and Llama 3's MFU)
    hfu: float = 0.0  # hardware FLOPs per second / (GPUs x peak)
    tflops_per_gpu: float = 0.0  # hardware TFLOP/s per GPU, as Narayanan et al. 2021 report it

    @property
    def memory(self) -> float:
        return sum(self.model_state.values()) + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.reason is None


def predict(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16", optimizer="adam"):
    """Memory and step time of one layout (whether or not it can run: see check_layout)."""
    s, b, h, t, p, m = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.pp, layout.microbatches
    cp, v = layout.cp, layout.virtual_stages
    pred = Prediction(layout)
    pred.stage_layers = planned_stage_layers(model.layers, p)
    replicas = layout.dp * cp  # ranks that hold the same dense weights
    expert_replicas = replicas // layout.ep
    per = bytes_per_param(precision, optimizer)

    # Stages that hold as many layers and the same ends (the embedding, the head) hold the same model state and do
    # the same work a micro-batch: each such kind is computed once (126 layers over 16 stages make 3 kinds).
    first_of_kind = {}  # each stage's kind, named by the first stage of that kind
    kind_of = [first_of_kind.setdefault((pred.stage_layers[k], k == 0, k == p - 1), k) for k in range(p)]
    kinds = sorted(first_of_kind.values())

    # Memory: the stage that needs the most is reported. Within a kind the model state and buffers are the same and
    # the activations never grow with the stage number (fewer micro-batches in flight further down the pipeline), so
    # each kind's first stage is its largest.
    def stage_memory(stage):
        state = stage_model_state(model, layout, precision, optimizer, stage)
        buffers = 0.0
        one_layer = sum(stage_params(model, layout, stage, 1)) - sum(stage_params(model, layout, stage, 0))
        if layout.zero == 3:  # the block in use and the prefetched one, gathered, and their unsharded gradients
            buffers = 2 * one_layer * (per["params"] + per["grads"])
        elif layout.zero == 2:  # one layer's gradients waiting for their reduce-scatter
            buffers = one_layer * per["grads"]
        return state, activation_bytes(model, layout, stage, pred.stage_layers[stage]), buffers

    memories = {stage: stage_memory(stage) for stage in kinds}
    pred.stage = max(memories, key=lambda k: sum(memories[k][0].values()) + memories[k][1] + memories[k][2])
    pred.model_state, pred.activations, pred.buffers = memories[pred.stage]

    # Compute, per micro-batch, on every stage (one of each kind); the busiest sets the pace.
    works = {k: stage_work(model, cluster, layout, k, pred.stage_layers[k]) for k in kinds}
    busiest = max(works, key=lambda k: works[k].forward_s + works[k].backward_s)
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
    layer_compute = (work.forward_s + work.backward_s) / layers_here  # what may hide a layer's all-to-alls
    pred.ep_s = layers_here * m * all_to_all_seconds(model, cluster, layout, layer_compute)

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
    pred.hardware_flops = sum(works[kind].flops for kind in kind_of) * t * cp * layout.dp * m
    pred.mfu = pred.model_flops / pred.step_s / (cluster.gpus * cluster.peak_flops)
    pred.mfu_whole = pred.mfu * model_flops_per_token(model, whole_attention=True) / model_flops_per_token(model)
    pred.hfu = pred.hardware_flops / pred.step_s / (cluster.gpus * cluster.peak_flops)
    pred.tflops_per_gpu = pred.hardware_flops / pred.step_s / cluster.gpus / 1e12
    return pred
