"""utils/planner/: the physics its modules' docstrings state (compute, recomputation, attention kernels, ZeRO under
gradient accumulation, interleaved and uneven pipelines, the memory reserve, GPU presets), checked by hand; the
layouts it refuses and why; the command line, including what it says when nothing runs. The published runs it
reproduces are tests/test_published_runs.py's, the real-size shards tests/test_measure_at_scale.py's."""

import contextlib
import dataclasses
import io
import math
import subprocess
import sys

import pytest

from tests.harness.launch import ROOT
from utils.memory import model_state_bytes
from utils.planner import (
    HARDWARE,
    MATMUL_EFFICIENCY,
    RESERVE_FIXED,
    RESERVE_FRACTION,
    Cluster,
    Layout,
    Model,
    activation_bytes,
    activation_bytes_per_layer,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    bubble_by_microbatches,
    bubble_fraction,
    check_layout,
    evaluate,
    gemm_slowdown,
    in_flight,
    inside_one_node,
    layer_gemms,
    model_flops_per_token,
    plan,
    planned_stage_layers,
    predict,
    rank_model_state,
    rank_parameter_shapes,
    stage_activation_bytes,
    stage_model_state,
    stage_params,
)
from utils.planner.cli import bubble_lines
from utils.planner.cli import main as planner_main

# The issue's example: a Llama-3-70B-shaped model on 8 nodes of 8 H100s.
LLAMA70 = Model(params=70e9, layers=80, hidden=8192, heads=64, vocab=128256, seq_len=4096)
H100x64 = Cluster(gpus=64, gpus_per_node=8, memory=80e9)
# GPT-3 175B and MT-NLG 530B as Korthikanti et al. 2022 (arXiv:2205.05198) run them, Table 3.
GPT3 = Model(params=175e9, layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)
MTNLG = Model(params=530e9, layers=105, hidden=20480, heads=128, vocab=51200, seq_len=2048)


def unfused(layout: Layout) -> Layout:
    """As Megatron-LM ran it for Korthikanti et al.: the scores kept, sequence parallelism re-gathering in backward."""
    return dataclasses.replace(layout, fused_attention=False, framework="megatron")


def test_model_state_is_utils_memory_for_each_stage():
    """The even split (stage None) is utils/memory.py's rule for params / (tp x pp); a stage's own share holds its
    layers and the embedding (first stage) or the head (last); predict reports the stage that needs the most."""
    for dp, tp, pp, zero in [(8, 2, 4, 0), (8, 2, 4, 1), (4, 2, 8, 1), (64, 1, 1, 3), (16, 4, 1, 2)]:
        layout = Layout(dp, tp, pp, micro_batch=1, microbatches=1024 // dp, zero=zero)
        even = model_state_bytes(70e9 / (tp * pp), dp, zero, "bf16", "adam")
        assert stage_model_state(LLAMA70, layout) == even
        embedding = 128256 * 8192
        layer = (70e9 - 2 * embedding) / 80
        first = (80 // pp * layer + embedding + (pp == 1) * embedding) / tp
        assert stage_model_state(LLAMA70, layout, stage=0) == model_state_bytes(first, dp, zero, "bf16", "adam")
        pred = predict(LLAMA70, H100x64, layout)
        assert pred.model_state == stage_model_state(LLAMA70, layout, stage=pred.stage)
        assert pred.stage == 0  # the first stage: the embedding and the most micro-batches in flight
    # By hand: ZeRO-3 over 64 ranks of the whole model, 2 + 4 + 12 bytes per parameter (bf16, fp32 gradients).
    layout = Layout(64, 1, 1, 1, 16, zero=3)
    assert sum(predict(LLAMA70, H100x64, layout).model_state.values()) == 18 * 70e9 / 64


def test_a_ranks_own_slice_of_the_course_model():
    """rank_parameter_shapes against the course's model itself cut into lesson 05's stages (tp = 1), and what tensor
    parallelism changes: only q/k/v/up (by rows, with their biases) and o/down's weights (by columns) shrink."""
    from utils.course.lessons import lesson
    from utils.model import ModelConfig, build_model

    for dim, layers, heads, seq_len in [(32, 4, 2, 32), (24, 3, 3, 16), (16, 5, 4, 8)]:
        config = ModelConfig(dim=dim, n_layers=layers, n_heads=heads, seq_len=seq_len)
        model = Model(0, layers, dim, heads, config.vocab_size, seq_len)
        for pp in range(1, layers + 1):
            for stage in range(pp):
                real = lesson("05").build_stage(build_model(config), stage, pp)
                whole = sorted(tuple(p.shape) for p in real.parameters())
                assert sorted(rank_parameter_shapes(model, 1, pp, stage)) == whole, (dim, layers, pp, stage)
                split = rank_parameter_shapes(model, heads, pp, stage)  # as many TP ranks as heads
                assert len(split) == len(whole)
                blocks = len(real.blocks)
                whole_order = rank_parameter_shapes(model, 1, pp, stage)  # tp = 1, in the same order as split
                shrunk = sum(a != b for a, b in zip(split, whole_order))
                assert shrunk == 10 * blocks  # per block 4 weights + 4 biases by rows, 2 weights by columns
                by_rows = sum(a[0] != b[0] for a, b in zip(split, whole_order))
                by_columns = sum(len(a) == 2 and a[1] != b[1] for a, b in zip(split, whole_order))
                assert (by_rows, by_columns) == (8 * blocks, 2 * blocks)  # q/k/v/up by rows, o/down by columns
    # ZeRO-3 pads each tensor's first dimension to a multiple of dp, as FSDP2 does: 15 positions over 2 ranks, 8 each.
    model = Model(0, 1, 24, 3, 256, 15)
    shapes = rank_parameter_shapes(model, 3, 1, 0)
    count = sum(math.prod(shape) for shape in shapes)
    shard = sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) for shape in shapes)
    assert 2 * shard == count + 24  # one padding row of the position embedding
    assert rank_model_state(model, Layout(2, 3, 1, 1, 1, zero=3), 0) == {"params": 4 * shard, "grads": 4 * shard,
                                                                          "optimizer": 0}  # fmt: skip
    assert rank_model_state(model, Layout(2, 3, 1, 1, 1, zero=0), 0) == {"params": 4 * count, "grads": 4 * count,
                                                                          "optimizer": 0}  # fmt: skip


