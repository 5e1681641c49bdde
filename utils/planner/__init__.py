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

Each term of the physics is in the module its name says (s sequence, b micro-batch, h width, a heads, L layers,
V vocabulary, N parameters, t = tp, p = pp, v virtual stages, m micro-batches per step per replica):
- model.py: Model (the transformer's sizes) and Layout (how it runs);
- hardware.py: GPU presets, Cluster (nodes, links, the matmul efficiency, the attention kernels' rates) and the
  memory reserve;
- memory.py: model state (ZeRO) and activations (Korthikanti et al. 2022) per GPU, stage by stage;
- timing.py: FLOPs, the kernels of a micro-batch, the alpha-beta collectives, ring attention and the all-to-alls;
- predict.py: one layout's memory and step time, every term added up (Prediction);
- search.py: the layouts that cannot run and why, the enumeration and the ranking;
- cli.py: the command line.

What it leaves out: NCCL's tree and PAT algorithms, whose latency grows as log n instead of the ring's n - 1 (the
planner overcharges very large flat groups), asynchronous TP, the MoE capacity factor and load imbalance (tokens spread
evenly over the experts), the optimizer step's own time, data loading, stragglers and network contention.
"""

from utils.planner.hardware import (
    ATTENTION_SPEED,
    HARDWARE,
    MATMUL_EFFICIENCY,
    RESERVE_FIXED,
    RESERVE_FRACTION,
    Cluster,
    inside_one_node,
)
from utils.planner.memory import (
    activation_bytes,
    activation_bytes_per_layer,
    in_flight,
    layers_of_stage,
    omitted_activation_bytes,
    planned_stage_layers,
    rank_model_state,
    rank_parameter_shapes,
    stage_activation_bytes,
    stage_model_state,
    stage_params,
)
from utils.planner.model import ATTENTION_KERNELS, EP_OVERLAP, FRAMEWORKS, RECOMPUTE, Layout, Model
from utils.planner.predict import Prediction, predict
from utils.planner.search import (
    check_layout,
    enumerate_layouts,
    evaluate,
    plan,
    rejection_summary,
    table,
    what_would_run,
)
from utils.planner.timing import (
    StageWork,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    attention_flops,
    attention_kernel,
    bubble_by_microbatches,
    bubble_fraction,
    gemm_slowdown,
    layer_gemms,
    model_flops_per_token,
    ring_attention_seconds,
    stage_work,
)

__all__ = [
    "ATTENTION_KERNELS", "ATTENTION_SPEED", "EP_OVERLAP", "FRAMEWORKS", "HARDWARE", "MATMUL_EFFICIENCY", "RECOMPUTE",
    "RESERVE_FIXED", "RESERVE_FRACTION", "activation_bytes", "activation_bytes_per_layer", "all_gather_seconds",
    "all_reduce_seconds", "all_to_all_seconds", "attention_flops", "attention_kernel", "bubble_by_microbatches",
    "bubble_fraction", "check_layout", "Cluster", "enumerate_layouts", "evaluate", "gemm_slowdown", "in_flight",
    "inside_one_node", "layer_gemms", "layers_of_stage", "Layout", "Model", "model_flops_per_token",
    "omitted_activation_bytes", "plan", "planned_stage_layers", "predict", "Prediction", "rank_model_state",
    "rank_parameter_shapes", "rejection_summary", "ring_attention_seconds", "stage_activation_bytes",
    "stage_model_state", "stage_params", "stage_work", "StageWork", "table", "what_would_run",
]  # fmt: skip
