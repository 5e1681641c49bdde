"""The search over layouts: which ones cannot run and why (check_layout, evaluate), every layout that divides the
work (enumerate_layouts), their ranking (plan), the table and the refusals counted by reason, and when nothing runs,
the one change that would admit a layout (what_would_run).

ZeRO-2/3 under a pipeline depends on the framework (Layout.framework), not on the physics:
- torch: torch.distributed.pipelining's PipelineStage turns off FSDP's gradient sync and resharding until the last
  micro-batch's backward, so full gradients are held across micro-batches (and torchtitan keeps the parameters
  gathered under PP: reshard_after_forward = not pp): ZeRO-2/3 would hold what ZeRO-1 holds, and check_layout refuses
  them with that reason. DeepSpeed's pipeline engine refuses ZeRO-2/3 outright.
- megatron: Megatron-LM's distributed optimizer shards the optimizer state only (ZeRO-1): ZeRO-2/3 refused.
- llama3: Llama 3 shards gradients under its pipeline (section 3.3.2), one reduce-scatter of the stage's gradients a
  micro-batch, m times the traffic of one, which predict prices as it prices ZeRO-2/3 under gradient accumulation at
  pp = 1.
The schedules' micro-batch rules are a framework's too: torch's Schedule1F1B refuses m < p (Megatron-LM's 1F1B caps
its warm-up at m instead). The interleaved schedule's: Megatron-LM needs m a multiple of p; torch's
ScheduleInterleaved1F1B only m a multiple of its rounds, m // p (timing.bubble_by_microbatches: the bubble against m);
Llama 3's schedule takes any m (section 3.3.2, its Figure 6).
"""

import itertools
import math
from dataclasses import replace

from utils.memory import human
from utils.planner.hardware import Cluster, inside_one_node
from utils.planner.model import ATTENTION_KERNELS, EP_OVERLAP, FRAMEWORKS, RECOMPUTE, Layout, Model
from utils.planner.predict import Prediction, predict


def check_layout(model: Model, cluster: Cluster, layout: Layout, global_batch: int) -> str | None:
    """Why a layout cannot run on this model and cluster, in a few words; None when its shape is sound."""
    dp, tp, pp, cp, ep, v = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.virtual_stages
    if layout.gpus != cluster.gpus:
        return f"cp x dp x tp x pp is not the GPU count ({layout.gpus} != {cluster.gpus})"
    if model.heads % tp:
        return f"heads not divisible by tp ({model.heads} heads, tp={tp})"
    kv_heads = model.kv_heads or model.heads
    if kv_heads % tp:  # Megatron-LM splits whole K/V heads (query groups) over the TP group; it does not copy them
        return f"K/V heads not divisible by tp ({kv_heads} K/V heads, tp={tp}: Megatron-LM needs tp to divide them)"
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
    if v > 1 and layout.framework == "megatron" and layout.microbatches % pp:
        return f"Megatron-LM's interleaving needs micro-batches in multiples of pp (m={layout.microbatches}, pp={pp})"
    if pp > 1 and v == 1 and layout.framework == "torch" and layout.microbatches < pp:
        return f"torch's Schedule1F1B needs at least pp micro-batches (m={layout.microbatches}, pp={pp})"
    rounds = max(1, layout.microbatches // pp)
    if v > 1 and layout.framework == "torch" and layout.microbatches % rounds:
        return (
            f"torch's interleaving needs micro-batches in multiples of its rounds (m={layout.microbatches}, "
            f"{rounds} rounds of pp={pp})"
        )
    if dp * layout.micro_batch * layout.microbatches != global_batch:
        return f"batch does not split ({global_batch} sequences over dp={dp} x micro-batch {layout.micro_batch})"
    if dp * cp == 1 and layout.zero > 0:
        return f"ZeRO shards nothing at dp=1 (ZeRO-{layout.zero} is ZeRO-0)"
    if pp > 1 and layout.zero >= 2 and layout.framework == "torch":
        return (
            f"ZeRO-{layout.zero} under torch's pipeline holds what ZeRO-1 holds (pp={pp}: PipelineStage keeps full "
            "gradients until the last micro-batch; use ZeRO-1, or framework llama3: a reduce-scatter a micro-batch)"
        )
    if pp > 1 and layout.zero >= 2 and layout.framework == "megatron":
        return (
            f"ZeRO-{layout.zero} under Megatron-LM's pipeline (pp={pp}: its distributed optimizer is ZeRO-1; "
            "framework llama3 shards gradients there)"
        )
    if layout.recompute not in RECOMPUTE:
        return f"unknown recomputation ({layout.recompute!r}, not one of {RECOMPUTE})"
    if layout.framework not in FRAMEWORKS:
        return f"unknown framework ({layout.framework!r}, not one of {FRAMEWORKS})"
    if layout.ep_overlap not in EP_OVERLAP:
        return f"unknown all-to-all overlap ({layout.ep_overlap!r}, not one of {EP_OVERLAP})"
    if layout.attention_kernel not in ATTENTION_KERNELS:
        return f"unknown attention kernel ({layout.attention_kernel!r}, not one of {ATTENTION_KERNELS})"
    if layout.fused_attention and layout.attention_kernel not in dict(cluster.attention_speeds):
        return f"attention kernel not on this GPU ({layout.attention_kernel} on {cluster.name})"
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
    the GPUs left by tp x pp is skipped. software: Layout fields every layout gets, e.g. {"framework": "llama3",
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
    """One line per layout. MFU in both conventions: the attention's causal half counted (the planner's own) and the
    whole s x s matrix (Megatron-LM's papers, PaLM, Llama 3, torchtitan), which differ most at long sequences."""
    header = (
        f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'v':>2} {'cp':>3} {'ep':>3} {'mb':>3} {'m':>4} {'zero':>4} "
        f"{'recompute':>9} {'state':>8} {'activ.':>8} {'step s':>7} {'bubble':>6} {'comm s':>7} {'tokens/s':>10} "
        f"{'MFU(causal)':>11} {'MFU(whole)':>10}  reason"
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
            cells += f"{pred.bubble_s / pred.step_s:>6.1%} {comm:>7.2f} {pred.tokens_per_s:>10,.0f} "
            cells += f"{pred.mfu:>11.1%} {pred.mfu_whole:>10.1%}"
        else:
            cells += f"{'-':>8} {'-':>8} {'-':>7} {'-':>6} {'-':>7} {'-':>10} {'-':>11} {'-':>10}"
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