def test_activation_formulas_are_the_papers_table_2():
    """Korthikanti et al. 2022, Table 2, evaluated by hand for GPT-3's shape (s=2048, b=1, h=12288, a=96, t=8)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert 5 * a * s / h == 80  # the paper's section 4.2.2: "5as/h = 80" for GPT-3

    def per_layer(**kwargs):
        return activation_bytes_per_layer(s, b, h, a, **kwargs)

    assert per_layer() == sbh * (34 + 80)  # no parallelism
    assert per_layer(t=t) == sbh * (10 + 24 / 8 + 80 / 8)  # tensor parallel: 10 of the 34 stay whole
    assert per_layer(t=t, sequence_parallel=True) == sbh * (34 / 8 + 80 / 8)
    assert per_layer(t=t, recompute="selective") == sbh * (10 + 24 / 8)
    assert per_layer(t=t, sequence_parallel=True, recompute="selective") == sbh * 34 / 8
    assert per_layer(t=t, recompute="full") == 2 * sbh  # the table's "full activation recomputation: 2sbh"
    assert per_layer(t=t, sequence_parallel=True, recompute="full") == 2 * sbh / 8  # the input, split by SP
    with pytest.raises(ValueError):
        per_layer(recompute="some")


def test_selective_recomputation_saves_what_the_paper_says():
    """Section 4.2.2: selective recomputation saves 70% of the activation memory of GPT-3 and 65% of MT-NLG's;
    section 1: TP + SP + selective needs about 5x less than tensor parallelism alone (t = 8)."""
    for model, saving in ((GPT3, 0.70), (MTNLG, 0.65)):
        args = (model.seq_len, 1, model.hidden, model.heads)
        kept = activation_bytes_per_layer(*args, recompute="selective") / activation_bytes_per_layer(*args)
        assert round(1 - kept, 2) == saving
    tp_only = activation_bytes_per_layer(2048, 1, 12288, 96, t=8)
    present = activation_bytes_per_layer(2048, 1, 12288, 96, t=8, sequence_parallel=True, recompute="selective")
    assert tp_only / present > 5


def test_fused_attention_keeps_no_scores_and_selective_rebuilds_the_cheap_tensors():
    """A fused kernel: "none" is Table 2 without the score term; "selective" recomputes the two norms and the
    activation function (2 whole values of sbh and 8 split ones); full keeps the input. Memory full < selective <
    none, with and without sequence parallelism, unfused and fused."""
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    sbh = s * b * h

    def per_layer(recompute, sp, fused):
        return activation_bytes_per_layer(s, b, h, a, t, sp, recompute, fused_attention=fused)

    assert per_layer("none", False, True) == per_layer("selective", False, False) == sbh * (10 + 24 / t)
    assert per_layer("selective", False, True) == sbh * (2 * 2 + 2 + 8 * 2 / t)  # 2 masks stay
    assert per_layer("selective", True, True) == sbh * (6 + 16) / t
    for sp in (False, True):
        for fused in (False, True):
            full, selective, none = (per_layer(r, sp, fused) for r in ("full", "selective", "none"))
            assert full < selective < none, (sp, fused)
    # The course's model (no dropout, fp32 on CPU): "none" with a fused kernel is the old "selective".
    assert activation_bytes_per_layer(s, b, h, a, 1, False, "none", 4, False, fused_attention=True) == sbh * 4 * 16


def test_torch_keeps_what_dtensor_and_selective_checkpointing_keep():
    """framework="torch" (what utils/measure_at_scale.py measures, to the byte): sequence parallelism keeps the two
    norms' gathered outputs whole; selective keeps the input, the output and down projections' partial sums whole,
    and Q, K, V, the attention output and the up output split. Still full < selective < none."""
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    sbh = s * b * h

    def per_layer(recompute, sp, framework):
        return activation_bytes_per_layer(s, b, h, a, t, sp, recompute, 2, False, fused_attention=True,
                                          framework=framework)  # fmt: skip

    assert per_layer("none", True, "torch") == 2 * sbh * (2 / t + 2 + 12 / t)
    assert per_layer("none", True, "megatron") == 2 * sbh * (4 / t + 12 / t)
    assert per_layer("none", False, "torch") == per_layer("none", False, "megatron") == 2 * sbh * (4 + 12 / t)
    assert per_layer("selective", True, "torch") == 2 * sbh * (1 / t + 2 + 8 / t)
    assert per_layer("selective", False, "torch") == 2 * sbh * (3 + 8 / t)
    for sp in (False, True):
        full, selective, none = (per_layer(r, sp, "torch") for r in ("full", "selective", "none"))
        assert full < selective < none
    with pytest.raises(ValueError, match="framework"):
        per_layer("none", True, "jax")


def test_first_stage_holds_p_microbatches_under_1f1b_and_more_interleaved():
    """Korthikanti et al.'s memory (unfused, TP + SP + their selective): the first of p stages holds p micro-batches
    of its L/p layers, L layers' worth whatever p is; interleaved with v chunks, L (1 + (p-1)/(p v))."""
    s, h = GPT3.seq_len, GPT3.hidden
    sbh = s * h
    per_layer = sbh * 34 / 8  # TP + SP + selective, t = 8
    for pp in (2, 4, 8):
        layout = unfused(Layout(64 // (8 * pp), 8, pp, micro_batch=1, microbatches=64))
        embedding_masks = pp * sbh / 8  # section 4.3: sbh/t per micro-batch in flight
        assert activation_bytes(GPT3, layout) == pytest.approx(per_layer * 96 + embedding_masks, rel=1e-12)
        for v in (2, 4):
            interleaved = dataclasses.replace(layout, virtual_stages=v)
            layers = activation_bytes(GPT3, interleaved) - activation_bytes(GPT3, interleaved, layers=0)
            assert layers == pytest.approx(per_layer * 96 * (1 + (pp - 1) / (pp * v)), rel=1e-12)
    few = unfused(Layout(1, 8, 8, micro_batch=1, microbatches=3))  # fewer micro-batches than stages: 3 in flight
    assert activation_bytes(GPT3, few) == pytest.approx(per_layer * 12 * 3 + 3 * sbh / 8, rel=1e-12)
    assert in_flight(Layout(1, 8, 8, 1, 64), 5) == (3, 3)  # stage k of 1F1B: p - k micro-batches
    # One stage: one micro-batch at a time, plus the output layer's inputs and the fp32 logits (4sbh/t + 4sbv/t).
    single = unfused(Layout(8, 8, 1, micro_batch=1, microbatches=8))
    assert activation_bytes(GPT3, single) == pytest.approx(per_layer * 96 + sbh / 8 + 4 * sbh / 8 + 4 * s * 51200 / 8)
    # Full recomputation keeps the layer inputs and rebuilds one whole layer during backward.
    full = unfused(Layout(8, 8, 1, micro_batch=1, microbatches=8, recompute="full"))
    rebuilt = sbh * (34 + 80) / 8
    assert activation_bytes(GPT3, full) == pytest.approx(2 * sbh / 8 * 96 + rebuilt + 5 * sbh / 8 + 4 * s * 51200 / 8)
    # A fused kernel adds its fp32 log-sum-exp per head and token on every layer it keeps.
    fused = Layout(8, 8, 1, micro_batch=1, microbatches=8, recompute="none", framework="megatron")
    lse = 96 * 4 * 96 / 8 * s
    assert activation_bytes(GPT3, fused) == pytest.approx(activation_bytes(GPT3, unfused(single)) + lse)


def test_uneven_stages_lighten_the_first_and_the_last():
    assert planned_stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B
    assert planned_stage_layers(80, 4) == (20,) * 4
    assert planned_stage_layers(80, 3) == (27, 27, 26)
    assert planned_stage_layers(10, 4) == (2, 3, 3, 2)
    for layers, pp in [(126, 16), (80, 3), (7, 7), (61, 16)]:
        counts = planned_stage_layers(layers, pp)
        assert sum(counts) == layers and max(counts) - min(counts) <= 1
    with pytest.raises(ValueError):
        planned_stage_layers(4, 5)
    llama405 = Model(405e9, 126, 16384, 128, 128000, 8192)
    layout = Layout(64, 8, 16, 1, 32, zero=1, recompute="selective", virtual_stages=2)
    assert check_layout(llama405, Cluster(8192), layout, 2048) is None  # 126 layers over 16 stages run
    pred = predict(llama405, Cluster(8192), layout)
    assert pred.stage_layers == planned_stage_layers(126, 16)


def test_compute_is_six_n_plus_attention_and_recomputation_adds_what_it_rebuilds():
    """Hardware FLOPs by hand (one step, the whole job, tokens T): unfused, no recomputation, 6(N - Vh) + 12 L s h
    per token (the embedding's lookup has no FLOPs); full adds a forward of the layers, 2(N - 2Vh) + 4 L s h;
    unfused selective adds the attention's forward, 4 L s h; a fused kernel runs half the causal matrix, and its
    backward recomputes the scores (2.5 times its forward). Model FLOPs are 6N + 6 L s h in every mode."""
    model, cluster = LLAMA70, H100x64
    s, h, L, V = 4096, 8192, 80, 128256
    base = Layout(16, 4, 1, 1, 64, zero=1, recompute="none")
    tokens = 1024 * s
    flops = {}
    for fused in (False, True):
        for recompute in ("none", "selective", "full"):
            layout = dataclasses.replace(base, recompute=recompute, fused_attention=fused)
            pred = predict(model, cluster, layout)
            flops[fused, recompute] = pred.hardware_flops / tokens
            assert pred.model_flops == pytest.approx(tokens * (6 * 70e9 + 6 * L * s * h))
            assert pred.mfu == pytest.approx(pred.model_flops / pred.step_s / (64 * 989e12))
            assert pred.tflops_per_gpu == pytest.approx(pred.hardware_flops / pred.step_s / 64 / 1e12)
    dense = 6 * (70e9 - V * h)
    assert flops[False, "none"] == pytest.approx(dense + 12 * L * s * h)
    assert flops[False, "full"] == pytest.approx(dense + 12 * L * s * h + 2 * (70e9 - 2 * V * h) + 4 * L * s * h)
    assert flops[False, "selective"] == pytest.approx(dense + 16 * L * s * h)
    assert flops[True, "none"] == pytest.approx(dense + 7 * L * s * h) == flops[True, "selective"]
    assert flops[True, "full"] == pytest.approx(dense + 9 * L * s * h + 2 * (70e9 - 2 * V * h))
    assert model_flops_per_token(model, whole_attention=True) == 6 * 70e9 + 12 * L * s * h


def test_narayanan_et_al_count_of_hardware_flops():
    """Narayanan et al. 2021, eq. 3: with full recomputation (unfused) a step of batch B executes
    96 B s L h^2 (1 + s/6h + V/(16 L h)) FLOPs, for N = 12 L h^2 + 2Vh (two V x h matrices: embedding, head)."""
    L, h, s, V, B = 24, 2304, 2048, 51200, 512
    model = Model(12 * L * h * h + 2 * V * h, L, h, 24, V, s)
    layout = Layout(32, 1, 1, 4, 4, zero=0, recompute="full", sequence_parallel=False, fused_attention=False)
    pred = predict(model, Cluster.of("A100", 32), layout)
    assert pred.hardware_flops == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)))


@pytest.mark.parametrize("fused", [True, False])
def test_recomputation_orders_time_and_memory(fused):
    """Full recomputation redoes everything selective does: none <= selective < full in time for the issue's case
    (70B at 128K tokens, dp 32/cp, tp 2, ZeRO-3) at every cp, and full < selective < none in memory. Unfused at
    128K, the one layer full recomputation rebuilds in backward holds its s x s scores: more than selective keeps
    (the reason fused kernels exist); at 4K tokens the order holds unfused too."""
    model = Model(70e9, 80, 8192, 64, 128256, 131072)
    for cp in (1, 2, 4, 8):
        preds = {
            r: predict(model, H100x64, Layout(32 // cp, 2, 1, 1, 1, zero=3, recompute=r, cp=cp, fused_attention=fused))
            for r in ("none", "selective", "full")
        }
        assert preds["none"].compute_s <= preds["selective"].compute_s < preds["full"].compute_s
        assert preds["none"].step_s <= preds["selective"].step_s < preds["full"].step_s
        assert preds["selective"].activations < preds["none"].activations
        if fused:
            assert preds["full"].activations < preds["selective"].activations
        elif cp == 1:  # the rebuilt layer's 128K x 128K scores
            assert preds["full"].activations > preds["selective"].activations > 1e12
        if cp > 1 and fused:  # each doubling of cp halves the activations
            half = predict(model, H100x64, Layout(64 // cp, 2, 1, 1, 1, zero=3, recompute="full", cp=cp // 2))
            assert preds["full"].activations == pytest.approx(half.activations / 2, rel=1e-9)
    short = [predict(LLAMA70, H100x64, Layout(32, 2, 1, 1, 32, zero=3, recompute=r, fused_attention=fused))
             for r in ("full", "selective", "none")]  # fmt: skip
    assert short[0].activations < short[1].activations < short[2].activations


def test_fused_attention_at_long_sequences_needs_no_context_parallelism_to_fit():
    """With a fused kernel nothing of size s^2 is kept: 70B at 128K tokens fits on 64 GPUs without cp (full
    recomputation keeps one 2sbh input a layer); unfused, the scores of the one layer rebuilt in backward alone
    are hundreds of gigabytes."""
    model = Model(70e9, 80, 8192, 64, 128256, 131072)
    predictions = plan(model, H100x64, 32, micro_batches=(1,), virtual_stages=(1, 2, 4))  # cp = 1 only
    assert sum(pred.fits for pred in predictions) >= 5
    scores = unfused(Layout(8, 8, 1, 1, 4, zero=3, recompute="full"))
    assert predict(model, H100x64, scores).activations > 5 * H100x64.memory


def test_alpha_beta_collectives():
    """Lesson 01's ring model: all-reduce 2(n-1) alpha + 2(n-1)/n S beta; all-gather half of it."""
    size, n, bandwidth, latency = 1e9, 8, 1e11, 1e-5
    assert all_reduce_seconds(size, n, bandwidth, latency) == pytest.approx(14 * 1e-5 + 1.75 * size / bandwidth)
    assert all_gather_seconds(size, n, bandwidth, latency) == pytest.approx(7 * 1e-5 + 0.875 * size / bandwidth)
    assert all_reduce_seconds(size, 1, bandwidth, latency) == 0 == all_gather_seconds(size, 1, bandwidth, latency)


def test_bubble_and_the_terms_of_a_step():
    assert bubble_fraction(4, 12) == 3 / 15
    assert bubble_fraction(1, 7) == 0
    assert bubble_fraction(4, 12, v=3) == pytest.approx(1 / 13)  # (p-1)/v idle slots against m busy ones
    for v in (1, 2, 4):
        layout = Layout(dp=4, tp=2, pp=8, micro_batch=1, microbatches=256, virtual_stages=v)
        pred = predict(LLAMA70, H100x64, layout)
        busy = pred.compute_s + pred.tp_s + pred.cp_s + pred.ep_s
        assert pred.bubble_s / (busy + pred.bubble_s) == pytest.approx(bubble_fraction(8, 256, v))
        # The fill and drain's sends, 2 (p v - 1) of them, of s x b x h / t 16-bit values (sequence parallel).
        send = 5e-6 if inside_one_node(2 * 4, 8, 8) else 10e-6
        assert pred.pp_s == pytest.approx(2 * (8 * v - 1) * (send + 2 * 4096 * 8192 / 2 / 50e9))
        # TP: 4 all-reduces of s x b x h 16-bit values per layer per micro-batch, over NVLink, and 2 more that
        # torch's selective recomputation replays (the layout's default).
        one = all_reduce_seconds(2 * 4096 * 8192, 2, 450e9, 5e-6)
        assert pred.tp_s == pytest.approx(10 * 256 * 6 * one)
        none = predict(LLAMA70, H100x64, dataclasses.replace(layout, recompute="none"))
        megatron = predict(LLAMA70, H100x64, dataclasses.replace(layout, framework="megatron"))
        assert none.tp_s == megatron.tp_s == pytest.approx(10 * 256 * 4 * one)
        assert pred.step_s == pytest.approx(busy + pred.bubble_s + pred.pp_s + pred.dp_exposed_s)
        assert pred.tokens_per_s == pytest.approx(1024 * 4096 / pred.step_s)


def test_compute_time_is_flops_at_the_matmul_efficiency_plus_memory_bound_kernels_plus_launches():
    """The busiest stage's kernels: its FLOPs at peak x MATMUL_EFFICIENCY, and the rest (memory-bound kernels and a
    fixed cost per kernel) positive and a small share for a large model; small micro-batches pay the fixed cost
    more often, so two sequences a micro-batch take less than twice one."""
    layout = Layout(64, 1, 1, 1, 16, zero=1, recompute="none")
    pred = predict(LLAMA70, H100x64, layout)
    matmuls = pred.hardware_flops / 64 / (989e12 * MATMUL_EFFICIENCY)
    assert matmuls < pred.compute_s < 1.1 * matmuls
    small = Model(1e9, 24, 2048, 16, 32000, 1024)
    one = predict(small, Cluster(8), Layout(8, 1, 1, 1, 8, zero=1, recompute="none"))
    two = predict(small, Cluster(8), Layout(8, 1, 1, 2, 4, zero=1, recompute="none"))
    assert two.compute_s < one.compute_s and two.hardware_flops == pytest.approx(one.hardware_flops)


def test_zero_under_gradient_accumulation_as_torch_runs_it():
    """With pp > 1 and torch's pipelining, ZeRO-2/3 are refused (PipelineStage keeps full gradients until the last
    micro-batch, and parameters gathered: what ZeRO-1 holds). With pp = 1, FSDP2 reduce-scatters every micro-batch
    (ZeRO-2: m + 1 transfers of the parameters a step) and ZeRO-3 also gathers every block twice a micro-batch (3m)."""
    for zero in (2, 3):
        reason = check_layout(LLAMA70, H100x64, Layout(8, 2, 4, 1, 128, zero=zero), 1024)
        assert reason.startswith(f"ZeRO-{zero} under torch's pipeline holds what ZeRO-1 holds"), reason
        assert "PipelineStage" in reason and "framework llama3" in reason  # whose property, and the way out
        megatron = check_layout(LLAMA70, H100x64, Layout(8, 2, 4, 1, 128, zero=zero, framework="megatron"), 1024)
        assert megatron.startswith(f"ZeRO-{zero} under Megatron-LM's pipeline") and "ZeRO-1" in megatron, megatron
    model = Model(params=8e9, layers=32, hidden=4096, heads=32, vocab=128256, seq_len=4096)
    cluster = Cluster(gpus=8, gpus_per_node=4)  # dp crosses the node: the slow link
    grads = 4 * 8e9  # fp32 gradients of the whole model (tp = pp = 1), as bf16 training reduces them
    units = 32 + 2  # one collective per block, the embedding and the head one each
    one = units * all_gather_seconds(grads / units, 8, 50e9, 10e-6)
    transfers = {0: 2, 1: 2, 2: 4 + 1, 3: 3 * 4}
    for zero, n in transfers.items():
        pred = predict(model, cluster, Layout(8, 1, 1, 1, 4, zero=zero))
        assert pred.dp_s == pytest.approx(n * one), zero
        assert 0 <= pred.dp_exposed_s <= pred.dp_s
    inside = predict(model, Cluster(gpus=8, gpus_per_node=8), Layout(8, 1, 1, 1, 4, zero=1))
    assert inside.dp_s == pytest.approx(2 * units * all_gather_seconds(grads / units, 8, 450e9, 5e-6))
    # ZeRO-3's buffers: two blocks gathered (bf16) with their unsharded fp32 gradients; ZeRO-2's: one block's gradients.
    layer = (8e9 - 2 * 128256 * 4096) / 32
    assert predict(model, cluster, Layout(8, 1, 1, 1, 4, zero=3)).buffers == pytest.approx(2 * layer * (2 + 4))
    assert predict(model, cluster, Layout(8, 1, 1, 1, 4, zero=2)).buffers == pytest.approx(layer * 4)


def test_gpu_presets_and_the_reserve():
    assert (HARDWARE["A100"]["peak_flops"], HARDWARE["A100"]["memory"]) == (312e12, 80e9)
    assert (
        HARDWARE["H200"]["memory"] == 141e9
        and HARDWARE["H800"]["intra_bandwidth"] < HARDWARE["H100"]["intra_bandwidth"]
    )
    a100 = Cluster.of("A100", 16, gpus_per_node=8)
    assert (
        a100.name.startswith("A100")
        and a100.link(False) == (25e9, 10e-6)
        and a100.matmul_efficiency == MATMUL_EFFICIENCY
    )
    assert Cluster.of("H100", 8) == Cluster(8)  # the defaults are the H100 preset
    with pytest.raises(ValueError, match="unknown GPU"):
        Cluster.of("V100", 8)
    assert H100x64.usable_memory == 80e9 * (1 - RESERVE_FRACTION) - RESERVE_FIXED
    # A layout refused for memory is one whose prediction exceeds the usable memory, not the GPU's.
    small = Cluster(gpus=64, memory=16e9)
    refused = evaluate(LLAMA70, small, Layout(8, 8, 1, 1, 128, zero=1), 1024)
    assert refused.reason.startswith("does not fit") and refused.memory > small.usable_memory
    # The same layout on A100s is slower than on H100s: lower peak, slower links.
    layout = Layout(8, 8, 1, 1, 128, zero=1)
    assert predict(LLAMA70, Cluster.of("A100", 64), layout).step_s > 2 * predict(LLAMA70, H100x64, layout).step_s


def test_groups_inside_a_node():
    assert inside_one_node(1, 8, 8) and inside_one_node(2, 4, 8) and inside_one_node(4, 2, 8)
    assert not inside_one_node(1, 16, 8)  # TP over two nodes
    assert not inside_one_node(2, 3, 8)  # groups of 6 ranks: the second one straddles ranks 6-11
    assert not inside_one_node(8, 2, 8)  # pipeline neighbours 8 ranks apart


@pytest.mark.parametrize(
    "layout, gpus, words",
    [
        (Layout(4, 2, 4, 1, 256), 64, "cp x dp x tp x pp is not the GPU count"),
        (Layout(8, 3, 1, 1, 128), 24, "heads not divisible by tp"),
        (Layout(4, 16, 1, 1, 256), 64, "TP group crosses a node"),
        (Layout(16, 4, 1, 2, 32), 64, None),
        (Layout(8, 2, 4, 3, 42), 64, "batch does not split"),
        (Layout(1, 8, 8, 1, 1024, zero=1), 64, "ZeRO shards nothing at dp=1"),
        (Layout(8, 8, 1, 1, 128, recompute="half"), 64, "unknown recomputation"),
        (Layout(16, 1, 3, 1, 64), 48, None),  # 80 layers over 3 stages: 27, 27, 26
        (Layout(8, 2, 4, 1, 128, virtual_stages=2), 64, None),
        (Layout(8, 2, 4, 1, 126, virtual_stages=2), 64, "torch's interleaving needs micro-batches in multiples of its"),
        (Layout(8, 2, 4, 1, 126, virtual_stages=2, framework="megatron"), 64, "Megatron-LM's interleaving needs"),
        (Layout(64, 1, 1, 1, 16, virtual_stages=2), 64, "virtual stages without a pipeline"),
        (Layout(1, 1, 64, 1, 1024, zero=0, virtual_stages=2), 64, "more pipeline chunks than layers"),
    ],
)
def test_refused_layouts_say_why(layout, gpus, words):
    reason = check_layout(LLAMA70, Cluster(gpus=gpus), layout, 1024 if layout.microbatches != 126 else 1008)
    assert reason is None if words is None else reason.startswith(words), reason


def test_plan_ranks_runnable_layouts_and_refuses_the_rest():
    predictions = plan(LLAMA70, H100x64, 1024, virtual_stages=(1, 2))
    runnable = [pred for pred in predictions if pred.fits]
    assert 0 < len(runnable) < len(predictions)
    assert predictions[: len(runnable)] == runnable  # runnable first
    speeds = [round(pred.tokens_per_s, 6) for pred in runnable]
    assert speeds == sorted(speeds, reverse=True)
    assert all(pred.memory <= H100x64.usable_memory for pred in runnable)
    assert all(pred.layout.tp <= 8 for pred in runnable)  # no TP across the node boundary
    assert all(pred.layout.zero <= 1 for pred in runnable if pred.layout.pp > 1)
    crossing = [pred for pred in predictions if pred.layout.tp > 8]
    assert crossing and all(pred.reason.startswith("TP group crosses a node") for pred in crossing)
    assert {pred.layout.virtual_stages for pred in runnable} == {1, 2}
    assert len({pred.layout.micro_batch for pred in runnable[:20]}) > 1  # the micro-batch size matters now


def test_context_parallelism_divides_activations_and_adds_the_rings_traffic():
    """cp = 2 holds half of every sequence: the activations of a model with half the sequence. Each of the cp - 1
    ring steps sends a K and a V chunk (2 x s/cp x b x h / t values of 2 bytes) against the attention of one chunk
    (1/cp of the rank's causal attention); backward K and V again and their gradients in fp32 (as production rings
    pass them: three times the bytes) against 2.5 times the compute."""
    layout = Layout(dp=4, tp=8, pp=1, micro_batch=1, microbatches=256, zero=1, cp=2)
    assert check_layout(LLAMA70, H100x64, layout, 1024) is None
    half = Model(70e9, 80, 8192, 64, 128256, 2048)
    assert activation_bytes(LLAMA70, layout) == activation_bytes(half, Layout(4, 8, 1, 1, 256, zero=1))
    s, h, t = 4096, 8192, 8
    step_bytes = 2 * 2 * s / 2 * h / t
    rate = 989e12 * MATMUL_EFFICIENCY * 0.50  # FlashAttention-2's forward on an H100 (hardware.ATTENTION_SPEED)
    backward_rate = 989e12 * MATMUL_EFFICIENCY * 0.43  # and its backward
    attention_step = 4 * s * h / 2 * (s / 2) / t / rate / 2  # causal, forward, one chunk
    backward_step = 4 * s * h / 2 * (s / 2) / t / backward_rate / 2
    inside = predict(LLAMA70, H100x64, layout)  # tp 8 x cp 2 = 16 ranks: the cp pairs are 8 apart, across nodes
    transfer = 10e-6 + step_bytes / 50e9
    backward = 2 * 10e-6 + (step_bytes + 2 * step_bytes) / 50e9  # K and V in bf16, then dK and dV in fp32
    expected = max(0, transfer - attention_step) + max(0, backward - 2.5 * backward_step)
    assert inside.cp_s == pytest.approx(80 * 256 * expected) and inside.cp_s > 0
    # A chunk's attention grows as (s/cp)^2, its K/V as s/cp: at 8K tokens the ring hides inside a node (16 GPUs a
    # node keep the cp pairs in it), not across nodes; at 32K it hides across nodes too.
    for seq_len, across in ((8192, True), (32768, False)):
        longer = Model(70e9, 80, 8192, 64, 128256, seq_len)
        long_layout = Layout(4, 8, 1, 1, 8, zero=1, cp=2)
        assert predict(longer, Cluster(gpus=64, gpus_per_node=16), long_layout).cp_s == 0
        assert (predict(longer, H100x64, long_layout).cp_s > 0) == across
    # TP's all-reduces (4, and 2 that selective recomputation replays) carry s/cp tokens; the gradients go over the
    # dp x cp = 8 ranks that hold the same weights.
    assert inside.tp_s == pytest.approx(80 * 256 * 6 * all_reduce_seconds(2 * 2048 * 8192, 8, 450e9, 5e-6))
    grads = 4 * (80 * (70e9 - 2 * 128256 * 8192) / 80 + 2 * 128256 * 8192) / 8  # fp32 gradients
    assert inside.dp_s == pytest.approx(2 * 82 * all_gather_seconds(grads / 82, 8, 50e9, 10e-6))  # 80 blocks + 2
    assert inside.model_state == predict(LLAMA70, H100x64, Layout(8, 8, 1, 1, 128, zero=1)).model_state
    # Refused: a sequence that does not split into 2 x cp chunks, a product that is not the GPU count.
    odd = Layout(dp=2, tp=8, pp=1, micro_batch=1, microbatches=512, zero=1, cp=3)
    assert check_layout(LLAMA70, Cluster(gpus=48), odd, 1024).startswith("sequence not divisible by 2 x cp")
    assert check_layout(LLAMA70, H100x64, Layout(4, 8, 1, 1, 256, cp=4), 1024).startswith("cp x dp x tp x pp")


MIXTRAL = Model(47e9, 32, 4096, 32, 32000, 4096, experts=8, top_k=2, ffn_hidden=14336)  # Mixtral-8x7B's shape


def test_expert_parallelism_splits_the_experts_and_adds_the_all_to_alls():
    experts = 32 * 8 * 2 * 4096 * 14336  # up and down of every expert of every layer
    assert MIXTRAL.expert_params == experts and MIXTRAL.active_params == 47e9 - experts * 6 / 8
    cluster = Cluster(gpus=8)
    layout = Layout(dp=8, tp=1, pp=1, micro_batch=1, microbatches=8, zero=0, ep=8)
    assert check_layout(MIXTRAL, cluster, layout, 64) is None
    pred = predict(MIXTRAL, cluster, layout)
    # bf16 Adam, 18 bytes a parameter: the dense part whole, 1/8 of the experts.
    assert sum(pred.model_state.values()) == pytest.approx(18 * (47e9 - experts) + 18 * experts / 8, rel=1e-9)
    # Per layer and micro-batch: 4 all-to-alls (dispatch and combine, forward and backward) of 4096 tokens x
    # top-2 x 4096 values x 2 bytes, 7/8 of it to the other ranks, 7 messages each.
    one = 7 * 5e-6 + 4096 * 2 * 4096 * 2 * (7 / 8) / 450e9
    assert pred.ep_s == pytest.approx(32 * 8 * 4 * one)
    # Compute counts the active parameters only: EP saves memory, not FLOPs.
    assert pred.model_flops == pytest.approx(64 * 4096 * (6 * MIXTRAL.active_params + 6 * 32 * 4096 * 4096))
    assert pred.hardware_flops == pytest.approx(
        predict(MIXTRAL, cluster, dataclasses.replace(layout, ep=1)).hardware_flops
    )
    # Each token's MLP activations count top_k times: 1 more whole value and 8 more split ones of 2 bytes.
    sbh, t = 4096 * 4096, 2
    more = activation_bytes_per_layer(4096, 1, 4096, 32, t, False, "selective", top_k=2) - activation_bytes_per_layer(
        4096, 1, 4096, 32, t, False, "selective"
    )
    assert more == sbh * (2 + 8 * 2 / t)
    dense = Model(47e9, 32, 4096, 32, 32000, 4096)
    assert stage_activation_bytes(MIXTRAL, layout) > stage_activation_bytes(dense, layout)


@pytest.mark.parametrize(
    "model, layout, words",
    [
        (MIXTRAL, Layout(8, 1, 1, 1, 8, zero=0, ep=3), "experts not divisible by ep"),
        (MIXTRAL, Layout(2, 4, 1, 1, 32, zero=0, ep=4), "ep does not divide dp x cp"),
        (MIXTRAL, Layout(2, 2, 1, 1, 32, zero=0, cp=2, ep=4), None),  # ep inside dp x cp = 4
        (Model(8e9, 32, 4096, 32, 128256, 4096), Layout(8, 1, 1, 1, 8, zero=0, ep=2), "EP without experts"),
    ],
)
def test_expert_parallel_layouts_refused_with_the_reason(model, layout, words):
    reason = check_layout(model, Cluster(gpus=8), layout, 64)
    assert reason is None if words is None else reason.startswith(words), reason


def test_plan_considers_cp_and_ep():
    predictions = plan(MIXTRAL, Cluster(gpus=16), 64, micro_batches=(1,), cps=(1, 2), eps=(1, 2, 4, 8))
    shapes = {(pred.layout.cp, pred.layout.ep) for pred in predictions}
    assert shapes == {(cp, ep) for cp in (1, 2) for ep in (1, 2, 4, 8)}
    runnable = [pred for pred in predictions if pred.fits]
    assert {pred.layout.ep for pred in runnable} > {1} and {pred.layout.cp for pred in runnable} == {1, 2}
    for pred in predictions:
        lay = pred.layout
        assert lay.dp * lay.cp * lay.tp * lay.pp == 16
        if (lay.dp * lay.cp) % lay.ep:
            assert not pred.fits
    assert any(pred.reason.startswith("ep does not divide dp x cp") for pred in predictions if not pred.fits)


def run_planner(*args):
    """The command line in this process (its main, as `python -m utils.planner` calls it): what it prints and its exit
    code, without a new interpreter importing torch for each call. test_python_m_utils_planner_runs runs it as a
    learner does, once."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = planner_main([str(arg) for arg in args])
        except SystemExit as stopped:  # argparse's refusals (2) and --help (0)
            returncode = stopped.code if isinstance(stopped.code, int) else 1
    return subprocess.CompletedProcess(["python", "-m", "utils.planner", *args], returncode, out.getvalue(),
                                       err.getvalue())  # fmt: skip


def test_python_m_utils_planner_runs():
    """`python -m utils.planner` as a learner types it: the same table as its main in this process."""
    command = [sys.executable, "-m", "utils.planner", *ISSUE_EXAMPLE, "--top", "3"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == run_planner(*ISSUE_EXAMPLE, "--top", "3").stdout


ISSUE_EXAMPLE = (
    "--params 70e9 --layers 80 --hidden 8192 --heads 64 --vocab 128256 --seq-len 4096 --global-batch 1024 "
    "--gpus 64 --gpus-per-node 8 --gpu-memory 80GB"
).split()


def test_command_line_prints_a_ranked_table():
    result = run_planner(*ISSUE_EXAMPLE, "--top", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "tokens/s" in line and "reason" in line)
    rows = [line.split() for line in lines[header + 1 : header + 6]]
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"] and all(row[-1] == "runs" for row in rows)
    assert "MFU(causal)" in lines[header] and "MFU(whole)" in lines[header]
    speeds = [float(row[-4].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert "refused" in lines[header + 6]
    assert "TP group crosses a node" in result.stdout and "does not fit" in result.stdout
    # The same ranking as plan() with the command line's virtual stages, and the help names the presets.
    first = plan(LLAMA70, H100x64, 1024, virtual_stages=(1, 2, 4))[0].layout
    numbers = (first.dp, first.tp, first.pp, first.virtual_stages, first.cp, first.ep, first.micro_batch,
               first.microbatches, first.zero)  # fmt: skip
    assert rows[0][1:11] == [str(v) for v in numbers] + [first.recompute]
    help_text = run_planner("--help").stdout
    assert all(gpu in help_text for gpu in ("A100", "H100", "H200", "H800"))


def test_command_line_takes_a_gpu_preset():
    result = run_planner(*ISSUE_EXAMPLE[:-2], "--gpu", "H200", "--top", "1")
    assert result.returncode == 0 and "H200 SXM 141GB" in result.stdout and "141.0 GB" in result.stdout


def test_command_line_takes_cp_ep_and_experts():
    args = "--params 47e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq-len 32768 --global-batch 64 "
    args += "--gpus 16 --experts 8 --top-k 2 --ffn-hidden 14336 --cp 1,2,4 --ep 1,2,8 --top 3"
    result = run_planner(*args.split())
    assert result.returncode == 0, result.stderr
    assert "ep does not divide dp x cp" in result.stdout and "runs" in result.stdout
    result = run_planner(*args.replace("--top-k 2", "--top-k 9").split())
    assert result.returncode == 2 and "--top-k 9 is more than --experts 8" in result.stderr.splitlines()[-1]
    result = run_planner(*args.replace("--experts 8", "--experts 80").split())
    assert result.returncode == 2 and "not less than --params" in result.stderr.splitlines()[-1]


def test_command_line_refuses_bad_input_in_one_line():
    result = run_planner(*ISSUE_EXAMPLE[:-1], "eighty")
    assert result.returncode == 2 and "--gpu-memory" in result.stderr.splitlines()[-1]
    result = run_planner(*ISSUE_EXAMPLE, "--peak-tflops", "-3")
    assert result.returncode == 2 and "--peak-tflops" in result.stderr.splitlines()[-1]
    result = run_planner(*ISSUE_EXAMPLE, "--gpu", "V100")
    assert result.returncode == 2 and "--gpu" in result.stderr.splitlines()[-1]


def test_when_nothing_runs_it_says_why_and_what_would_and_exits_1():
    """70B on one node: every layout's shape is sound, none fits. The command names the reason that refused the most,
    the least memory any layout needs, and a GPU count that runs it, which is true; it exits with 1."""
    args = [*ISSUE_EXAMPLE]
    args[args.index("--gpus") + 1] = "8"
    args[args.index("--global-batch") + 1] = "64"
    result = run_planner(*args)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    refused = out[out.index("refused") :].splitlines()
    assert "does not fit" in refused[1]  # the most common reason first
    assert "no layout runs" in out and "the least memory any layout needs" in out
    gpus = int(next(line for line in out.splitlines() if " GPUs (" in line).split()[0])
    assert gpus > 8 and any(pred.fits for pred in plan(LLAMA70, Cluster(gpus), 64, virtual_stages=(1, 2, 4)))
    assert not any(pred.fits for pred in plan(LLAMA70, Cluster(8), 64, virtual_stages=(1, 2, 4)))


def test_a_flat_zero3_group_of_thousands_is_not_the_first_choice_at_405b():
    """Llama 3 405B on 16,384 H100s, global batch 2048 x 8K: ZeRO-3 over dp 2048 (pp 1) would gather and
    reduce-scatter every block of every micro-batch across 2048 ranks, each collective paying the ring's 2047
    latencies; the planner's first choice is the published layout's shape, tp 8 x pp 16 x dp 128."""
    model = Model(405e9, 126, 16384, 128, 128000, 8192)
    meta = {"framework": "llama3"}  # Meta's stack, as Llama 3's report describes it
    predictions = plan(model, Cluster.of("H100", 16384), 2048, micro_batches=(1,), virtual_stages=(1, 2, 4),
                       software=meta)  # fmt: skip
    first = predictions[0].layout
    assert predictions[0].fits and (first.dp, first.tp, first.pp) == (128, 8, 16)
    flat = predict(model, Cluster.of("H100", 16384), Layout(2048, 8, 1, 1, 1, zero=3, recompute="selective", **meta))
    assert flat.dp_exposed_s > predictions[0].bubble_s


def test_terms_a_plausible_slip_would_change():
    """Each of these is one term of the physics that a slip in the code would change without failing the tests
    above: interleaved in-flight chunks on a later stage, hardware FLOPs whatever the cp, the head on the last stage,
    ZeRO-1's exposed traffic, narrow K/V and a gated MLP in the activations, the all-to-alls and the ring repeated by
    full recomputation, sequence parallelism's divisibility, a fused kernel's slower attention."""
    p, v = 8, 2
    for stage in (0, 3, 7):
        chunks = 2 * (p - stage - 1) + (v - 1) * p + 1
        assert in_flight(Layout(1, 8, p, 1, 64, virtual_stages=v), stage) == (chunks / v, math.ceil(chunks / v))
    one = predict(LLAMA70, H100x64, Layout(8, 8, 1, 1, 128, zero=1))
    two = predict(LLAMA70, H100x64, Layout(4, 8, 1, 1, 256, zero=1, cp=2))
    assert two.hardware_flops == pytest.approx(one.hardware_flops)  # cp moves work between ranks, adds none
    from utils.planner import stage_work

    layout = Layout(16, 1, 4, 1, 64, zero=1)
    first, last = (stage_work(LLAMA70, H100x64, layout, stage, 20) for stage in (0, 3))
    assert last.flops - first.flops == pytest.approx(3 * 2 * 128256 * 8192 * 4096)  # the head's 6 V h a token
    # ZeRO-1: the reduce-scatter behind the last backward, the all-gather behind the first forward.
    model, cluster = Model(8e9, 32, 4096, 32, 128256, 4096), Cluster(gpus=8, gpus_per_node=1)
    pred = predict(model, cluster, Layout(8, 1, 1, 1, 4, zero=1, recompute="none"))
    work = stage_work(model, cluster, Layout(8, 1, 1, 1, 4, zero=1, recompute="none"), 0, 32)
    half = pred.dp_s / 2
    assert pred.dp_exposed_s == pytest.approx(max(0, half - work.backward_s) + max(0, half - work.forward_s))
    assert pred.dp_exposed_s > 0  # one GPU a node: the NIC cannot hide a whole model's gradients
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    narrow = activation_bytes_per_layer(s, b, h, a, t, False, "none", 2, False, fused_attention=True, kv_fraction=1 / 8)
    wide = activation_bytes_per_layer(s, b, h, a, t, False, "none", 2, False, fused_attention=True)
    assert wide - narrow == pytest.approx(2 * s * b * h * 2 * (1 - 1 / 8) / t)  # K and V
    gated = activation_bytes_per_layer(s, b, h, a, t, False, "none", 2, False, fused_attention=True, gated_mlp=True)
    assert gated - wide == 2 * s * b * h * 4 / t  # the gate's output
    full_ep = predict(MIXTRAL, Cluster(gpus=8), Layout(8, 1, 1, 1, 8, zero=0, ep=8, recompute="full"))
    none_ep = predict(MIXTRAL, Cluster(gpus=8), Layout(8, 1, 1, 1, 8, zero=0, ep=8, recompute="none"))
    assert full_ep.ep_s == pytest.approx(none_ep.ep_s * 6 / 4)
    short = Model(70e9, 80, 8192, 64, 128256, 4096)
    ring = {
        r: predict(short, H100x64, Layout(4, 8, 1, 1, 256, zero=1, cp=2, recompute=r)).cp_s for r in ("none", "full")
    }
    assert ring["full"] > ring["none"] > 0  # the forward ring runs again
    odd = Model(70e9, 80, 8192, 64, 128256, 4098)
    assert check_layout(odd, H100x64, Layout(16, 4, 1, 1, 64), 1024).startswith("sequence not divisible by tp")
    layout = Layout(8, 8, 1, 1, 16, zero=1, recompute="none")
    slow = predict(Model(8e9, 32, 4096, 32, 128256, 131072), Cluster(gpus=64), layout)
    fast = predict(Model(8e9, 32, 4096, 32, 128256, 131072), Cluster(gpus=64, attention_speeds=(("fa2", 1.0),)), layout)
    assert slow.compute_s > 1.3 * fast.compute_s  # at 128K tokens attention is most of the work


def test_bf16_training_keeps_fp32_gradients_and_the_70b_choice_moves():
    """bf16 training holds 2-byte weights, fp32 gradients and Adam's 12 fp32 bytes: 18 a parameter, 6 + 12/d under
    ZeRO-1; the ZeRO paper's fp16 count ("mixed", 16) stays available. The two extra bytes move notebook 06's 70B case:
    the first choice under the fp16 count no longer fits, by exactly its gradients' growth, and fewer layouts run."""
    from utils.memory import bytes_per_param

    assert bytes_per_param("bf16", "adam") == {"params": 2, "grads": 4, "optimizer": 12}
    assert bytes_per_param("mixed", "adam") == {"params": 2, "grads": 2, "optimizer": 12}
    for d in (1, 8, 64):
        assert sum(model_state_bytes(1024 * d, d, 1, "bf16", "adam").values()) == (6 + 12 / d) * 1024 * d
    old = plan(LLAMA70, H100x64, 1024, virtual_stages=(1, 2, 4), precision="mixed")
    new = plan(LLAMA70, H100x64, 1024, virtual_stages=(1, 2, 4))  # the default: bf16
    was_first = evaluate(LLAMA70, H100x64, old[0].layout, 1024)
    assert old[0].fits and was_first.reason.startswith("does not fit"), was_first.reason
    assert was_first.memory - old[0].memory == pytest.approx(old[0].model_state["grads"])  # 2 more bytes: twice 2
    assert new[0].fits and new[0].layout != old[0].layout
    assert sum(pred.fits for pred in new) < sum(pred.fits for pred in old)


def test_interleaved_last_stage_holds_the_head_and_loss_of_one_microbatch():
    """Under interleaving the last rank keeps several micro-batches of its earlier chunks, but a micro-batch's
    backward follows its forward through the last chunk at once: the head's inputs and the fp32 logits exist for one
    micro-batch. At Llama 3 405B's layout that is gigabytes the old count charged per micro-batch in flight."""
    llama405 = Model(405e9, 126, 16384, 128, 128000, 8192, ffn_hidden=53248, kv_heads=8, gated_mlp=True, dropout=False)
    layout = Layout(128, 8, 16, 1, 16, zero=1, recompute="none", framework="megatron", virtual_stages=4)
    last = layout.pp - 1
    worth, microbatches = in_flight(layout, last)
    assert microbatches > 1
    head_and_loss = stage_activation_bytes(llama405, layout, last, layers=0)
    assert activation_bytes(llama405, layout, last, layers=0) == head_and_loss  # one micro-batch's
    assert head_and_loss * (microbatches - 1) > 5e9  # what charging every micro-batch in flight overcounted


def test_dropout_and_tied_embeddings_are_the_models():
    """A model without dropout (Llama) keeps no masks: two 1-byte sbh masks a layer fewer (and the embedding's); with
    tied embeddings one V x h matrix is counted in the parameters, held once by a single stage and copied onto the
    first and the last stage under a pipeline."""
    gpt = Model(70e9, 80, 8192, 64, 128256, 4096)
    llama = dataclasses.replace(gpt, dropout=False)
    layout = Layout(16, 4, 1, 1, 64, recompute="none")
    s, h, t = 4096, 8192, 4
    masks = 2 * s * h / t + s * h / t  # two per layer (split by SP), the embedding's
    per_layer = activation_bytes_per_layer(s, 1, h, 64, t, True, "none", fused_attention=True, framework="torch")
    no_masks = activation_bytes_per_layer(s, 1, h, 64, t, True, "none", dropout=False, fused_attention=True,
                                          framework="torch")  # fmt: skip
    assert per_layer - no_masks == 2 * s * h / t
    assert activation_bytes(gpt, layout) - activation_bytes(llama, layout) == pytest.approx(
        80 * 2 * s * h / t + s * h / t
    )
    assert masks > 0
    tied = dataclasses.replace(gpt, tied_embeddings=True)
    assert tied.layer_params == pytest.approx(gpt.layer_params + gpt.embedding_params / 80)
    one_stage = Layout(64, 1, 1, 1, 16)
    assert sum(stage_params(tied, one_stage, 0, 80)) == pytest.approx(70e9)  # every parameter once
    two_stages = Layout(32, 1, 2, 1, 32)
    both = sum(stage_params(tied, two_stages, 0, 40)) + sum(stage_params(tied, two_stages, 1, 40))
    assert both == pytest.approx(70e9 + tied.embedding_params)  # the head's copy of the embedding
    assert tied.params_from_shapes == pytest.approx(gpt.params_from_shapes - gpt.embedding_params)


def test_matmuls_on_the_roofline_and_expert_products_priced_by_their_tokens():
    """A product of many rows runs at the matmul rate; one of few rows (an expert's share of a micro-batch) is bound by
    the bytes of its weights: 128 tokens a DeepSeek-V3-sized expert on a 4-way TP slice. Expert parallelism gathers
    the tokens of ep ranks for each expert, and the same product runs at the matmul rate again."""
    h800 = Cluster.of("H800", 2048)
    big = (8192, 7168, 7168)
    assert h800.gemm_seconds(*big) == pytest.approx(2 * math.prod(big) / h800.matmul_flops)
    deepseek = Model(671e9, 61, 7168, 128, 128000, 4096, experts=256, top_k=8, ffn_hidden=2921)
    alone = Layout(16, 4, 32, 1, 480, ep=1)
    spread = Layout(128, 1, 16, 1, 120, ep=64)
    dense, experts = layer_gemms(deepseek, alone)
    assert experts[0][0] == 4096 * 8 / 256 == 128  # tokens per expert a micro-batch, without EP
    assert gemm_slowdown(h800, experts) > 1.3 and gemm_slowdown(h800, dense) == 1.0
    assert (
        layer_gemms(deepseek, spread)[1][0][0] == 128 * 64
        and gemm_slowdown(h800, layer_gemms(deepseek, spread)[1]) == 1
    )
    # The dense runs of Table 1 and Llama 3 are compute-bound: the roofline changes none of them.
    assert gemm_slowdown(Cluster.of("A100", 8), layer_gemms(LLAMA70, Layout(1, 8, 1, 1, 1))[0]) == 1.0


def test_all_to_all_overlap_is_a_stated_choice():
    """ep_overlap "none" charges every all-to-all; "compute" hides them behind another micro-batch's compute of the
    layer (DualPipe), charging only the excess; anything else is refused with the choices."""
    cluster = Cluster(gpus=16)
    layout = Layout(16, 1, 1, 1, 4, zero=1, ep=8)
    exposed = all_to_all_seconds(MIXTRAL, cluster, layout)
    assert exposed > 0
    for compute in (0.0, exposed / 2, 2 * exposed):
        hidden = all_to_all_seconds(MIXTRAL, cluster, dataclasses.replace(layout, ep_overlap="compute"), compute)
        assert hidden == pytest.approx(max(0.0, exposed - compute))
    reason = check_layout(MIXTRAL, cluster, dataclasses.replace(layout, ep_overlap="some"), 64)
    assert reason.startswith("unknown all-to-all overlap") and "compute" in reason


def test_a_deepseek_v3_like_moe_on_2048_h800s():
    """671B, 256 experts of which 8 a token, 2,048 H800s, DeepSeek-V3's batch (notebooks/data/published_layouts.json's
    planner_model). With the all-to-alls exposed the first choice is still ep 1, tp 4, pp 32, but at two sequences a
    micro-batch: 256 tokens an expert, where its products reach the matmul rate, and no all-to-all at all, which across
    nodes would cost more than EP saves. With them hidden behind another micro-batch's compute, as DualPipe does, the
    first choice splits the experts (ep > 1) and narrows TP, and DeepSeek's own layout (tp 1, ep 64, pp 16) climbs."""
    from utils.published_runs import load

    entry = load()["comparisons"][0]
    model, cluster = Model(**entry["planner_model"]), Cluster.of("H800", 2048)
    options = dict(micro_batches=(1, 2, 4, 8), eps=(1, 8, 64), virtual_stages=(1, 2, 4))
    ranked = {}
    for overlap in ("none", "compute"):
        runnable = [p for p in plan(model, cluster, 15360, software={"ep_overlap": overlap}, **options) if p.fits]
        published = next(i for i, p in enumerate(runnable) if (p.layout.tp, p.layout.pp, p.layout.ep) == (1, 16, 64))
        ranked[overlap] = (runnable[0].layout, published)
    first, _ = ranked["none"]
    assert (first.ep, first.tp, first.pp, first.micro_batch) == (1, 4, 32, 2)
    _, experts = layer_gemms(model, first)
    assert gemm_slowdown(cluster, experts) == 1.0  # 256 tokens an expert: past the roofline's ridge
    one_sequence = dataclasses.replace(first, micro_batch=1)
    assert gemm_slowdown(cluster, layer_gemms(model, one_sequence)[1]) > 1  # 128: memory-bound
    hidden, published_rank = ranked["compute"]
    assert hidden.ep > 1 and hidden.tp < 4 and published_rank < ranked["none"][1]


def test_the_command_line_states_the_models_the_lesson_discusses():
    """--kv-heads, --ffn-hidden, --gated-mlp, --no-dropout and --framework describe Llama 3 405B as utils.published_runs
    does: the same Model, and so the same memory for Meta's layout; a --params that the sizes contradict is refused
    in one line."""
    from utils import published_runs
    from utils.planner import cli

    entry = next(e for e in published_runs.load()["layouts"] if e["name"] == "Llama 3 405B, 16K GPUs")
    argv = (
        "--params 405e9 --layers 126 --hidden 16384 --heads 128 --kv-heads 8 --vocab 128000 --seq-len 8192 "
        "--ffn-hidden 53248 --gated-mlp --no-dropout --framework llama3 --global-batch 2048 --gpus 16384"
    ).split()
    parser = cli.parser()
    model, cluster, options, state = cli.configure(parser.parse_args(argv), parser)
    assert model == published_runs.model_of(entry) and state["precision"] == "bf16"
    assert options["software"]["framework"] == "llama3"
    row = next(row for row in published_runs.compare(ranks=False) if row.name == entry["name"])
    assert predict(model, cluster, row.layout, **state).memory == pytest.approx(row.memory)
    result = run_planner(*"--params 1e6 --layers 80 --hidden 8192 --heads 64 --vocab 128256 --seq-len 4096".split(),
                         "--global-batch", "64", "--gpus", "8")  # fmt: skip
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and "--params 1e+06" in last and "fix the one that is wrong" in last


def test_mfu_in_both_conventions():
    """The causal count (6 L s h a token for the attention) and the whole one (12 L s h), the same run: at 128K
    tokens the attention is most of the work and the two differ most."""
    for seq_len in (4096, 131072):
        model = Model(8e9, 32, 4096, 32, 128256, seq_len)
        pred = predict(model, Cluster(gpus=64), Layout(8, 8, 1, 1, 16, zero=1, cp=1))
        whole = model_flops_per_token(model, whole_attention=True) / model_flops_per_token(model)
        assert pred.mfu_whole == pytest.approx(pred.mfu * whole)
    assert whole > 1.5  # at 128K tokens


def test_zero_2_3_under_a_pipeline_is_a_framework_choice_priced_per_micro_batch():
    """Framework llama3 (Meta's stack: Llama 3's report, section 3.3.2) shards gradients under a pipeline: the layout
    runs, its gradients are sharded (less memory than ZeRO-1), and it pays one reduce-scatter of the stage's gradients
    a micro-batch, m + 1 transfers a step against ZeRO-1's 2, each past its own backward."""
    meta = dict(framework="llama3", recompute="full")
    zero1, zero2 = (evaluate(LLAMA70, H100x64, Layout(8, 2, 4, 1, 128, zero=z, **meta), 1024) for z in (1, 2))
    assert zero2.fits and zero2.model_state["grads"] == pytest.approx(zero1.model_state["grads"] / 8)
    assert zero2.dp_s == pytest.approx(zero1.dp_s * (128 + 1) / 2)
    assert zero2.step_s > zero1.step_s  # the traffic is priced, not free
    fewer = predict(LLAMA70, H100x64, Layout(8, 2, 4, 4, 32, zero=2, **meta))
    assert fewer.dp_s == pytest.approx(zero1.dp_s * (32 + 1) / 2)  # m, not the batch, sets the traffic
    zero3 = evaluate(LLAMA70, H100x64, Layout(8, 2, 4, 1, 128, zero=3, **meta), 1024)
    assert zero3.reason is None or zero3.reason.startswith("does not fit")
    assert zero3.dp_s == pytest.approx(zero1.dp_s * 3 * 128 / 2)


def test_the_bubble_against_micro_batches_and_whose_rule_limits_them():
    """No ceiling: the 1F1B bubble (p-1)/(m+p-1) shrinks as m grows, about half the step at m = p. Megatron-LM's
    interleaving wants m a multiple of p; torch's a multiple of its rounds, m // p; the command line prints both rules
    and Llama 3's free choice of m beside the bubble."""
    table = bubble_by_microbatches(16)
    assert [m for m, _ in table] == [16, 32, 64, 128, 256]
    assert table[0][1] == pytest.approx(15 / 31) and 0.45 < table[0][1] < 0.5
    assert all(later < earlier for (_, earlier), (_, later) in zip(table, table[1:]))
    assert bubble_by_microbatches(16, v=4)[0][1] == pytest.approx(15 / 4 / (16 + 15 / 4))
    for m in (24, 12):  # pp 8: 12 is one round (12 // 8) for torch, not a multiple of 8 for Megatron-LM
        torch = check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, m, zero=0, virtual_stages=2), m)
        megatron = check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, m, zero=0, virtual_stages=2,
                                                         framework="megatron"), m)  # fmt: skip
        llama3 = check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, m, zero=0, virtual_stages=2, framework="llama3"), m)
        assert torch is None and llama3 is None, (torch, llama3)  # Llama 3's schedule takes any m (its Figure 6)
        assert (megatron is None) if m == 24 else megatron.startswith("Megatron-LM's interleaving"), (m, megatron)
    assert check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, 9, zero=0, virtual_stages=2), 9) is None  # 1 round
    few = check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, 4, zero=0), 4)  # plain 1F1B, m < p
    assert few.startswith("torch's Schedule1F1B needs at least pp micro-batches"), few
    assert check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, 4, zero=0, framework="megatron"), 4) is None  # capped
    odd = check_layout(LLAMA70, H100x64, Layout(1, 8, 8, 1, 17, zero=0, virtual_stages=2), 17)  # 2 rounds of 8
    assert odd.startswith("torch's interleaving"), odd
    line = bubble_lines(16, 1)
    assert "m=16: 48.4%" in line and "Megatron-LM needs m >= p" in line and "Llama 3 lets m be any number" in line
    args = "--params 8e9 --layers 32 --hidden 4096 --heads 32 --vocab 128256 --seq-len 8192 --global-batch 256 "
    args += "--gpus 64 --micro-batches 1 --bubble --attention-kernel fa3 --top 1"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert planner_main(args.split()) == 0
    assert "framework torch, attention fa3" in out.getvalue().splitlines()[0]


def test_grouped_query_attention_bounds_tp_by_the_kv_heads():
    """Megatron-LM splits whole K/V heads over the TP group (tp must divide them): with 8 K/V heads, tp 8 runs and
    tp 16 is refused, with the reason in the table."""
    gqa = dataclasses.replace(LLAMA70, kv_heads=8)
    wide = Cluster(gpus=128, gpus_per_node=16)
    assert check_layout(gqa, wide, Layout(16, 8, 1, 1, 64), 1024) is None
    reason = check_layout(gqa, wide, Layout(8, 16, 1, 1, 128), 1024)
    assert reason.startswith("K/V heads not divisible by tp") and "8 K/V heads, tp=16" in reason, reason
    assert check_layout(LLAMA70, wide, Layout(8, 16, 1, 1, 128), 1024) is None  # 64 K/V heads without GQA
    refused = [pred for pred in plan(gqa, wide, 1024, micro_batches=(1,)) if pred.layout.tp == 16]
    assert refused and all(pred.reason.startswith("K/V heads not divisible by tp") for pred in refused)


# A Llama-3-70B-shaped model at 128K tokens on 8 nodes of H100s, 16 sequences a step.
LLAMA70_128K = Model(70e9, 80, 8192, 64, 128256, 131072, kv_heads=8, gated_mlp=True, ffn_hidden=28672, dropout=False)


def test_the_attention_kernel_is_a_stated_choice_that_exposes_zero3_traffic_at_128k():
    """Shah et al. 2024 measured FlashAttention-2 at 370 TFLOP/s forward and 322 backward on an H100, FlashAttention-3
    at 648 and 561 (head dimension 128). At 128K tokens, where the attention is most of the work, FA3 makes the step
    about 1.4 times faster; and its shorter compute no longer hides ZeRO-3's parameter traffic over the 16-rank cp
    group of the first choice (tp 4, cp 16), so that choice's lead over tp 8 with cp 8 (half the bytes a rank) shrinks.
    FA3 is refused on an A100 (Hopper only)."""
    cluster = Cluster.of("H100", 64)
    first, lead = {}, {}
    for kernel in ("fa2", "fa3"):
        software = {"attention_kernel": kernel, "framework": "llama3"}
        runnable = [pred for pred in plan(LLAMA70_128K, cluster, 16, micro_batches=(1,), cps=(1, 2, 4, 8, 16),
                                          software=software) if pred.fits]  # fmt: skip
        first[kernel] = runnable[0]
        tp8_cp8 = next(pred for pred in runnable if (pred.layout.tp, pred.layout.cp) == (8, 8))
        lead[kernel] = runnable[0].tokens_per_s / tp8_cp8.tokens_per_s
    fa2, fa3 = first["fa2"], first["fa3"]
    assert (fa2.layout.tp, fa2.layout.cp) == (fa3.layout.tp, fa3.layout.cp) == (4, 16), (fa2.layout, fa3.layout)
    assert fa2.dp_exposed_s == 0 < fa3.dp_exposed_s  # FA3's shorter compute: its ZeRO-3 traffic shows
    assert 1 < lead["fa3"] < lead["fa2"], lead
    assert fa3.tokens_per_s > 1.3 * fa2.tokens_per_s, (fa2.tokens_per_s, fa3.tokens_per_s)
    same = predict(LLAMA70_128K, cluster, dataclasses.replace(fa2.layout, attention_kernel="fa3"))
    assert same.compute_s < 0.7 * fa2.compute_s
    a100 = Cluster.of("A100", 64)
    reason = check_layout(LLAMA70_128K, a100, dataclasses.replace(fa3.layout, attention_kernel="fa3"), 16)
    assert reason.startswith("attention kernel not on this GPU"), reason
    assert check_layout(LLAMA70_128K, a100, dataclasses.replace(fa3.layout, fused_attention=False,
                                                                attention_kernel="fa3"), 16) is None  # fmt: skip
    assert Cluster.of("H100", 8).attention_flops("fa3") == pytest.approx(989e12 * MATMUL_EFFICIENCY * 0.87)
    assert Cluster.of("H100", 8).attention_flops("fa3", backward=True) == pytest.approx(
        989e12 * MATMUL_EFFICIENCY * 0.76
    )
    with pytest.raises(ValueError, match="does not run on A100"):
        a100.attention_flops("fa3")
